"""Fetch or prefill: whether getting a cached prefix from a peer beats computing it here.

A fetch is expected to take its bytes on the wire over the rate this machine measured from that
peer (on earlier transfers, or a short probe when there were none), plus a fixed setup; a prefill,
what a model fitted to this machine's timed prefills of the model says (a calibration of two
lengths, refreshed by every prefill; attention makes long prefixes slower per token). The faster
is taken. Over Wi-Fi a short prefix of a small model is cheaper to recompute on a fast Mac; over
10 GbE or Thunderbolt nearly every prefix is cheaper to fetch.

The rates persist in `rates.json` in the data directory, so a machine learns its links and models
once. Needs no MLX: `scripts/paper_model.py` runs the same arithmetic on published rates.
"""

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvmesh import paths

log = logging.getLogger(__name__)
# Connecting, the lookup and the manifest's round trip on a LAN: what a fetch costs before its bytes.
FETCH_SETUP_S = 0.01
# A new measurement counts this much against what was known (an exponential moving average):
# links and machines change (Wi-Fi moves, a Mac throttles), and one odd transfer must not rule.
NEW_WEIGHT = 0.5
# Transfers and prefills shorter than these say more about latency than about rates: not recorded.
MIN_TIMED_BYTES = 1 << 20
MIN_TIMED_TOKENS = 32
# The prefill model is fitted to this many of the latest prefills of a model.
PREFILL_SAMPLES = 16
# A probe moves this share of the cache it is for, within these bounds (the server allows 8 MiB).
PROBE_SHARE = 4
MIN_PROBE_BYTES, MAX_PROBE_BYTES = 256 << 10, 4 << 20

# How a command or server takes peers' caches: "auto" weighs each fetch against a local prefill.
FETCH_MODES = ("auto", "always")
FETCH_HELP = (
    "auto: fetch a peer's cache only when that is expected to beat prefilling its tokens here (link rates "
    "measured per peer, this model's prefill rate measured here; kept in the data dir); always: whenever a "
    "peer has a longer prefix"
)


@dataclass(frozen=True)
class Choice:
    """Fetch or prefill, the times expected of each, and a sentence saying why."""

    fetch: bool
    fetch_s: float
    prefill_s: float
    reason: str

    def __str__(self) -> str:
        return self.reason


def expected_fetch_s(wire_bytes: float, bytes_per_s: float) -> float:
    return FETCH_SETUP_S + wire_bytes / bytes_per_s


@dataclass(frozen=True)
class PrefillModel:
    """Prefill time of `tokens` tokens after `context` cached ones: tokens * (per_token_s +
    per_pair_s * (context + tokens / 2)). The layers' work grows with the tokens, attention with
    the positions each token attends to, so long prefixes prefill slower per token than short ones."""

    per_token_s: float
    per_pair_s: float = 0.0

    def seconds(self, tokens: float, context: float = 0) -> float:
        return tokens * (self.per_token_s + self.per_pair_s * (context + tokens / 2))

    def rate(self, tokens: float, context: float = 0) -> float:
        """Tokens per second over a prefill of `tokens` after `context`."""
        return tokens / self.seconds(tokens, context)

    @classmethod
    def at_rate(cls, tokens_per_s: float) -> "PrefillModel":
        """A rate that does not depend on the length (published figures)."""
        return cls(1 / tokens_per_s)


def fit_prefill(samples: list[tuple[float, float, float]]) -> PrefillModel | None:
    """The PrefillModel that best fits timed prefills (tokens, context, seconds), each weighed by its
    relative error; the attention term only when the samples tell it apart (two lengths or more)."""
    samples = [(m, c, t) for m, c, t in samples if m > 0 and t > 0]
    if not samples:
        return None
    rows = [(m / t, m * (c + m / 2) / t) for m, c, t in samples]
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    b1, b2 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-9 * s11 * s22:
        a, b = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
        if a > 0 and b >= 0:
            return PrefillModel(a, b)
    return PrefillModel(b1 / s11)  # one term: least relative error with per-token time only


def choose(
    tokens: int,
    wire_bytes: int,
    bytes_per_s: float,
    prefill: PrefillModel,
    *,
    context: int = 0,
    where: str = "the peer",
    measured: str = "",
) -> Choice:
    """Fetch `tokens` (`wire_bytes` on the wire) from `where` at `bytes_per_s`, or prefill them after
    the `context` tokens already held, whichever is expected to be faster. `measured` says where the
    link rate came from."""
    fetch_s = expected_fetch_s(wire_bytes, bytes_per_s)
    prefill_s = prefill.seconds(tokens, context)
    fetch = fetch_s < prefill_s
    reason = (
        f"{tokens:,} cached tokens at {where}: fetching {wire_bytes / 1e6:,.1f} MB at "
        f"{bytes_per_s / 1e6:,.1f} MB/s{f' ({measured})' if measured else ''} takes about {fetch_s:.2f} s, "
        f"prefilling them here at {figure(prefill.rate(tokens, context))} tokens/s about {prefill_s:.2f} s: "
        + ("fetch" if fetch else "prefill")
    )
    return Choice(fetch, fetch_s, prefill_s, reason)


