"""The MLX side of the codec: dtypes, the tensors each sparse layer stores, zero-copy byte views."""

import mlx.core as mx
import numpy as np

from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.v1 import cache_pb2 as pb

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32, "uint32": mx.uint32}
UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}
KIND_OF_CLASS = {SparseKVCache: pb.CACHE_KIND_SPARSE_KV, SparseQuantizedKVCache: pb.CACHE_KIND_SPARSE_QUANTIZED_KV}


def mlx_dtype_name(dtype: mx.Dtype) -> str:
    """`mlx.core.float16` -> `float16` (the wire names are enums: kvmesh.model.fingerprint.dtype_name)."""
    return str(dtype).rsplit(".", 1)[-1]


def layer_tensors(layer: SparseKVCache | SparseQuantizedKVCache) -> list[mx.array]:
    """The stored tensors of one sparse layer, each (1, kv_heads, n_kept, width), in manifest order."""
    keys, values = layer.keys_and_values()
    if isinstance(layer, SparseQuantizedKVCache):
        return [*keys, *values]
    return [keys, values]


def uint_view(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated, contiguous mlx array (bfloat16 as uint16)."""
    return np.array(a.view(UINT_OF_SIZE[a.itemsize]), copy=False)
