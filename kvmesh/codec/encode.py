"""MLX caches (sparse attention, sliding-window and recurrent layers) into a manifest and chunks.

`encode_cache` is how a cache enters the store or the wire: `store.add(*encode_cache(...))`. Every
encoding choice is one `EncodeOptions`.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, RotatingKVCache

from kvmesh.caches.presses import Press
from kvmesh.caches.quality import QUALITY_TOKENS
from kvmesh.caches.sparse import SparseQuantizedKVCache
from kvmesh.codec.arrays import Layer, layer_kind, layer_tensors, mlx_dtype_name, rows_of, uint_view, wire_shape
from kvmesh.codec.chunks import Chunk, compressor, ordered_map, payload_digest, shuffle
from kvmesh.codec.coded import CodedLayer, coded_artifacts
from kvmesh.codec.manifest import (
    CODECS,
    ITEMSIZE,
    TENSOR_NAMES,
    ChunkSlot,
    block_rows_for,
    chunk_count,
    chunk_plan,
    leaf_layers,
    manifest_schema,
    press_config_to_proto,
    state_names,
    tensor_dtype,
    tensor_specs,
    token_major,
)
from kvmesh.codec.prefix import PrefixKey
from kvmesh.model.fingerprint import ModelFingerprint, dtype_to_proto
from kvmesh.v1 import cache_pb2 as pb


@dataclass(frozen=True)
class EncodeOptions:
    """How a cache is encoded for the wire and the disk.

    `byte_shuffle=None` shuffles bfloat16 caches only: measured on KV of the small preset, it
    raised zstd's ratio by 16% for bfloat16 but only 8.6% for float16 (scripts/bench_codec.py).
    """

    codec: str = "zstd"
    level: int = 1
    byte_shuffle: bool | None = None
    chunk_size: int = 1 << 20
    # Threads compressing chunks at once.
    threads: int = 2

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODECS)}")


class Encoded(NamedTuple):
    """A manifest and its chunks. The manifest's sizes and digest are filled in as the last chunk
    goes out, so consume `chunks` before reading them (the store does)."""

    manifest: pb.CacheManifest
    chunks: Iterator[Chunk]


def layer_spec(layer: Layer, num_tokens: int) -> pb.LayerSpec:
    """What one layer stores; a recurrent layer records no token count, so it gets the prefix's."""
    kind = layer_kind(layer)
    if isinstance(layer, CacheList):
        return pb.LayerSpec(kind=kind, offset=num_tokens, parts=[layer_spec(part, num_tokens) for part in layer.caches])
    if isinstance(layer, CodedLayer):
        return pb.LayerSpec(
            kind=kind,
            n_kept=layer.n_kept,
            offset=layer.offset,
            transform=layer.spec,
            tensors=[
                pb.TensorSpec(name="coded", dtype=dtype_to_proto("uint8"), shape=[layer.nbytes], nbytes=layer.nbytes)
            ],
        )
    tensors = layer_tensors(layer)
    if isinstance(layer, ArraysCache):
        spec = pb.LayerSpec(kind=kind, n_kept=0, offset=num_tokens)
        names = state_names(len(tensors))
    else:
        spec = pb.LayerSpec(kind=kind, n_kept=tensors[0].shape[2], offset=layer.offset)
        names = list(TENSOR_NAMES[kind])
    if isinstance(layer, SparseQuantizedKVCache):
        spec.bits, spec.group_size = layer.bits, layer.group_size
    if isinstance(layer, RotatingKVCache):
        spec.window, spec.keep = layer.max_size, layer.keep
    if isinstance(layer, ChunkedKVCache):
        spec.chunk_size, spec.start_position = layer.chunk_size, layer.start_position
    for tensor_name, t in zip(names, tensors, strict=True):
        if t.shape[0] != 1:
            raise ValueError(f"only caches of one sequence are shared, not a batch of {t.shape[0]}")
        spec.tensors.add(
            name=tensor_name, dtype=dtype_to_proto(mlx_dtype_name(t.dtype)), shape=wire_shape(kind, t), nbytes=t.nbytes
        )
    return spec


