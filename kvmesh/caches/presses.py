"""Compression methods ("presses") that turn a freshly prefilled dense cache into a smaller one.

A press evicts tokens (keeps a subset of positions per layer, shared by the layer's heads or chosen
per head) and may then quantize what is left. Each has a stable method id and a JSON-serialisable
config: both go into the manifest, so a receiver knows exactly what it is getting.

Sizing, common to every method: `budget` is the number of positions each layer keeps; without it,
`ratio` is the fraction of the prompt's positions evicted (0 keeps everything, 0.75 keeps a quarter).
"""

import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvmesh.caches.kinds import snapshot
from kvmesh.caches.sparse import sparse_from_dense
from kvmesh.errors import PressConfigError

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Press:
    """Keep everything; the base of every method and the `full` method itself."""

    method: ClassVar[str] = "full"

    ratio: float = 0.0
    budget: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64

    def __post_init__(self):
        if not 0.0 <= self.ratio < 1.0:
            raise PressConfigError(f"{self.method}: ratio must be in [0, 1), got {self.ratio}")
        if self.budget is not None and self.budget < 1:
            raise PressConfigError(f"{self.method}: budget must be at least 1, got {self.budget}")
        if type(self) is Press and (self.ratio or self.budget is not None):
            raise PressConfigError(
                "full keeps every position: ratio and budget need a method that evicts (streaming_llm, snapkv, knorm)"
            )
        if self.kv_bits is not None and self.kv_bits not in QUANT_BITS:
            raise PressConfigError(f"{self.method}: kv_bits must be one of {QUANT_BITS}")
        if self.kv_group_size not in QUANT_GROUP_SIZES:
            raise PressConfigError(f"{self.method}: kv_group_size must be one of {QUANT_GROUP_SIZES}")

    @property
    def needs_queries(self) -> int:
        """How many of the prompt's last tokens the method needs the queries of (0: none)."""
        return 0

    def config(self) -> dict:
        return asdict(self)

    def kept(self, n: int) -> int:
        """Positions kept out of `n`."""
        if self.budget is not None:
            return min(n, self.budget)
        return max(1, n - math.floor(n * self.ratio))

    def select(self, keys: mx.array, observed: tuple[mx.array, float] | None) -> mx.array | None:
        """Positions to keep of one layer: None (all), shape (n,), or (n_kv_heads, n) per head.

        `keys` is the layer's (1, n_kv_heads, n, head_dim) post-RoPE keys; `observed` holds the
        (1, n_heads, w, head_dim) queries of the prompt's last w tokens and the attention scale.
        """
        return None

    def apply(self, cache: list, observed: dict | None = None) -> list:
        """A new list of sparse (and maybe quantized) caches; the dense `cache` is left as it was.

        Only full-attention layers are pressed: sliding-window layers already drop what leaves
        their window (and mlx-lm cannot quantize them), and recurrent state holds no positions.
        Those are copied as they are shared (`kvmesh.caches.kinds`).
        """
        pressed = []
        for layer, c in enumerate(cache):
            if not isinstance(c, (KVCache, QuantizedKVCache)):
                pressed.append(snapshot(c))
                continue
            keys = cast(mx.array, c.keys)[..., : c.offset, :]
            if keys.shape[0] != 1:
                raise PressConfigError(f"{self.method}: caches of one prompt only (batch size 1)")
            if self.kv_bits is not None and keys.shape[-1] % self.kv_group_size:
                raise PressConfigError(
                    f"{self.method}: kv_group_size {self.kv_group_size} does not divide this model's head "
                    f"dim {keys.shape[-1]}; choose one of {[g for g in QUANT_GROUP_SIZES if keys.shape[-1] % g == 0]}"
                )
            keep = self.select(keys, observed.get(layer) if observed else None)
            sparse = sparse_from_dense(c, keep)
            if self.kv_bits is not None:
                sparse = sparse.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits)
                mx.eval(sparse.keys, sparse.values)
            pressed.append(sparse)
        return pressed


@dataclass(frozen=True)
class QuantizePress(Press):
    """Keep every position, quantized (mlx 8-bit by default, or 4-bit ...)."""

    method: ClassVar[str] = "quantize"
    kv_bits: int | None = 8

    def __post_init__(self):
        super().__post_init__()
        if self.kv_bits is None:
            raise PressConfigError("quantize: kv_bits is required")
        if self.ratio or self.budget is not None:
            raise PressConfigError("quantize evicts nothing: use another method with kv_bits")


