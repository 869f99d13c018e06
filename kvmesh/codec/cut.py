"""A shorter prefix of a cache, cut from its encoded chunks without decoding the rest.

Chunks hold whole token rows of one tensor, token-major, and the chunk plan depends only on each
tensor's row size and the chunk size. So the plan of the first m tokens is, per tensor, the first
chunks of the full plan, the last of them holding fewer rows. Cutting re-indexes the whole chunks
as they are (their checksums stay valid) and re-encodes only that last, partial chunk per tensor;
the payload digest is recomputed from the chunks' (length, checksum) pairs. Nothing is stored and
no MLX array is made: a server streams the cut as it reads its file.

A transform-coded layer is one blob, not rows: its prefix is re-coded from the blob's codes
(`kvmesh.codec.layer_blob.cut_layer`, no basis needed), so that it decodes to exactly the first m rows
the whole blob decodes to, then chunked afresh. Those blobs are made once, before the manifest (their
sizes are in it), and held for the stream.

Only a cache whose every layer holds every position has a shorter prefix (no eviction, no window
that dropped tokens, no recurrent state); the cut is block-aligned so that its prefix hash is one
of the cache's block hashes.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

import numpy as np
import xxhash

from kvmesh.codec.chunks import Chunk, ChunkChecker, compressor, parse_frame, payload_digest, shuffle
from kvmesh.codec.layer_blob import TransformCodecError, cut_layer, cut_rows
from kvmesh.codec.manifest import (
    ITEMSIZE,
    ChunkSlot,
    chunk_count,
    chunk_plan,
    content_id,
    leaf_layers,
    manifest_schema,
    tensor_dtype,
    transform_coded,
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


def cut_manifest(manifest: pb.CacheManifest, num_tokens: int, coded: Mapping[int, bytes]) -> pb.CacheManifest:
    """The manifest of the first `num_tokens`, without the sizes and digest the chunks tell.

    `coded`: the cut blob of each transform-coded tensor (by index over all tensors), whose size the
    manifest states. A prefix of a transform-coded cache claims no measured loss (the whole's was
    measured at its end), and is written in the oldest schema that describes it (a cut that keeps no
    tail rows reaches peers of schema 2)."""
    if why := can_cut(manifest, num_tokens):
        raise ValueError(f"cache {manifest.cache_id} cannot serve a {num_tokens}-token prefix: {why}")
    cut = pb.CacheManifest()
    cut.CopyFrom(manifest)
    cut.ClearField("cache_id")
    prefix = PrefixKey.from_proto(manifest.prefix).first_blocks(num_tokens // manifest.prefix.block_size)
    cut.prefix.CopyFrom(prefix.to_proto())
    for layer in cut.layers:
        layer.offset = num_tokens  # a composite layer's own, and its parts' below
    index = 0
    for _, layer in leaf_layers(cut.layers):
        layer.n_kept = layer.offset = num_tokens
        if layer.kind == pb.CACHE_KIND_TRANSFORM_KV:
            t = layer.transform
            t.sinks, t.recent, t.tail = cut_rows(manifest.prefix.num_tokens, t.sinks, t.recent, num_tokens, t.tail)
            if not t.tail:
                for name in ("key_tail_step", "value_tail_step", "key_tail_components", "value_tail_components"):
                    t.ClearField(name)
            (tensor,) = layer.tensors
            tensor.shape[0] = tensor.nbytes = len(coded[index])
        else:
            for tensor in layer.tensors:
                tensor.nbytes = tensor.nbytes // tensor.shape[0] * num_tokens
                tensor.shape[0] = num_tokens
        index += len(layer.tensors)
    if transform_coded(manifest):
        # The loss measured on the whole is not a shorter prefix's: a coded cache's end is coded
        # finer than the rest (a tail), and even without one the error a cut ends on differs (on
        # SmolLM2 such prefixes measured up to 2x the whole's KL, kvmesh.codec.levels): not claimed.
        cut.ClearField("quality")
    cut.schema_version = manifest_schema(leaf for _, leaf in leaf_layers(cut.layers))
    cut.encoding.raw_bytes = sum(t.nbytes for _, layer in leaf_layers(cut.layers) for t in layer.tensors)
    cut.encoding.chunk_count = chunk_count(cut)
    return cut


def cut_prefix(
    manifest: pb.CacheManifest, records: Records, num_tokens: int
) -> tuple[pb.CacheManifest, Iterator[bytes]]:
    """The complete manifest of the first `num_tokens` of a cache, and its chunk records.

    `records` is read twice (three times when layers are transform coded: once to cut their blobs):
    once to size the cut (so its manifest can go first), once to stream it. Every record used is
    checked against the original manifest as it is read.
    """
    if why := can_cut(manifest, num_tokens):
        raise ValueError(f"cache {manifest.cache_id} cannot serve a {num_tokens}-token prefix: {why}")
    coded = _cut_blobs(manifest, records(), num_tokens)
    cut = cut_manifest(manifest, num_tokens, coded)
    sums = [(c.raw_length, c.checksum, len(c.data)) for c in _cut_chunks(manifest, cut, records(), coded)]
    cut.encoding.encoded_bytes = sum(size for _, _, size in sums)
    cut.encoding.payload_digest = payload_digest((length, checksum) for length, checksum, _ in sums)
    cut.cache_id = content_id(cut)

    def stream() -> Iterator[bytes]:
        for i, chunk in enumerate(_cut_chunks(manifest, cut, records(), coded)):
            if (chunk.raw_length, chunk.checksum) != sums[i][:2]:
                raise IntegrityError(f"cache {manifest.cache_id} changed while its prefix was served")
            yield chunk.frame()

    return cut, stream()


def _coded_tensors(manifest: pb.CacheManifest) -> set[int]:
    """The indices (over all tensors) of the transform-coded layers' blobs."""
    found, index = set(), 0
    for _, layer in leaf_layers(manifest.layers):
        if layer.kind == pb.CACHE_KIND_TRANSFORM_KV:
            found.add(index)
        index += len(layer.tensors)
    return found