def build_manifest(
    cache: Sequence[Layer],
    model: ModelFingerprint,
    prefix: PrefixKey,
    press: Press,
    *,
    options: EncodeOptions | None = None,
    node_id: str = "",
    tail_kl: float | None = None,
) -> pb.CacheManifest:
    """The manifest of a cache, complete except for what encoding it tells (sizes, digest, id).

    `tail_kl` is the loss its producer measured (`Prefilled.tail_kl`), for receivers' quality floors.
    """
    options = options or EncodeOptions()
    layers = [layer_spec(c, prefix.num_tokens) for c in cache]
    leaves = [layer for _, layer in leaf_layers(layers)]
    if offsets := {layer.offset for layer in leaves} - {prefix.num_tokens}:
        raise ValueError(f"the prefix has {prefix.num_tokens} tokens, the cache {sorted(offsets)}")
    # Attention tensors share the model's dtype (coded layers decode to it); recurrent state keeps its
    # own (often float32).
    float_dtypes = {tensor_dtype(t) for layer in leaves if token_major(layer.kind) for t in layer.tensors} - {"uint32"}
    float_dtypes |= {layer.dtype for layer in cache if isinstance(layer, CodedLayer)}
    if len(float_dtypes) != 1:
        raise ValueError(f"a cache's attention layers must have one float dtype, found {sorted(float_dtypes)}")
    dtype = float_dtypes.pop()
    byte_shuffle = dtype == "bfloat16" if options.byte_shuffle is None else options.byte_shuffle
    # A transform-coded layer's blob is entropy coded already (its segments are zstd frames:
    # kvmesh.codec.layer_blob), so zstd over it saved nothing (SmolLM2's 1,024-token coded cache:
    # 418 bytes more) and cost every reader a decompression and a copy of each chunk. A cache of
    # coded layers only goes without.
    codec = "none" if leaves and all(layer.kind == pb.CACHE_KIND_TRANSFORM_KV for layer in leaves) else options.codec
    zstd = codec == "zstd"
    manifest = pb.CacheManifest(
        schema_version=manifest_schema(leaves),
        model=model.to_proto(),
        prefix=prefix.to_proto(),
        num_layers=len(layers),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=dtype_to_proto(dtype),
        layers=layers,
        compression=pb.Compression(method=press.method, config=press_config_to_proto(press.config())),
        encoding=pb.Encoding(
            codec=CODECS[codec],
            level=options.level if zstd else 0,
            byte_shuffle=byte_shuffle and zstd,
            chunk_size=options.chunk_size,
            raw_bytes=sum(t.nbytes for layer in leaves for t in layer.tensors),
            digest_algorithm=pb.DIGEST_ALGORITHM_XXH3,
        ),
        created_unix_ms=int(time.time() * 1000),
        node_id=node_id,
        artifacts=coded_artifacts(cache),
    )
    manifest.encoding.block_rows = block_rows_for(manifest)  # by blocks where they fit (kvmesh.codec.manifest)
    manifest.encoding.chunk_count = chunk_count(manifest)
    if tail_kl is not None:
        manifest.quality.CopyFrom(pb.Quality(metric="tail_kl", value=tail_kl, tokens=QUALITY_TOKENS))
    return manifest


def encode_chunks(cache: Sequence[Layer], manifest: pb.CacheManifest, threads: int = 2) -> Iterator[Chunk]:
    """The payload of `cache` as chunks, following `manifest` (from build_manifest).

    Fills in the manifest's encoded size and payload digest once the last chunk is out.
    """
    encoding = manifest.encoding
    tensors = [t for layer in cache for t in layer_tensors(layer)]
    layouts = [token_major(layer.kind) for _, layer in leaf_layers(manifest.layers) for _ in layer.tensors]
    specs = tensor_specs(manifest)
    views: dict[int, np.ndarray] = {}

    def source(slot: ChunkSlot) -> np.ndarray:
        # One tensor at a time is made contiguous; views of earlier ones are dropped as we go.
        if slot.tensor not in views:
            views.clear()
            t = mx.contiguous(tensors[slot.tensor])
            mx.eval(t)
            views[slot.tensor] = uint_view(t)[0]
        r0, rows = slot.byte_offset // slot.row_bytes, slot.raw_length // slot.row_bytes
        return rows_of(views[slot.tensor], layouts[slot.tensor], r0, rows)

    def encode(item: tuple[int, ChunkSlot, np.ndarray]) -> Chunk:
        index, slot, raw = item
        raw_bytes = raw.view(np.uint8).reshape(-1)
        checksum = xxhash.xxh3_64_intdigest(raw_bytes.data)
        if encoding.codec == pb.CODEC_ZSTD:
            dtype = tensor_dtype(specs[slot.tensor])
            if encoding.byte_shuffle and ITEMSIZE[dtype] > 1 and dtype != "uint32":
                raw_bytes = shuffle(raw_bytes, ITEMSIZE[dtype])
            data = compressor(encoding.level).compress(raw_bytes.data)
        else:
            data = raw_bytes.tobytes()
        return Chunk(index, slot.tensor, slot.byte_offset, slot.raw_length, checksum, data)

    plan = chunk_plan(manifest)
    items = ((i, slot, source(slot)) for i, slot in enumerate(plan))
    sums, encoded = [], 0
    for chunk in ordered_map(encode, items, threads):
        sums.append((chunk.raw_length, chunk.checksum))
        encoded += len(chunk.data)
        yield chunk
    encoding.encoded_bytes = encoded
    encoding.payload_digest = payload_digest(sums)


def encode_cache(
    cache: Sequence[Layer],
    model: ModelFingerprint,
    tokens: Sequence[int] | PrefixKey,
    press: Press | None = None,
    *,
    options: EncodeOptions | None = None,
    node_id: str = "",
    tail_kl: float | None = None,
) -> Encoded:
    """A cache of the prefix `tokens`, made by `model` and compressed by `press` (which cost
    `tail_kl`, when measured), encoded."""
    options = options or EncodeOptions()
    prefix = tokens if isinstance(tokens, PrefixKey) else PrefixKey.of(tokens)
    manifest = build_manifest(cache, model, prefix, press or Press(), options=options, node_id=node_id, tail_kl=tail_kl)
    return Encoded(manifest, encode_chunks(cache, manifest, options.threads))
