"""A fetch of the blocks a receiver lacks: the sender leaves out what the receiver holds.

A blockwise cache (Encoding.block_rows, kvmesh.codec.manifest.block_rows_for) has one chunk per
block of each per-token tensor, and a block's chunk is the same bytes in every cache of that prefix
encoded alike. A receiver that holds the first blocks (equal block hashes, in its store) names how
many tokens it holds when it opens the fetch; the sender's manifest then says which chunks do not
travel (CacheManifest.held: their indices, raw lengths and checksums), and the receiver checks its
own chunks equal them before it accepts: what it decodes, its chunks and the sender's in the plan's
order, is the sender's cache exactly (the payload digest covers every chunk, as for a whole fetch).
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from kvmesh.codec.chunks import Chunk, parse_frame
from kvmesh.codec.manifest import chunk_plan
from kvmesh.codec.prefix import BLOCK_SIZE
from kvmesh.errors import IntegrityError, NotFoundError, Rejection, StoreError
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb


def held_indices(manifest: pb.CacheManifest, held_tokens: int) -> list[int]:
    """The chunks of a blockwise cache whose rows all lie in its first `held_tokens` tokens."""
    if not manifest.encoding.block_rows or held_tokens <= 0:
        return []
    return [
        i
        for i, slot in enumerate(chunk_plan(manifest))
        if (slot.byte_offset + slot.raw_length) // slot.row_bytes <= held_tokens
    ]


def leave_out(
    manifest: pb.CacheManifest, records: Callable[[], Iterable[bytes]], held_tokens: int
) -> tuple[pb.CacheManifest, Iterator[bytes]]:
    """The sender's side: the manifest with `held` naming the chunks of the first `held_tokens`
    (which are read once here, for their checksums), and the records of the others, to send.
    A cache that is not blockwise, or a count that is not whole blocks below its length, leaves
    nothing out."""
    block = manifest.encoding.block_rows
    if not block or held_tokens % block or not 0 < held_tokens < manifest.prefix.num_tokens:
        return manifest, iter(records())
    indices = held_indices(manifest, held_tokens)
    left_out = set(indices)
    held = pb.HeldPrefix(num_tokens=held_tokens, chunk_indices=indices)
    for i, record in enumerate(records()):
        if i > indices[-1]:
            break
        if i in left_out:
            chunk = parse_frame(record, f"chunk {i}")
            held.raw_lengths.append(chunk.raw_length)
            held.checksums.append(chunk.checksum)
    with_held = pb.CacheManifest()
    with_held.CopyFrom(manifest)
    with_held.held.CopyFrom(held)
    return with_held, (r for i, r in enumerate(records()) if i not in left_out)


def held_tokens(store: CacheStore, manifest: pb.CacheManifest) -> tuple[str, int] | None:
    """The receiver's side, once a manifest arrived: the local entry holding the most whole leading
    blocks of that cache, encoded alike, and how many tokens of them (None: none worth asking by)."""
    block = manifest.encoding.block_rows
    if not block or block != BLOCK_SIZE:
        return None
    matched = store.blocks_matched(manifest.model.model_id, list(manifest.prefix.block_hashes))
    best: tuple[str, int] | None = None
    for cache_id, blocks in matched.items():
        tokens = min(blocks * block, (manifest.prefix.num_tokens - 1) // block * block)
        if tokens > 0 and (best is None or tokens > best[1]) and cache_id != manifest.cache_id:
            best = (cache_id, tokens)
    return best


def own_chunks(
    store: CacheStore, cache_id: str, manifest: pb.CacheManifest, asked: int
) -> dict[int, Chunk] | Rejection:
    """The receiver's own chunks (of its entry `cache_id`) for the ones `manifest.held` leaves out,
    by index in `manifest`'s plan, when it asked for all but its first `asked` tokens; a Rejection
    when the sender left out other chunks than those (malformed), or the entry does not hold exactly
    those (another encoding, other bytes: a prefill that came out otherwise), so that the fetch is
    asked again whole."""
    held = manifest.held
    if held.num_tokens != asked or list(held.chunk_indices) != held_indices(manifest, asked):
        return Rejection(pb.REJECT_REASON_MALFORMED, f"left out other chunks than those of {asked} tokens")
    try:
        local = store.manifest(cache_id)
        if (local.encoding.codec, local.encoding.byte_shuffle, local.encoding.block_rows) != (
            manifest.encoding.codec,
            manifest.encoding.byte_shuffle,
            manifest.encoding.block_rows,
        ):
            return Rejection(pb.REJECT_REASON_PREFIX, f"the held cache {cache_id} is encoded otherwise")
        plan = chunk_plan(manifest)
        wanted = {(plan[i].tensor, plan[i].byte_offset): i for i in held.chunk_indices}
        found: dict[int, Chunk] = {}
        for chunk in store.chunks(cache_id):
            if (i := wanted.get((chunk.tensor, chunk.byte_offset))) is not None:
                found[i] = replace(chunk, index=i, data=bytes(chunk.data))
    except (IntegrityError, NotFoundError, StoreError) as e:
        return Rejection(pb.REJECT_REASON_PREFIX, f"the held cache {cache_id} cannot be read: {e}")
    if not len(held.chunk_indices) == len(held.raw_lengths) == len(held.checksums):
        return Rejection(pb.REJECT_REASON_MALFORMED, "the chunks left out are listed without their checksums")
    for i, length, checksum in zip(held.chunk_indices, held.raw_lengths, held.checksums, strict=True):
        if i not in found or (found[i].raw_length, found[i].checksum) != (length, checksum):
            return Rejection(pb.REJECT_REASON_PREFIX, f"the held cache {cache_id} holds other bytes for chunk {i}")
    return found
