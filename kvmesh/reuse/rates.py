"""What this machine measured: the link rate to each peer (and the rate each codec's copies stream
at from it), its timed prefills of each model, and how long it takes to decode each model's caches
in each codec, kept in `rates.json` in the data directory.

A prefill is predicted by a model fitted to the timed prefills (a calibration of two lengths,
refreshed by every prefill; attention makes long prefixes slower per token). A machine learns its
links, models and decoders once. Needs no MLX: `scripts/paper_model.py` runs the same arithmetic on
published rates.
"""

import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path

from kvmesh import paths
from kvmesh.codec.timing import CodecTime
from kvmesh.files.atomic import write_atomic

log = logging.getLogger(__name__)
# Connecting, the lookup and the manifest's round trip on a LAN: what a fetch costs before its bytes,
# until fetches from that peer measured it (`Rates.link_setup`).
FETCH_SETUP_S = 0.01
# A new measurement counts this much against what was known (an exponential moving average):
# links and machines change (Wi-Fi moves, a Mac throttles), and one odd transfer must not rule.
NEW_WEIGHT = 0.5
# Transfers and prefills shorter than these say more about latency than about rates: not recorded.
MIN_TIMED_BYTES = 1 << 20
MIN_TIMED_TOKENS = 32
# The prefill model is fitted to this many of the latest prefills of a model.
PREFILL_SAMPLES = 16
# The codecs a copy of a cache may travel in, as the decode times and stream rates name them: fp16 or float32 as
# computed, mlx-lm's 8-bit (or other) quantization, the transform codec (kvmesh.codec.transform), and
# the transform codec with each layer predicted from the one before (`--compress small`:
# kvmesh.codec.prediction), which decodes slower on a CPU.
CODECS = ("full", "quantized", "transform", "predicted")
# Those that need the model's basis.
TRANSFORM_CODECS = ("transform", "predicted")
# The bases remembered per model (a mesh codes a model's caches with one or a few).
BASES_KEPT = 8


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


@dataclass(frozen=True)
class Decoding:
    """How long this machine takes to decode a model's caches, by codec, and the size of the model's
    transform basis (what a receiver without it fetches first)."""

    times: dict[str, CodecTime]
    basis_bytes: int = 0

    def seconds(self, codec: str, tokens: float) -> float | None:
        """Decoding a cache of `tokens` tokens in `codec` here; None when never measured."""
        time = self.times.get(codec)
        return time.seconds(tokens) if time else None


def _measured(entry: dict) -> dict:
    """A rate measured on transfers, as rates.json keeps it."""
    return {"bytes_per_s": float(entry["bytes_per_s"]), "transfers": int(entry["transfers"])}


def _blended(measured: dict | None, rate: float) -> dict:
    """A rate measured on transfers (None: never), with one more transfer's `rate` blended in."""
    old = measured or {"transfers": 0}
    return {"bytes_per_s": blend(old.get("bytes_per_s"), rate), "transfers": old["transfers"] + 1}


def _link(link: dict) -> dict:
    """A peer's entry in rates.json, checked: its link rate, and what older files may lack (its
    setup, each codec's stream rate, its bases' rate)."""
    out = _measured(link)
    if "setup_s" in link:
        out["setup_s"] = float(link["setup_s"])
    if "streams" in link:
        out["streams"] = {str(c): _measured(r) for c, r in link["streams"].items() if c in CODECS}
    if "basis" in link:
        out["basis"] = _measured(link["basis"])
    return out


def blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * new