@dataclass(frozen=True)
class StreamingLLMPress(Press):
    """StreamingLLM: the first `sinks` tokens (attention sinks) and the most recent window."""

    method: ClassVar[str] = "streaming_llm"
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise PressConfigError(f"streaming_llm: sinks must be >= 0, got {self.sinks}")

    def select(self, keys, observed):
        n = keys.shape[2]
        k = self.kept(n)
        if k >= n:
            return None
        sinks = min(self.sinks, k)
        return mx.concatenate([mx.arange(sinks), mx.arange(n - (k - sinks), n)])


@dataclass(frozen=True)
class KNormPress(Press):
    """Keep, per head, the keys of lowest L2 norm (low-norm keys draw the most attention)."""

    method: ClassVar[str] = "knorm"

    def select(self, keys, observed):
        n = keys.shape[2]
        k = self.kept(n)
        if k >= n:
            return None
        norms = mx.linalg.norm(keys[0].astype(mx.float32), axis=-1)
        return mx.sort(mx.argsort(norms, axis=-1)[:, :k], axis=-1)


@dataclass(frozen=True)
class SnapKVPress(Press):
    """SnapKV: score earlier tokens by the attention the prompt's last `window` tokens give them.

    Scores are the softmax attention of the observation window's queries onto all keys, averaged
    over those queries and over the query heads sharing a kv head, smoothed by average pooling
    (`kernel`), then the top-scoring positions are kept per kv head. The window itself is always
    kept.
    """

    method: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 5

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise PressConfigError(f"snapkv: window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise PressConfigError(f"snapkv: kernel must be an odd number >= 1, got {self.kernel}")

    @property
    def needs_queries(self) -> int:
        return self.window

    def select(self, keys, observed):
        if observed is None:
            raise PressConfigError("snapkv needs the observation window's queries (use prefill())")
        n = keys.shape[2]
        k = self.kept(n)
        if k >= n:
            return None
        queries, scale = observed
        n_kv, w = keys.shape[1], queries.shape[2]
        if k <= w or n <= w:
            return mx.arange(n - k, n)
        scores = window_attention(queries, keys, scale).reshape(n_kv, -1, n)
        prefix = avg_pool(scores[..., : n - w].mean(axis=1), self.kernel)
        top = mx.argsort(-prefix, axis=-1)[:, : k - w]
        window = mx.broadcast_to(mx.arange(n - w, n), (n_kv, w))
        return mx.sort(mx.concatenate([top, window], axis=-1), axis=-1)


def window_attention(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """Softmax attention (fp32) of the last w queries onto all n keys: (n_kv, n_heads/n_kv * w, n)."""
    _, n_heads, w, d = queries.shape
    n_kv, n = keys.shape[1], keys.shape[2]
    q = queries[0].astype(mx.float32).reshape(n_kv, (n_heads // n_kv) * w, d)
    logits = (q * scale) @ keys[0].astype(mx.float32).transpose(0, 2, 1)
    # Query i of the window sits at position n - w + i and must not see later positions.
    pos = mx.tile(mx.arange(n - w, n), n_heads // n_kv)
    logits = mx.where(mx.arange(n)[None] <= pos[:, None], logits, -mx.inf)
    return mx.softmax(logits, axis=-1)


def avg_pool(x: mx.array, kernel: int) -> mx.array:
    """Average over a centred window of `kernel` positions along the last axis (zero padded)."""
    if kernel == 1:
        return x
    pad = kernel // 2
    padded = mx.pad(x, [(0, 0), (pad + 1, pad)])
    csum = mx.cumsum(padded, axis=-1)
    return (csum[..., kernel:] - csum[..., :-kernel]) / kernel


PRESSES: dict[str, type[Press]] = {
    cls.method: cls for cls in (Press, QuantizePress, StreamingLLMPress, KNormPress, SnapKVPress)
}


def make_press(method: str, config: dict | None = None) -> Press:
    """The press for a method id and its JSON config (as found in a manifest or on the CLI)."""
    if method not in PRESSES:
        raise PressConfigError(f"unknown compression method {method!r}; known: {', '.join(PRESSES)}")
    cls = PRESSES[method]
    config = dict(config or {})
    allowed = {f.name for f in fields(cls)}
    if unknown := sorted(set(config) - allowed):
        raise PressConfigError(
            f"{method}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    for f in fields(cls):
        if f.name in config and not isinstance(config[f.name], (int, float, type(None))):
            raise PressConfigError(f"{method}: {f.name} must be a number, got {config[f.name]!r}")
    return cls(**config)
