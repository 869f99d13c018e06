"""The links to a peer with several addresses (Wi-Fi and a Thunderbolt bridge, say): what the
health checks measured of each, and which to dial first."""

from collections.abc import Sequence
from dataclasses import dataclass

# A peer with several addresses has each link's rate measured with a probe of this size, at most
# this long, this often (and when a link comes back); another link is taken when it is this many
# times faster than the one in use.
LINK_PROBE_BYTES = 1 << 20
LINK_PROBE_TIMEOUT = 5.0
LINK_PROBE_EVERY = 300.0
SWITCH_FACTOR = 1.5


@dataclass
class Link:
    """What the health checks measured of one address of a peer: whether it answers, its round
    trip, and (for a peer with several addresses) the rate of a short probe over it."""

    ok: bool = False
    rtt: float | None = None
    rate: float | None = None
    probed_at: float = float("-inf")


def faster(a: Link, b: Link) -> bool:
    """Whether link `a` beats `b` by enough to switch to it (measurements wobble: no flapping)."""
    if a.rate is not None and b.rate is not None:
        return a.rate > SWITCH_FACTOR * b.rate
    return a.rate is not None and b.rate is None


def dialling_order(addresses: Sequence[str], links: dict[str, Link]) -> tuple[str, ...]:
    """A peer's addresses as they should be dialled: the fastest answering one first (the current
    first unless another is clearly faster), then the other answering ones, then the rest."""
    answering = [a for a in addresses if links.get(a, Link()).ok]
    if not answering:
        return tuple(addresses)
    best = answering[0]
    for address in answering[1:]:
        if faster(links[address], links[best]):
            best = address
    rest = [a for a in answering if a != best] + [a for a in addresses if a not in answering]
    return (best, *rest)
