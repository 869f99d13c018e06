"""Fetch or prefill: whether getting a cached prefix from a peer beats computing it here.

A fetch is expected to take its bytes on the wire over the rate this machine measured from that
peer (on earlier transfers, or a short probe when there were none), plus a fixed setup; a prefill,
its tokens over this model's prefill rate on this machine (a calibration, refreshed by every
prefill). The faster is taken. Over Wi-Fi a short prefix of a small model is cheaper to recompute
on a fast Mac; over 10 GbE or Thunderbolt nearly every prefix is cheaper to fetch.

The rates persist in `rates.json` in the data directory, so a machine learns its links and models
once. Needs no MLX: `scripts/paper_model.py` runs the same arithmetic on published rates.
"""

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
# Connecting, the lookup and the manifest's round trip on a LAN: what a fetch costs before its bytes.
FETCH_SETUP_S = 0.01
# A new measurement counts this much against what was known (an exponential moving average):
# links and machines change (Wi-Fi moves, a Mac throttles), and one odd transfer must not rule.
NEW_WEIGHT = 0.5
# Transfers and prefills shorter than these say more about latency than about rates: not recorded.
MIN_TIMED_BYTES = 1 << 20
MIN_TIMED_TOKENS = 32
# A probe moves this share of the cache it is for, within these bounds (the server allows 8 MiB).
PROBE_SHARE = 4
MIN_PROBE_BYTES, MAX_PROBE_BYTES = 256 << 10, 4 << 20
RATES_FILE = "rates.json"


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


def expected_prefill_s(tokens: float, tokens_per_s: float) -> float:
    return tokens / tokens_per_s


def choose(
    tokens: int, wire_bytes: int, bytes_per_s: float, tokens_per_s: float, where: str = "the peer", measured: str = ""
) -> Choice:
    """Fetch `tokens` (`wire_bytes` on the wire) from `where` at `bytes_per_s`, or prefill them at
    `tokens_per_s`, whichever is expected to be faster. `measured` says where the link rate came from."""
    fetch_s = expected_fetch_s(wire_bytes, bytes_per_s)
    prefill_s = expected_prefill_s(tokens, tokens_per_s)
    fetch = fetch_s < prefill_s
    reason = (
        f"{tokens:,} cached tokens at {where}: fetching {wire_bytes / 1e6:,.1f} MB at "
        f"{bytes_per_s / 1e6:,.0f} MB/s{f' ({measured})' if measured else ''} takes about {fetch_s:.2f} s, "
        f"prefilling them here at {tokens_per_s:,.0f} tokens/s about {prefill_s:.2f} s: "
        + ("fetch" if fetch else "prefill")
    )
    return Choice(fetch, fetch_s, prefill_s, reason)


def probe_bytes(wire_bytes: int) -> int:
    """How much to probe before a fetch of `wire_bytes`: a share of it, never more than the fetch."""
    return max(MIN_PROBE_BYTES, min(MAX_PROBE_BYTES, wire_bytes // PROBE_SHARE))


def blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * new


class Rates:
    """The link rate to each peer (bytes/s of fetched payload) and the prefill rate of each model
    (tokens/s) this machine measured, kept in `rates.json`.

    Every update re-reads the file before writing it (atomically), so processes sharing a data
    directory (`kvmesh generate`, `kvmesh serve`) keep each other's measurements. A damaged file is
    set aside with a warning: the rates are measured again.
    """

    def __init__(self, data_dir: Path | str):
        self.path = Path(data_dir) / RATES_FILE
        self.links: dict[str, dict] = {}
        self.prefill: dict[str, dict] = {}
        self._load()

    def link_rate(self, address: str) -> float | None:
        entry = self.links.get(address)
        return entry["bytes_per_s"] if entry else None

    def prefill_rate(self, model_id: str) -> float | None:
        entry = self.prefill.get(model_id)
        return entry["tokens_per_s"] if entry else None

    def link_source(self, address: str) -> str:
        """Where the rate of `address` came from, for explanations."""
        entry = self.links.get(address, {})
        n = entry.get("transfers", 0)
        return f"measured on {n} transfer{'s' if n != 1 else ''}" if n else "probed"

    def record_probe(self, address: str, bytes_per_s: float) -> None:
        """A probe's rate: kept until transfers measure the link (it never overrides them)."""
        self._load()
        if address not in self.links:
            self.links[address] = {"bytes_per_s": bytes_per_s, "transfers": 0}
            self._save()

    def record_transfer(self, address: str, wire_bytes: int, seconds: float) -> None:
        """A fetch from `address` moved `wire_bytes` in `seconds` (from request to caches ready)."""
        if wire_bytes < MIN_TIMED_BYTES or seconds <= FETCH_SETUP_S:
            return
        self._load()
        entry = self.links.get(address, {})
        rate = wire_bytes / (seconds - FETCH_SETUP_S)
        old = entry.get("bytes_per_s") if entry.get("transfers") else None  # a probe gives way
        self.links[address] = {"bytes_per_s": blend(old, rate), "transfers": entry.get("transfers", 0) + 1}
        self._save()

    def record_prefill(self, model_id: str, tokens: int, seconds: float) -> None:
        """This machine prefilled `tokens` of the model `model_id` in `seconds`."""
        if tokens < MIN_TIMED_TOKENS or seconds <= 0:
            return
        self._load()
        entry = self.prefill.get(model_id, {})
        rate = blend(entry.get("tokens_per_s"), tokens / seconds)
        self.prefill[model_id] = {"tokens_per_s": rate, "prefills": entry.get("prefills", 0) + 1}
        self._save()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self.links, self.prefill = dict(data["links"]), dict(data["prefill"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s is unreadable (%s): rates are measured again", self.path, e)
            self.links, self.prefill = {}, {}

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".part", delete=False) as f:
                json.dump({"links": self.links, "prefill": self.prefill}, f, indent=1)
            os.replace(f.name, self.path)
        except OSError as e:  # a full disk: the rates are only advice
            log.warning("cannot keep rates in %s: %s", self.path, e.strerror or e)