class Rates:
    """The link rate to each peer (bytes/s of fetched payload), the latest timed prefills of each
    model and its decode times, kept in `rates.json`.

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
        # model id -> {"times": {codec: [fixed_s, per_token_s]}, "basis_bytes": n}
        self.decode: dict[str, dict] = {}
        # model id -> the sha256 of each basis its fetched caches were coded with, the latest last
        self.bases: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._load()

    def link_rate(self, address: str) -> float | None:
        entry = self.links.get(address)
        return entry["bytes_per_s"] if entry else None

    def stream_rate(self, address: str, codec: str) -> float | None:
        """The rate copies in `codec` stream at from `address`, measured on their fetches, else the
        link's. A copy of many small chunks (an 8-bit cache travels as six tensors a layer) streams
        slower than its bytes alone say: each chunk is a message that both ends handle."""
        stream = self.links.get(address, {}).get("streams", {}).get(codec)
        return stream["bytes_per_s"] if stream else self.link_rate(address)

    def prefill_model(self, model_id: str) -> PrefillModel | None:
        """How fast this machine prefills the model, fitted to its latest timed prefills."""
        return fit_prefill([tuple(x) for x in self.prefill.get(model_id, [])])

    def decoding(self, model_id: str) -> Decoding | None:
        """How fast this machine decodes the model's caches; None when never measured."""
        entry = self.decode.get(model_id)
        if not entry:
            return None
        return Decoding({c: CodecTime(*t) for c, t in entry["times"].items()}, int(entry["basis_bytes"]))

    def basis_rate(self, address: str) -> float | None:
        """The rate a basis comes ready at from `address` (its bytes, then checked, parsed and kept
        here: an 8B model's is ~130 MB), measured on fetches that brought one, else the link's."""
        basis = self.links.get(address, {}).get("basis")
        return basis["bytes_per_s"] if basis else self.link_rate(address)

    def record_basis(self, address: str, basis_bytes: int, seconds: float) -> None:
        """A fetch from `address` brought `basis_bytes` of bases, ready in `seconds`. Kept beside a
        link rate only (a probe's or a transfer's)."""
        if basis_bytes < MIN_TIMED_BYTES or seconds <= 0:
            return
        with self._lock:
            self._load()
            if (entry := self.links.get(address)) is None:
                return
            entry["basis"] = _blended(entry.get("basis"), basis_bytes / seconds)
            self._save()

    def link_setup(self, address: str) -> float:
        """Seconds a fetch from `address` takes before its bytes stream: measured on its fetches
        (`record_setup`), else FETCH_SETUP_S."""
        return float(self.links.get(address, {}).get("setup_s", FETCH_SETUP_S))

    def record_setup(self, address: str, seconds: float) -> None:
        """A fetch from `address` took `seconds` from its request to its first chunk, less that
        chunk's and any basis's bytes at the link's rate: connecting, the manifest's round trip, the
        receiver's buffers. Kept only beside a link rate measured on transfers."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            self._load()
            entry = self.links.get(address)
            if not entry or not entry.get("transfers"):
                return
            entry["setup_s"] = blend(entry.get("setup_s"), seconds)
            self._save()

    def link_source(self, address: str, codec: str | None = None) -> str:
        """Where the rate of `address` (for copies in `codec`: `stream_rate`) came from, for explanations."""
        entry = self.links.get(address, {})
        if codec is not None and (stream := entry.get("streams", {}).get(codec)):
            n = stream["transfers"]
            return f"{codec} copies measured on {n} transfer{'s' if n != 1 else ''}"
        n = entry.get("transfers", 0)
        return f"measured on {n} transfer{'s' if n != 1 else ''}" if n else "probed"

    def record_probe(self, address: str, bytes_per_s: float) -> None:
        """A probe's rate: kept until transfers measure the link (it never overrides them)."""
        with self._lock:
            self._load()
            if address not in self.links:
                self.links[address] = {"bytes_per_s": bytes_per_s, "transfers": 0}
                self._save()

    def record_transfer(
        self, address: str, wire_bytes: int, seconds: float, *, codec: str | None = None, at_least: bool = False
    ) -> None:
        """A fetch from `address` of a copy in `codec` streamed `wire_bytes` in `seconds` (its setup
        excluded): that codec's stream rate. With `at_least`, decoding paced it: the link is at least
        that fast, so it only ever raises the link's rate."""
        if wire_bytes < MIN_TIMED_BYTES or seconds <= 0:
            return
        with self._lock:
            self._load()
            entry = self.links.setdefault(address, {"bytes_per_s": 0.0, "transfers": 0})
            rate = wire_bytes / seconds
            if codec is not None:
                streams = entry.setdefault("streams", {})
                streams[codec] = _blended(streams.get(codec), rate)
            old = entry["bytes_per_s"] if entry["transfers"] else None  # a probe gives way
            if not (at_least and old is not None and rate <= old):
                entry.update(bytes_per_s=blend(old, rate), transfers=entry["transfers"] + 1)
            self._save()

    def record_prefill(self, model_id: str, tokens: int, seconds: float, *, context: int = 0) -> None:
        """This machine prefilled `tokens` of the model `model_id`, after `context` cached ones, in
        `seconds`: the one record of a prefill, whichever generation loop ran it."""
        if tokens < MIN_TIMED_TOKENS or seconds <= 0:
            return
        with self._lock:
            self._load()
            samples = [*self.prefill.get(model_id, []), [tokens, context, seconds]]
            self.prefill[model_id] = samples[-PREFILL_SAMPLES:]
            self._save()

    def record_decoding(self, model_id: str, decoding: Decoding) -> None:
        """This machine's decode times of the model's caches (kvmesh.reuse.calibration), each term
        blended with what was measured before."""
        with self._lock:
            self._load()
            old = self.decode.get(model_id, {}).get("times", {})
            times = {
                codec: [blend(old[codec][0], t.fixed_s), blend(old[codec][1], t.per_token_s)]
                if codec in old
                else [t.fixed_s, t.per_token_s]
                for codec, t in decoding.times.items()
            }
            self.decode[model_id] = {"times": {**old, **times}, "basis_bytes": decoding.basis_bytes}
            self._save()

    def record_bases(self, model_id: str, digests: list[str]) -> None:
        """A fetched cache of the model was coded with these bases: a receiver that keeps them needs
        them no more (`bases` says which to look for)."""
        known = self.bases.get(model_id, [])
        if not digests or set(digests) <= set(known):
            return
        with self._lock:
            self._load()
            kept = [d for d in self.bases.get(model_id, []) if d not in digests] + list(digests)
            self.bases[model_id] = kept[-BASES_KEPT:]
            self._save()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self.links = {str(address): _link(link) for address, link in data["links"].items()}
            self.prefill = {
                str(model): [[float(tokens), float(context), float(seconds)] for tokens, context, seconds in samples]
                for model, samples in data["prefill"].items()
            }
            self.decode = {  # absent from files written before decoding was measured
                str(model): {
                    "times": {
                        str(c): [float(fixed), float(per_token)]
                        for c, (fixed, per_token) in entry["times"].items()
                        if c in CODECS
                    },
                    "basis_bytes": int(entry["basis_bytes"]),
                }
                for model, entry in data.get("decode", {}).items()
                if "times" in entry  # one rate per codec before decode times: measured again
            }
            self.bases = {str(model): [str(d) for d in digests] for model, digests in data.get("bases", {}).items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("%s is unreadable (%s): rates are measured again", self.path, e)
            self.links, self.prefill, self.decode, self.bases = {}, {}, {}, {}

    def _save(self) -> None:
        data = {"links": self.links, "prefill": self.prefill, "decode": self.decode, "bases": self.bases}
        try:
            write_atomic(self.path, json.dumps(data, indent=1))
        except OSError as e:  # a full disk: the rates are only advice
            log.warning("cannot keep rates in %s: %s", self.path, e.strerror or e)
