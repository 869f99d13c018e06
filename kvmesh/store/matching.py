"""Which stored entry serves a prompt, and which cache a typed id names: the store's choices, as
plain functions over index rows (the store's facade reads the rows, these choose)."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.codec.compat import loss_rank
from kvmesh.codec.prefix import may_serve, shared_tokens, tokens_served
from kvmesh.errors import NotFoundError
from kvmesh.store.index import StoredEntry


@dataclass(frozen=True)
class PrefixMatch:
    entry: StoredEntry
    # How many of the prompt's tokens the entry can serve.
    tokens: int


def longest_prefix(entries: Sequence[StoredEntry], shared: dict[str, int], tokens: Sequence[int]) -> PrefixMatch | None:
    """The entry serving the longest prefix of `tokens`, given the leading blocks each shares.

    An entry serves its exact prefix; one that evicted nothing also serves any block-aligned
    shorter prefix of itself (cut by `kvmesh.codec.cut`): `kvmesh.codec.prefix.tokens_served`.
    On a tie, the less lossy entry wins (`loss_rank`: a 3-bit cache whose loss nobody measured
    never beats an 8-bit one of the same length), then the entry of exactly that prefix (nothing
    to cut).
    """
    best: PrefixMatch | None = None
    best_key: tuple = ()
    for e in entries:
        blocks = shared.get(e.cache_id, 0)
        if not may_serve(e.num_tokens, e.cuttable, blocks):
            continue
        usable = tokens_served(tokens, e.num_tokens, e.prefix_sha256, e.cuttable, shared_tokens(blocks, e.num_tokens))
        key = (usable, -loss_rank(e.lossy, e.loss), e.num_tokens == usable)
        if usable and (best is None or key > best_key):
            best, best_key = PrefixMatch(e, usable), key
    return best


def exact_only(
    entries: Sequence[StoredEntry], shared: dict[str, int], tokens: Sequence[int], beyond: int
) -> PrefixMatch | None:
    """The entry that shares the most block-aligned tokens of `tokens` (more than `beyond`) yet
    serves none of them: it serves only its exact prefix, which `tokens` does not extend."""
    missed = [
        PrefixMatch(e, n)
        for e in entries
        if not e.cuttable
        and (n := shared_tokens(shared.get(e.cache_id, 0), e.num_tokens)) > beyond
        and not tokens_served(tokens, e.num_tokens, e.prefix_sha256, False, n)
    ]
    return max(missed, key=lambda m: m.tokens) if missed else None


def id_range(given: str) -> tuple[str, str]:
    """The ids that start with `given` lie in [given, given + "g"): an index range, not a scan.

    NotFoundError unless `given` could start an id (hex digits, at most 32)."""
    prefix = given.strip().lower()
    if not prefix or not all(c in "0123456789abcdef" for c in prefix) or len(prefix) > 32:
        raise NotFoundError(f"no cache {given!r} in the store (ids are hex digits: `kvmesh cache list`)")
    return prefix, prefix + "g"


def one_id(given: str, found: Sequence[StoredEntry], shared: Callable[[str], bool] | None) -> str:
    """The one id among `found` (of the models `shared` counts), or a NotFoundError saying why not."""
    matches = [e.cache_id for e in found if shared is None or shared(e.model_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFoundError(f"no cache {given} in the store")
    shown = ", ".join(matches[:4]) + (", ..." if len(matches) > 4 else "")
    raise NotFoundError(f"{given} names {len(matches)} caches ({shown}): give more of the id")
