"""Fetch or prefill, and which copy: the cost model and the typed record of each decision.

A fetch of a copy is expected to take a setup, then the coding when the peer codes it on request
(kvmesh.net.on_request: before its manifest), then the basis it needs when this machine lacks it
(it travels first), then its bytes on the wire and their decoding, which overlap as chunks arrive,
so the slower of the two, and last the decode of the last layer to arrive:

    setup + encode + basis / link + max(wire / stream rate, decode) + decode / layers

The stream rate is the one its codec's copies reached from that peer, else the link's (earlier
transfers, else a probe); the decode time what this machine measured for the model and codec, for
the copy's tokens (kvmesh.reuse.calibration). A prefill
takes what the model fitted to this machine's timed prefills says (kvmesh.reuse.rates). Among the
copies peers hold of a prefix (full, 8-bit, transform coded, or coded on request from a full one:
each within the quality floor) the one expected soonest is weighed against the prefill, and the
faster is taken. Over Wi-Fi a coded copy's fewer bytes win; over 10 GbE or Thunderbolt decoding
(or coding) it may cost more than the bytes it saves, and the full copy wins. Needs no MLX.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.reuse.rates import FETCH_SETUP_S, PrefillModel

# A probe moves this share of the cache it is for, within these bounds (the server allows 8 MiB).
PROBE_SHARE = 4
MIN_PROBE_BYTES, MAX_PROBE_BYTES = 256 << 10, 4 << 20
# A probe that arrived sooner than this is too short to tell the link's rate from its round trip
# and from a shaper's burst (a 256 KiB probe over a tbf-shaped 1 Gbit/s link measured 151 MB/s,
# 1.2x the line's rate, and the choice fetched the wrong copy): it is made again at MAX_PROBE_BYTES
# (at 1 Gbit/s ~35 ms more; over a slow link whose shaper let the first through in a burst, up to
# the probe's timeout, after which the first is kept).
MIN_PROBE_SECONDS = 0.05

# How a command or server takes peers' caches: "auto" weighs each fetch against a local prefill.
FETCH_MODES = ("auto", "always")
FETCH_HELP = (
    "auto: fetch a peer's cache only when that is expected to beat prefilling its tokens here (link rates "
    "measured per peer, this model's prefill and decode rates measured here; kept in the data dir); always: "
    "whenever a peer has a longer prefix"
)


@dataclass(frozen=True)
class Copy:
    """A copy of a prefix that a peer holds, as this machine would fetch it: `wire_bytes` of `codec`
    streaming at `bytes_per_s` (`measured` says how that was learnt), the `basis_bytes` of a basis
    this machine lacks at the link's `basis_bytes_per_s` (default: the same), the seconds decoding it
    takes here (None: never measured, not counted), and the setup a fetch from that peer takes. A
    copy the peer would code on request from a full one names its `level` and the `encode_s` that
    coding is expected to take there (`encode_measured`: how that was learnt)."""

    where: str
    cache_id: str
    codec: str
    wire_bytes: int
    bytes_per_s: float
    measured: str = ""
    basis_bytes: int = 0
    basis_bytes_per_s: float | None = None
    decode_s: float | None = None
    layers: int = 1
    # Seconds before its bytes stream: measured on that peer's fetches (kvmesh.reuse.rates).
    setup_s: float = FETCH_SETUP_S
    level: str = ""
    encode_s: float = 0.0
    encode_measured: str = ""


@dataclass(frozen=True)
class FetchCost:
    """The parts of a copy's expected fetch time, in seconds."""

    setup_s: float
    basis_s: float
    wire_s: float
    decode_s: float
    last_layer_s: float
    encode_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.setup_s + self.encode_s + self.basis_s + max(self.wire_s, self.decode_s) + self.last_layer_s


def fetch_cost(copy: Copy) -> FetchCost:
    """What fetching `copy` is expected to cost (the module docstring's sum)."""
    decode_s = copy.decode_s or 0.0
    return FetchCost(
        copy.setup_s,
        copy.basis_bytes / (copy.basis_bytes_per_s or copy.bytes_per_s),
        copy.wire_bytes / copy.bytes_per_s,
        decode_s,
        decode_s / max(1, copy.layers),
        copy.encode_s,
    )


