"""The mlx-lm cache kinds kvmesh shares besides full attention, and how each is captured exactly.

A model's cache list mixes kinds, each captured as follows:

- full attention (`KVCache`): made sparse (`kvmesh.caches.sparse`); presses evict and quantize here.
- sliding window (`RotatingKVCache`): shared as the window holds it, never pressed (mlx-lm cannot
  quantize it, and it already drops what falls out of its window). Its buffer may be a ring in
  write order and longer than the window after a chunked prefill; it is captured in temporal order
  as the `keep` leading positions plus the latest ones, `min(offset, window)` in all: the state a
  prefill leaves, up to rows that mlx-lm's next update drops anyway, so generation goes on exactly.
- recurrent or convolution state (`ArraysCache`): its arrays, exact. It records no token count and
  cannot be cut back to a shorter prefix, so a cache holding one serves only its exact prefix.
- chunked attention (`ChunkedKVCache`, llama4): the positions since its `start_position`, as held.
- several caches for one layer (`CacheList`: falcon_h1, deepseek_v32, ...): each part by its kind,
  none pressed (the parts work together: an indexer's keys must match the keys they index).

Any other kind (model-specific classes mlx-lm itself cannot reload) is refused with its name.
"""

import copy
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache, sparse_from_dense
from kvmesh.compat.mlx_lm import set_write_index, temporal_order
from kvmesh.errors import UnsupportedCacheError

# Kinds a layer, or a part of a CacheList layer, may be (kvmesh's sparse caches stand for KVCache).
SHARED_KINDS = (
    KVCache,
    QuantizedKVCache,
    SparseKVCache,
    SparseQuantizedKVCache,
    RotatingKVCache,
    ArraysCache,
    ChunkedKVCache,
)


def check_supported(cache: list) -> None:
    """Raise UnsupportedCacheError naming the first layer whose cache kind kvmesh cannot share."""
    for i, c in enumerate(cache):
        parts = list(c.caches) if type(c) is CacheList else [c]
        for part in parts:
            if type(part) not in SHARED_KINDS:
                raise UnsupportedCacheError(
                    f"layer {i} of this model uses {type(part).__name__}, a cache kind kvmesh cannot share "
                    "(it shares KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache, ChunkedKVCache "
                    "and CacheLists of them)"
                )