def _cut_blobs(manifest: pb.CacheManifest, records: Iterable[bytes], num_tokens: int) -> dict[int, bytes]:
    """Each transform-coded tensor's blob, read whole from the records (each checked), cut to `num_tokens`."""
    wanted = _coded_tensors(manifest)
    if not wanted:
        return {}
    checker = ChunkChecker(manifest)
    parts: dict[int, list[bytes]] = {t: [] for t in wanted}
    for index, record in enumerate(records):
        if index >= len(checker.plan):
            break
        if checker.plan[index].tensor in wanted:
            chunk = parse_frame(record, f"cache {manifest.cache_id}: chunk {index}")
            if chunk.index != index:
                raise IntegrityError(f"chunk {index} of cache {manifest.cache_id} is out of place")
            parts[chunk.tensor].append(bytes(checker.decode(chunk)))
    specs = checker.specs
    if any(sum(map(len, parts[t])) != specs[t].nbytes for t in wanted):
        raise IntegrityError(f"cache {manifest.cache_id} ended before the blobs of its coded layers")
    try:
        return {t: cut_layer(b"".join(parts[t]), num_tokens) for t in wanted}
    except TransformCodecError as e:
        raise IntegrityError(f"cache {manifest.cache_id}: a transform-coded layer does not cut: {e}") from None


def _cut_chunks(
    manifest: pb.CacheManifest, cut: pb.CacheManifest, records: Iterable[bytes], coded: Mapping[int, bytes]
) -> Iterator[Chunk]:
    """The cut's chunks in its payload order, from the original's records in theirs; a coded tensor's
    from its cut blob, in place of its first record."""
    plan = chunk_plan(cut)
    wanted = {(s.tensor, s.byte_offset): (i, s) for i, s in enumerate(plan)}
    checker = ChunkChecker(manifest)
    specs = checker.specs
    found = 0
    for index, record in enumerate(records):
        if found == len(plan):
            return
        slot = checker.plan[index]
        if slot.tensor in coded:
            if slot.byte_offset == 0:
                blob = np.frombuffer(coded[slot.tensor], np.uint8)
                for i, s in enumerate(plan):
                    if s.tensor == slot.tensor:
                        found += 1
                        yield _chunk(cut, i, s, blob[s.byte_offset : s.byte_offset + s.raw_length], "uint8")
            continue
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
        yield _chunk(cut, new_index, new_slot, raw, tensor_dtype(specs[slot.tensor]))
    if found != len(plan):
        raise IntegrityError(f"cache {manifest.cache_id} ended before the chunks of its prefix")


def _chunk(manifest: pb.CacheManifest, index: int, slot: ChunkSlot, raw: np.ndarray, dtype: str) -> Chunk:
    """A chunk of the cut made afresh from its raw bytes, encoded as the manifest says."""
    data = raw.tobytes()
    if manifest.encoding.codec == pb.CODEC_ZSTD:
        planes = shuffle(raw, ITEMSIZE[dtype]) if manifest.encoding.byte_shuffle and dtype != "uint32" else raw
        data = compressor(manifest.encoding.level).compress(planes.data)
    return Chunk(index, slot.tensor, slot.byte_offset, slot.raw_length, xxhash.xxh3_64_intdigest(raw.data), data)