@dataclass(frozen=True)
class Weighed:
    """One copy and what fetching it is expected to cost."""

    copy: Copy
    cost: FetchCost


@dataclass(frozen=True)
class Decision:
    """One choice between prefilling `tokens` here (after `context` held ones) and fetching the
    copies peers hold of them: each copy weighed, soonest first, and the verdict. What `--explain`
    prints, `generate --json` and serve's `usage.kvmesh` carry (as `str`), and tests read."""

    tokens: int
    fetch: bool
    # The copies weighed, the one expected soonest first; empty only when none could be weighed.
    weighed: tuple[Weighed, ...] = ()
    # The prefill's expected seconds and rate (tokens/s); None when this machine never timed one.
    prefill_s: float | None = None
    prefill_rate: float | None = None
    context: int = 0

    @property
    def best(self) -> Weighed:
        return self.weighed[0]

    @property
    def fetch_s(self) -> float:
        return self.best.cost.seconds if self.weighed else 0.0

    @property
    def where(self) -> str:
        return self.best.copy.where if self.weighed else ""

    def __str__(self) -> str:
        if not self.weighed:
            return f"{self.tokens:,} cached tokens: no copy within the quality floor: prefill"
        best = self.best
        head = f"{self.tokens:,} cached tokens at {best.copy.where}"
        if self.prefill_s is None or self.prefill_rate is None:
            return f"{head}: no prefill timed here: fetch"
        others = "".join(f"; {describe(w)}" for w in self.weighed[1:])
        return (
            f"{head}: fetching {describe(best)}, prefilling them here at {figure(self.prefill_rate)} tokens/s "
            f"about {self.prefill_s:.2f} s{others}: " + ("fetch" if self.fetch else "prefill")
        )


def describe(w: Weighed) -> str:
    """A weighed copy in words: its bytes, link, and the parts of its expected time."""
    c, cost = w.copy, w.cost
    basis = f" after a {c.basis_bytes / 1e6:,.2f} MB basis" if c.basis_bytes else ""
    measured = f" ({c.measured})" if c.measured else ""
    parts = [f"setup {cost.setup_s:.2f} s"]
    if c.level:
        how = f" ({c.encode_measured})" if c.encode_measured else ""
        parts.append(f"coding it there at level {c.level} {cost.encode_s:.2f} s{how}")
    parts.append(f"wire {cost.basis_s + cost.wire_s:.2f} s")
    parts.append(f"decode {cost.decode_s:.2f} s" if c.decode_s is not None else "decode not measured")
    return (
        f"{c.wire_bytes / 1e6:,.1f} MB {c.codec}{' on request' if c.level else ''}{basis} at "
        f"{c.bytes_per_s / 1e6:,.1f} MB/s{measured} takes about {cost.seconds:.2f} s ({', '.join(parts)})"
    )


def choose(tokens: int, copies: Sequence[Copy], prefill: PrefillModel | None, *, context: int = 0) -> Decision:
    """Fetch the copy of `tokens` expected soonest, or prefill them after the `context` tokens already
    held, whichever is expected to be faster; without a timed prefill, fetching is the choice, of
    the copies in the order given."""
    weighed = tuple(Weighed(c, fetch_cost(c)) for c in copies)
    if prefill is None:
        return Decision(tokens, bool(weighed), weighed, context=context)
    weighed = tuple(sorted(weighed, key=lambda w: w.cost.seconds))
    prefill_s = prefill.seconds(tokens, context)
    fetch = bool(weighed) and weighed[0].cost.seconds < prefill_s
    return Decision(tokens, fetch, weighed, prefill_s, prefill.rate(tokens, context), context)


def figure(x: float) -> str:
    """A rate as people read it: whole numbers from 100 on, else three significant digits (a slow
    machine's 1.37 tokens/s is not "1")."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def probe_bytes(wire_bytes: int) -> int:
    """How much to probe before a fetch of `wire_bytes`: a share of it, within MIN/MAX_PROBE_BYTES."""
    return max(MIN_PROBE_BYTES, min(MAX_PROBE_BYTES, wire_bytes // PROBE_SHARE))