def window_tensors(c: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A sliding-window layer's keys and values in temporal order, `min(offset, window)` positions."""
    if c.keys is None or c.values is None:
        raise ValueError("a sliding-window layer that has seen no token has nothing to share")

    def temporal(v: mx.array) -> mx.array:
        v = temporal_order(c, v)
        stored = min(c.offset, c.max_size)
        if v.shape[2] > stored:
            v = mx.concatenate([v[..., : c.keep, :], v[..., v.shape[2] - (stored - c.keep) :, :]], axis=2)
        return mx.contiguous(v)

    keys, values = temporal(c.keys), temporal(c.values)
    mx.eval(keys, values)
    return keys, values


def window_snapshot(c: RotatingKVCache) -> RotatingKVCache:
    """A copy of a sliding-window layer holding exactly what is shared of it (`window_tensors`)."""
    keys, values = window_tensors(c)
    return window_from_arrays(keys, values, c.offset, c.max_size, c.keep)


def window_from_arrays(keys: mx.array, values: mx.array, offset: int, window: int, keep: int) -> RotatingKVCache:
    """Rebuild a sliding-window layer from its temporal-order positions (see `window_tensors`)."""
    stored = keys.shape[2]
    if stored != min(offset, window) or not 0 <= keep < window:
        raise ValueError(
            f"a window of {window} (keep {keep}) at offset {offset} holds {min(offset, window)}, not {stored}"
        )
    layer = RotatingKVCache(max_size=window, keep=keep)
    layer.keys, layer.values, layer.offset = keys, values, offset
    set_write_index(layer, stored)
    return layer


def state_arrays(c: ArraysCache) -> list[mx.array]:
    """The arrays of a recurrent layer of one sequence, evaluated and contiguous."""
    if c.left_padding is not None or c.lengths is not None or c.batch_size != 1:
        raise UnsupportedCacheError("only caches of one unpadded sequence are shared (batch size 1)")
    held: list[Any] = c.cache
    if any(a is None for a in held):
        raise ValueError("a recurrent layer that has seen no token has nothing to share")
    arrays = [mx.contiguous(a) for a in held if a is not None]
    mx.eval(arrays)
    return arrays


def arrays_from_state(arrays: list[mx.array]) -> ArraysCache:
    """Rebuild a recurrent layer from its arrays."""
    layer = ArraysCache(size=len(arrays))
    layer.cache = list[Any](arrays)
    return layer


def chunked_tensors(c: ChunkedKVCache) -> tuple[mx.array, mx.array]:
    """A chunked-attention layer's keys and values since its start position, contiguous."""
    if c.keys is None:
        raise ValueError("a chunked-attention layer that has seen no token has nothing to share")
    keys, values = (mx.contiguous(a) for a in c.keys_and_values())
    mx.eval(keys, values)
    return keys, values


def chunked_from_arrays(
    keys: mx.array, values: mx.array, offset: int, chunk_size: int, start_position: int
) -> ChunkedKVCache:
    """Rebuild a chunked-attention layer from its positions since `start_position`."""
    if keys.shape[2] != offset - start_position:
        raise ValueError(f"{keys.shape[2]} positions from {start_position} to offset {offset}")
    layer = ChunkedKVCache(chunk_size)
    layer.keys, layer.values, layer.offset, layer.start_position = keys, values, offset, start_position
    return layer


def snapshot(c):
    """A copy of a layer that presses leave alone (sliding window, recurrent, chunked, composite),
    holding exactly what is shared of it; a CacheList's full-attention parts become sparse caches
    that keep every position."""
    if isinstance(c, RotatingKVCache):
        return window_snapshot(c)
    if isinstance(c, ArraysCache):
        return arrays_from_state(state_arrays(c))
    if isinstance(c, ChunkedKVCache):
        offset, chunk_size, start = c.offset, c.chunk_size, c.start_position
        return chunked_from_arrays(*chunked_tensors(c), offset, chunk_size, start)
    if isinstance(c, CacheList):
        return CacheList(*(snapshot(part) for part in c.caches))
    if isinstance(c, (SparseKVCache, SparseQuantizedKVCache)):
        return c
    return sparse_from_dense(c)


def fork(c):
    """A copy of a layer that a forward pass may extend without touching the original's buffers: a
    KVCache shares its arrays up to its offset (the pass appends past them), others are deep-copied."""
    if type(c) is KVCache:
        forked = KVCache()
        keys, values = cast(mx.array, c.keys), cast(mx.array, c.values)
        forked.keys, forked.values, forked.offset = keys[..., : c.offset, :], values[..., : c.offset, :], c.offset
        return forked
    return copy.deepcopy(c)


def cached_tokens(cache: list) -> int:
    """Tokens a cache list holds, read from its attention layers (recurrent layers record none);
    0 for a model of recurrent layers only, whose token count only its caller knows."""
    offsets = [
        part.offset
        for c in cache
        for part in (c.caches if isinstance(c, CacheList) else [c])
        if not isinstance(part, ArraysCache)
    ]
    return max(offsets, default=0)


def trims_exactly(cache: list, n: int) -> bool:
    """Whether trimming `n` positions off every layer leaves exactly the cache of the prompt `n`
    tokens shorter. mlx-lm's `is_trimmable` says only that some trimming works: a sparse cache trims
    only the positions it appended after its evictions, a chunked one only back to where its current
    chunk began, a sliding window only while nothing has rotated out, recurrent state never."""

    def layer(c: Any) -> bool:
        if isinstance(c, CacheList):
            return all(layer(part) for part in c.caches)
        if isinstance(c, (SparseKVCache, SparseQuantizedKVCache)):
            return n <= c.n_tail
        if isinstance(c, ChunkedKVCache):
            return c.offset - n >= 0 and (c.offset - n) // c.chunk_size * c.chunk_size >= c.start_position
        if isinstance(c, RotatingKVCache):
            return c.offset < c.max_size and n <= c.offset
        return type(c) in (KVCache, QuantizedKVCache) and n <= c.offset

    return n == 0 or all(layer(c) for c in cache)
