"""A shorter prefix of a dense cache, cut from its encoded chunks without decoding the rest.

Chunks hold whole token rows of one tensor, token-major, and the chunk plan depends only on each
tensor's row size and the chunk size. So the plan of the first m tokens is, per tensor, the first
chunks of the full plan, the last of them holding fewer rows. Cutting re-indexes the whole chunks
as they are (their checksums stay valid) and re-encodes only that last, partial chunk per tensor;
the payload digest is recomputed from the chunks' (length, checksum) pairs. Nothing is stored and
no MLX array is made: a server streams the cut as it reads its file.

Only a cache whose every layer holds every position has a shorter prefix (no eviction, no window
that dropped tokens, no recurrent state); the cut is block-aligned so that its prefix hash is one
of the cache's block hashes.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np
import xxhash

from kvmesh.codec.chunks import Chunk, ChunkChecker, compressor, parse_frame, payload_digest, shuffle
from kvmesh.codec.manifest import (
    ITEMSIZE,
    chunk_count,
    chunk_plan,
    content_id,
    leaf_layers,
    tensor_dtype,
    uncuttable_reason,
)
from kvmesh.codec.prefix import PrefixKey
from kvmesh.errors import IntegrityError
from kvmesh.v1 import cache_pb2 as pb

# Opens the stored chunk records of the whole cache afresh, as chunk frames, in order.
Records = Callable[[], Iterable[bytes]]


def can_cut(manifest: pb.CacheManifest, num_tokens: int) -> str | None:
    """None if `num_tokens` is a prefix this cache can be cut to, else why not."""
    block = manifest.prefix.block_size
    if why := uncuttable_reason(manifest):
        return f"it serves only its exact prefix of {manifest.prefix.num_tokens} tokens: {why}"
    if num_tokens % block or not 0 < num_tokens < manifest.prefix.num_tokens:
        return f"shorter prefixes are cut at multiples of {block} tokens below {manifest.prefix.num_tokens}"
    return None


def cut_manifest(manifest: pb.CacheManifest, num_tokens: int) -> pb.CacheManifest:
    """The manifest of the first `num_tokens`, without the sizes and digest the chunks tell."""
    if why := can_cut(manifest, num_tokens):
        raise ValueError(f"cache {manifest.cache_id} cannot serve a {num_tokens}-token prefix: {why}")
    cut = pb.CacheManifest()
    cut.CopyFrom(manifest)
    cut.ClearField("cache_id")
    prefix = PrefixKey.from_proto(manifest.prefix).first_blocks(num_tokens // manifest.prefix.block_size)
    cut.prefix.CopyFrom(prefix.to_proto())
    raw_bytes = 0
    for layer in cut.layers:
        layer.offset = num_tokens  # a composite layer's own, and its parts' below
    for _, layer in leaf_layers(cut.layers):
        layer.n_kept = layer.offset = num_tokens
        for t in layer.tensors:
            row_bytes = t.nbytes // t.shape[0]
            t.shape[0] = num_tokens
            t.nbytes = row_bytes * num_tokens
            raw_bytes += t.nbytes
    cut.encoding.raw_bytes = raw_bytes
    cut.encoding.chunk_count = chunk_count(cut)
    return cut


def cut_prefix(
    manifest: pb.CacheManifest, records: Records, num_tokens: int
) -> tuple[pb.CacheManifest, Iterator[bytes]]:
    """The complete manifest of the first `num_tokens` of a dense cache, and its chunk records.

    `records` is read twice: once to size the cut (so its manifest can go first), once to stream it.
    Every record used is checked against the original manifest as it is read.
    """
    cut = cut_manifest(manifest, num_tokens)
    sums = [(c.raw_length, c.checksum, len(c.data)) for c in _cut_chunks(manifest, cut, records())]
    cut.encoding.encoded_bytes = sum(size for _, _, size in sums)
    cut.encoding.payload_digest = payload_digest((length, checksum) for length, checksum, _ in sums)
    cut.cache_id = content_id(cut)

    def stream() -> Iterator[bytes]:
        for i, chunk in enumerate(_cut_chunks(manifest, cut, records())):
            if (chunk.raw_length, chunk.checksum) != sums[i][:2]:
                raise IntegrityError(f"cache {manifest.cache_id} changed while its prefix was served")
            yield chunk.frame()

    return cut, stream()


def _cut_chunks(manifest: pb.CacheManifest, cut: pb.CacheManifest, records: Iterable[bytes]) -> Iterator[Chunk]:
    """The cut's chunks in its payload order, from the original's records in theirs."""
    wanted = {(s.tensor, s.byte_offset): (i, s) for i, s in enumerate(chunk_plan(cut))}
    checker = ChunkChecker(manifest)
    specs = checker.specs
    found = 0
    for index, record in enumerate(records):
        if found == len(wanted):
            return
        slot = checker.plan[index]
        place = wanted.get((slot.tensor, slot.byte_offset))
        if place is None:
            continue
        chunk = parse_frame(record, f"cache {manifest.cache_id}: chunk {index}")
        new_index, new_slot = place
        found += 1
        if new_slot.raw_length == slot.raw_length:
            if (chunk.index, chunk.tensor, chunk.byte_offset) != (index, slot.tensor, slot.byte_offset):
                raise IntegrityError(f"chunk {index} of cache {manifest.cache_id} is out of place")
            yield replace(chunk, index=new_index)
            continue
        raw = np.frombuffer(checker.decode(chunk), np.uint8)[: new_slot.raw_length]
        dtype = tensor_dtype(specs[slot.tensor])
        data = raw.tobytes()
        if manifest.encoding.codec == pb.CODEC_ZSTD:
            planes = shuffle(raw, ITEMSIZE[dtype]) if manifest.encoding.byte_shuffle and dtype != "uint32" else raw
            data = compressor(manifest.encoding.level).compress(planes.data)
        checksum = xxhash.xxh3_64_intdigest(raw.data)
        yield Chunk(new_index, slot.tensor, slot.byte_offset, new_slot.raw_length, checksum, data)
    if found != len(wanted):
        raise IntegrityError(f"cache {manifest.cache_id} ended before the chunks of its prefix")
