"""Manifests: everything a receiver needs to accept or refuse a cache before any tensor byte.

Tensors are described token-major ([n_kept, kv_heads, width]) because that is how they travel: a
chunk holds whole token rows of one tensor, so the first m tokens of a dense cache are a prefix of
each tensor's chunks, and a store can serve a shorter prefix without decoding the rest.

This module reads manifests and needs no MLX (the store, server and daemon use it); building one
from MLX caches is `kvmesh.codec.encode`'s job.
"""

import hashlib
from dataclasses import dataclass
from typing import Any

from kvmesh.model.fingerprint import dtype_name
from kvmesh.v1 import cache_pb2 as pb

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "uint32": 4}
# The tensors each cache kind stores, in manifest order.
TENSOR_NAMES: dict[int, tuple[str, ...]] = {
    pb.CACHE_KIND_SPARSE_KV: ("keys", "values"),
    pb.CACHE_KIND_SPARSE_QUANTIZED_KV: tuple(
        f"{role}.{part}" for role in ("keys", "values") for part in ("packed", "scales", "biases")
    ),
}
CODECS = {"none": pb.CODEC_NONE, "zstd": pb.CODEC_ZSTD}
CODEC_NAMES = {v: k for k, v in CODECS.items()}


def kind_name(kind: int) -> str:
    """CACHE_KIND_SPARSE_KV -> `sparse_kv`, for messages."""
    if kind in pb.CacheKind.values():
        return pb.CacheKind.Name(kind).removeprefix("CACHE_KIND_").lower()
    return f"unknown({kind})"


def tensor_dtype(t: pb.TensorSpec) -> str:
    return dtype_name(t.dtype)


@dataclass(frozen=True)
class ChunkSlot:
    """Where one chunk belongs: its tensor (index over all layers' tensors) and byte range."""

    tensor: int
    byte_offset: int
    raw_length: int
    row_bytes: int


def tensor_specs(manifest: pb.CacheManifest) -> list[pb.TensorSpec]:
    return [t for layer in manifest.layers for t in layer.tensors]


def rows_per_chunk(row_bytes: int, chunk_size: int) -> int:
    return max(1, chunk_size // row_bytes)


def chunk_count(manifest: pb.CacheManifest) -> int:
    """How many chunks the manifest's tensors make, without building the plan."""
    total = 0
    for t in tensor_specs(manifest):
        if t.shape[0]:
            rows = rows_per_chunk(t.nbytes // t.shape[0], manifest.encoding.chunk_size)
            total += -(-t.shape[0] // rows)
    return total


def chunk_plan(manifest: pb.CacheManifest) -> list[ChunkSlot]:
    """The payload's chunks in order; sender and receiver both derive it from the manifest."""
    plan = []
    for i, t in enumerate(tensor_specs(manifest)):
        n = t.shape[0]
        if not n:
            continue
        row_bytes = t.nbytes // n
        rows = rows_per_chunk(row_bytes, manifest.encoding.chunk_size)
        for r0 in range(0, n, rows):
            plan.append(ChunkSlot(i, r0 * row_bytes, min(rows, n - r0) * row_bytes, row_bytes))
    return plan


def content_id(manifest: pb.CacheManifest) -> str:
    """An id that is the same for the same cache content, wherever and whenever it was encoded."""
    stable = pb.CacheManifest()
    stable.CopyFrom(manifest)
    stable.ClearField("cache_id")
    stable.ClearField("created_unix_ms")
    stable.ClearField("node_id")
    return hashlib.sha256(stable.SerializeToString(deterministic=True)).hexdigest()[:32]


def evicts_nothing(manifest: pb.CacheManifest) -> bool:
    """A cache that keeps every position can also serve any shorter prefix of itself."""
    return all(layer.n_kept == layer.offset for layer in manifest.layers)


def press_config_to_proto(config: dict[str, Any]) -> pb.PressConfig:
    """A press's config (kvmesh.caches.presses.Press.config()) as the typed message; None stays unset."""
    return pb.PressConfig(**{k: v for k, v in config.items() if v is not None})
