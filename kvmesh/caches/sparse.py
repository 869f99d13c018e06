"""Sparse mlx-lm caches: fewer stored positions than tokens processed.

After token eviction a layer stores `n_kept` key/value positions while the model has processed
`offset` tokens. mlx-lm uses one counter for both (`KVCache.offset` is the write index AND the RoPE
position of the next token), and each naive workaround is silently wrong: an `offset` lowered to the
kept count gives the next tokens the wrong RoPE positions, and one left at the tokens processed has
attention read (and the mask admit) slots that hold no key. These classes keep the two counters apart:

- `offset`: logical tokens processed. Models read it for RoPE, so new tokens get their true
  positions; the kept keys were stored post-RoPE and keep theirs.
- `n_kept`: stored entries, the write index. Attention sees exactly these, and the causal mask is
  built from it, so every kept position is visible and new tokens are causal among themselves.

They plug into mlx-lm generation unchanged (`generate`, `stream_generate`, `generate_step`,
`kv_bits`, `save_prompt_cache`/`load_prompt_cache`).
"""

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
)

from kvmesh.compat.mlx_lm import BaseCache, register_cache_class
from kvmesh.errors import UnsupportedCacheError


def _leaves(x) -> tuple:
    """A float cache stores one array per tensor, a quantized one a (packed, scales, biases) tuple."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def quantize(x: mx.array, group_size: int, bits: int) -> tuple:
    """mlx's per-token quantization along head_dim, as the (packed, scales, biases) tuple caches hold."""
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def _slice(x, n: int):
    return tree_map(lambda a: a[..., :n, :], x)