def figure(x: float) -> str:
    """A rate as people read it: whole numbers from 100 on, else three significant digits (a slow
    machine's 1.37 tokens/s is not "1")."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def probe_bytes(wire_bytes: int) -> int:
    """How much to probe before a fetch of `wire_bytes`: a share of it, within MIN/MAX_PROBE_BYTES."""
    return max(MIN_PROBE_BYTES, min(MAX_PROBE_BYTES, wire_bytes // PROBE_SHARE))


def blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * new


class Rates:
    """The link rate to each peer (bytes/s of fetched payload) and the latest timed prefills of each
    model this machine measured, kept in `rates.json`.

    Every update re-reads the file before writing it (atomically), so processes sharing a data
    directory (`kvmesh generate`, `kvmesh serve`) keep each other's measurements, and takes a lock,
    so threads of one process (serve's lookups) do too. A damaged file is ignored with a warning,
    and replaced at the next update: the rates are measured again.
    """

    def __init__(self, data_dir: Path | str):
        self.path = paths.rates_file(data_dir)
        self.links: dict[str, dict] = {}
        # model id -> [[tokens, context, seconds], ...], the latest last
        self.prefill: dict[str, list] = {}
        self._lock = threading.Lock()
        self._load()

    def link_rate(self, address: str) -> float | None:
        entry = self.links.get(address)
        return entry["bytes_per_s"] if entry else None

    def prefill_model(self, model_id: str) -> PrefillModel | None:
        """How fast this machine prefills the model, fitted to its latest timed prefills."""
        return fit_prefill([tuple(x) for x in self.prefill.get(model_id, [])])

    def link_source(self, address: str) -> str:
        """Where the rate of `address` came from, for explanations."""
        entry = self.links.get(address, {})
        n = entry.get("transfers", 0)
        return f"measured on {n} transfer{'s' if n != 1 else ''}" if n else "probed"

    def record_probe(self, address: str, bytes_per_s: float) -> None:
        """A probe's rate: kept until transfers measure the link (it never overrides them)."""
        with self._lock:
            self._load()
            if address not in self.links:
                self.links[address] = {"bytes_per_s": bytes_per_s, "transfers": 0}
                self._save()

    def record_transfer(self, address: str, wire_bytes: int, seconds: float) -> None:
        """A fetch from `address` moved `wire_bytes` in `seconds` (from request to caches ready)."""
        if wire_bytes < MIN_TIMED_BYTES or seconds <= FETCH_SETUP_S:
            return
        with self._lock:
            self._load()
            entry = self.links.get(address, {})
            rate = wire_bytes / (seconds - FETCH_SETUP_S)
            old = entry.get("bytes_per_s") if entry.get("transfers") else None  # a probe gives way
            self.links[address] = {"bytes_per_s": blend(old, rate), "transfers": entry.get("transfers", 0) + 1}
            self._save()

    def record_prefill(self, model_id: str, tokens: int, seconds: float, *, context: int = 0) -> None:
        """This machine prefilled `tokens` of the model `model_id`, after `context` cached ones, in `seconds`."""
        if tokens < MIN_TIMED_TOKENS or seconds <= 0:
            return
        with self._lock:
            self._load()
            samples = [*self.prefill.get(model_id, []), [tokens, context, seconds]]
            self.prefill[model_id] = samples[-PREFILL_SAMPLES:]
            self._save()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self.links = {
                str(address): {"bytes_per_s": float(link["bytes_per_s"]), "transfers": int(link["transfers"])}
                for address, link in data["links"].items()
            }
            self.prefill = {
                str(model): [[float(tokens), float(context), float(seconds)] for tokens, context, seconds in samples]
                for model, samples in data["prefill"].items()
            }
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("%s is unreadable (%s): rates are measured again", self.path, e)
            self.links, self.prefill = {}, {}

    def _save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.part")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"links": self.links, "prefill": self.prefill}, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk: the rates are only advice
            tmp.unlink(missing_ok=True)
            log.warning("cannot keep rates in %s: %s", self.path, e.strerror or e)