class _SparseBase(BaseCache):
    """What the float and quantized sparse caches share; subclasses say how new tokens are stored."""

    step = 256
    # Class-level defaults: `from_state` skips __init__ and the state setter restores only these.
    keys = None
    values = None
    offset = 0
    n_kept = 0
    # Entries appended since the last eviction: the only ones `trim` can take back.
    n_tail = 0
    # The positions a press kept, (n_kv_heads, n_kept) int32; None when it evicted nothing.
    positions: mx.array | None = None

    def _encode(self, keys: mx.array, values: mx.array):
        return keys, values

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        keys, values = self._encode(keys, values)
        prev = self.n_kept
        if self.keys is None or prev + n > _leaves(self.keys)[0].shape[2]:
            capacity = (prev + n + self.step - 1) // self.step * self.step

            def grow(new, old=None):
                extra = mx.zeros((*new.shape[:2], capacity - prev, new.shape[-1]), new.dtype)
                return extra if old is None else mx.concatenate([old[..., :prev, :], extra], axis=2)

            if self.keys is None:
                self.keys, self.values = tree_map(grow, (keys, values))
            else:
                self.keys, self.values = tree_map(grow, (keys, values), (self.keys, self.values))
        for buf, new in zip(_leaves(self.keys) + _leaves(self.values), _leaves(keys) + _leaves(values)):
            buf[..., prev : prev + n, :] = new
        self.n_kept += n
        self.offset += n
        self.n_tail += n
        return self.keys_and_values()

    def keys_and_values(self):
        return _slice(self.keys, self.n_kept), _slice(self.values, self.n_kept)

    def kept_positions(self) -> mx.array | None:
        """The positions of the stored entries, (n_kv_heads, n_kept), while they are the ones a press
        kept (no token added since); None otherwise. The transform codec needs them to take RoPE off."""
        if self.positions is None or self.positions.shape[-1] != self.n_kept:
            return None
        return self.positions

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None and self.n_kept != self.offset:
            raise UnsupportedCacheError(
                "a sliding-window mask cannot be built over evicted positions; "
                "sliding-window layers must keep their own RotatingKVCache"
            )
        return create_attention_mask(N, offset=self.n_kept, return_array=return_array, window_size=window_size)

    def size(self):
        return self.n_kept

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.n_tail)
        self.n_kept -= n
        self.offset -= n
        self.n_tail -= n
        return n

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(a.nbytes // a.shape[2] * self.n_kept for a in _leaves(self.keys) + _leaves(self.values))

    def _init_from(self, keys, values, offset: int):
        """Take stored arrays (already evicted, exactly n_kept long) for a cache at `offset`."""
        n_kept = _leaves(keys)[0].shape[2]
        if n_kept > offset:
            raise ValueError(f"{n_kept} stored positions cannot exceed the logical offset {offset}")
        self.keys, self.values = keys, values
        self.n_kept, self.offset = n_kept, offset
        # A cache with nothing evicted is plain contiguous history and may be trimmed back fully.
        self.n_tail = n_kept if n_kept == offset else 0
        return self


class SparseKVCache(_SparseBase):
    """A float KV cache whose stored positions may be fewer than its logical offset."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = self.n_kept = self.n_tail = 0

    @classmethod
    def from_arrays(cls, keys: mx.array, values: mx.array, offset: int) -> "SparseKVCache":
        """Build from kept keys/values of shape (B, n_kv_heads, n_kept, head_dim), keys post-RoPE."""
        return cls()._init_from(keys, values, offset)

    @property
    def state(self):
        keys, values = self.keys_and_values() if self.keys is not None else (None, None)
        return keys, values, self.offset, self.n_kept, self.n_tail

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.n_kept, self.n_tail = v

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "SparseQuantizedKVCache":
        """Quantize what is stored (mlx-lm's inherited version would use offset as the write index)."""
        quantized = SparseQuantizedKVCache(group_size=group_size, bits=bits)
        quantized.offset, quantized.n_kept, quantized.n_tail = self.offset, self.n_kept, self.n_tail
        if self.keys is not None:
            quantized.keys, quantized.values = (quantize(a, group_size, bits) for a in self.keys_and_values())
        return quantized


class SparseQuantizedKVCache(_SparseBase):
    """The quantized twin of SparseKVCache: keys/values are (packed uint32, scales, biases).

    Its `bits` and `group_size` attributes send mlx-lm attention down the quantized path, as for
    mlx-lm's own QuantizedKVCache.
    """

    group_size = 64
    bits = 8

    def __init__(self, group_size: int = 64, bits: int = 8):
        self.keys = self.values = None
        self.offset = self.n_kept = self.n_tail = 0
        self.group_size, self.bits = group_size, bits

    @classmethod
    def from_arrays(
        cls, keys: tuple, values: tuple, offset: int, group_size: int, bits: int
    ) -> "SparseQuantizedKVCache":
        """Build from kept, already quantized (packed, scales, biases) tuples."""
        return cls(group_size=group_size, bits=bits)._init_from(tuple(keys), tuple(values), offset)

    def _encode(self, keys, values):
        return quantize(keys, self.group_size, self.bits), quantize(values, self.group_size, self.bits)

    @property
    def state(self):
        keys, values = self.keys_and_values() if self.keys is not None else (None, None)
        return keys, values, self.offset, self.n_kept, self.n_tail, self.group_size, self.bits

    @state.setter
    def state(self, v):
        keys, values, self.offset, self.n_kept, self.n_tail, self.group_size, self.bits = v
        # load_prompt_cache hands back lists where the state held tuples.
        self.keys, self.values = (None, None) if keys is None else (tuple(keys), tuple(values))


def gather_positions(x, keep: mx.array | None, length: int):
    """Positions `keep` of the first `length` entries of a (B, H, L, D) array or quantized tuple.

    `keep` is None (all), shape (n,) shared by every head, or (H, n) per head with equal counts.
    The result is evaluated and contiguous, so the dense buffer it came from can be freed.
    """

    def take(a):
        a = a[..., :length, :]
        if keep is None:
            return mx.contiguous(a)
        if keep.ndim == 1:
            return mx.take(a, keep, axis=2)
        if keep.shape[0] != a.shape[1]:
            raise ValueError(f"per-head indices for {keep.shape[0]} heads, cache has {a.shape[1]}")
        return mx.take_along_axis(a, keep[None, :, :, None], axis=2)

    out = tree_map(take, x)
    mx.eval(out)
    return out


def sparse_from_dense(cache, keep: mx.array | None = None):
    """A sparse cache holding positions `keep` of an mlx-lm KVCache or QuantizedKVCache layer."""
    if type(cache) is KVCache:
        keys, values = (gather_positions(a, keep, cache.offset) for a in (cache.keys, cache.values))
        sparse = SparseKVCache.from_arrays(keys, values, cache.offset)
        if keep is not None:
            heads = keys.shape[1]
            sparse.positions = mx.broadcast_to(keep, (heads, keep.shape[-1])).astype(mx.int32)
        return sparse
    if type(cache) is QuantizedKVCache:
        keys, values = (gather_positions(a, keep, cache.offset) for a in (cache.keys, cache.values))
        return SparseQuantizedKVCache.from_arrays(keys, values, cache.offset, cache.group_size, cache.bits)
    raise UnsupportedCacheError(
        f"cannot make a sparse cache from {type(cache).__name__}: only full-attention layers "
        "(KVCache, QuantizedKVCache) are made sparse"
    )


def truncate(layer, n: int):
    """The first `n` positions of a layer that evicted nothing: the cache of a shorter prefix."""
    if layer.n_kept != layer.offset or not 0 < n <= layer.offset:
        raise ValueError(f"cannot cut {n} positions from a layer of {layer.n_kept} kept / {layer.offset}")
    keys, values = (gather_positions(x, None, n) for x in layer.keys_and_values())
    if isinstance(layer, SparseQuantizedKVCache):
        return SparseQuantizedKVCache.from_arrays(keys, values, n, layer.group_size, layer.bits)
    return SparseKVCache.from_arrays(keys, values, n)


def stored_nbytes(cache) -> int:
    """Bytes of one layer's stored positions, without the spare capacity mlx-lm buffers keep."""
    if isinstance(cache, _SparseBase):
        return cache.nbytes
    if isinstance(cache, ArraysCache):
        arrays: list[Any] = cache.cache
        return sum(a.nbytes for a in arrays if a is not None)
    if isinstance(cache, CacheList):
        return sum(stored_nbytes(part) for part in cache.caches)
    if type(cache) in (KVCache, QuantizedKVCache, RotatingKVCache, ChunkedKVCache):
        if cache.keys is None:
            return 0
        if isinstance(cache, RotatingKVCache):
            rows = min(cache.offset, cache.max_size)
        else:
            rows = cache.offset - getattr(cache, "start_position", 0)
        leaves = _leaves(cache.keys) + _leaves(cache.values)
        return sum(a.nbytes // a.shape[2] * rows for a in leaves)
    raise UnsupportedCacheError(f"no byte count for {type(cache).__name__}")


# So that load_prompt_cache rebuilds them from a file.
register_cache_class(SparseKVCache)
register_cache_class(SparseQuantizedKVCache)
