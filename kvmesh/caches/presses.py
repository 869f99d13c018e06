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
from mlx_lm.models.cache import KVCache

from kvmesh.caches.attention import window_attention
from kvmesh.caches.defaults import QUANT_BITS, QUANT_GROUP_SIZES
from kvmesh.caches.kinds import snapshot
from kvmesh.caches.sparse import SparseQuantizedKVCache, sparse_from_dense
from kvmesh.errors import PressConfigError


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
        if self.ratio and self.budget is not None:
            raise PressConfigError(
                f"{self.method}: give ratio (a share of positions to evict) or budget (positions to keep), not both"
            )
        if type(self) is Press and (self.ratio or self.budget is not None):
            raise PressConfigError(
                "full keeps every position: ratio and budget need a method that evicts (kvzip, snapkv, streaming_llm)"
            )
        if self.kv_bits is not None and self.kv_bits not in QUANT_BITS:
            raise PressConfigError(f"{self.method}: kv_bits must be one of {QUANT_BITS}")
        if type(self) is Press and self.kv_bits is not None:
            # Recorded as `full`, a quantized cache would pass as lossless: never measured, ranked
            # with exact caches and let through every quality floor.
            raise PressConfigError("full keeps every value as computed: kv_bits needs quantize or a method that evicts")
        if self.kv_group_size not in QUANT_GROUP_SIZES:
            raise PressConfigError(f"{self.method}: kv_group_size must be one of {QUANT_GROUP_SIZES}")

    @property
    def needs_queries(self) -> int:
        """How many of the prompt's last tokens the method needs the queries of (0: none)."""
        return 0

    @property
    def needs_reconstruction(self) -> bool:
        """Does the method score positions by a second, context-reconstruction pass (`kvzip`)?"""
        return False

    @property
    def lossy(self) -> bool:
        """Does the press change what the model would generate (it evicts or quantizes)?"""
        return type(self) is not Press

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
        keys: dict[int, mx.array] = {}
        for layer, c in enumerate(cache):
            if not isinstance(c, KVCache):
                continue
            keys[layer] = cast(mx.array, c.keys)[..., : c.offset, :]
            if keys[layer].shape[0] != 1:
                raise PressConfigError(f"{self.method}: caches of one prompt only (batch size 1)")
            head_dim = keys[layer].shape[-1]
            if self.kv_bits is not None and head_dim % self.kv_group_size:
                raise PressConfigError(
                    f"{self.method}: kv_group_size {self.kv_group_size} does not divide this model's head "
                    f"dim {head_dim}; choose one of {[g for g in QUANT_GROUP_SIZES if head_dim % g == 0]}"
                )
        keeps = self.select_all(keys, observed or {})
        pressed = []
        for layer, c in enumerate(cache):
            if layer not in keys:
                pressed.append(snapshot(c))
                continue
            sparse = sparse_from_dense(c, keeps[layer])
            if self.kv_bits is not None:
                sparse = sparse.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits)
                mx.eval(sparse.keys, sparse.values)
            pressed.append(sparse)
        return pressed

    def select_all(self, keys: dict[int, mx.array], observed: dict) -> dict[int, mx.array | None]:
        """Positions to keep of every pressed layer ({layer: keys} in, {layer: keep} out): one layer
        at a time, unless a method sets budgets across layers."""
        return {layer: self.select(k, observed.get(layer)) for layer, k in keys.items()}


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


def avg_pool(x: mx.array, kernel: int) -> mx.array:
    """Average over a centred window of `kernel` positions along the last axis (zero padded)."""
    if kernel == 1:
        return x
    pad = kernel // 2
    padded = mx.pad(x, [(0, 0), (pad + 1, pad)])
    csum = mx.cumsum(padded, axis=-1)
    return (csum[..., kernel:] - csum[..., :-kernel]) / kernel


@dataclass(frozen=True)
class KVzipPress(Press):
    """KVzip-style, query-agnostic: keep what the model needs to reconstruct the context.

    A cache shared on the mesh is compressed before anyone knows the questions it will serve. KVzip
    (Kim et al., NeurIPS 2025) scores each cached position by how much the model relies on it to
    repeat the context: after the prefill the context is fed once more, teacher-forced, after itself
    (a second pass costing about one more prefill, `kvmesh.caches.attention.reconstruction_scores`),
    and a position's score for a kv head is the most attention any reconstructing query of the heads
    sharing it gives it. The prompt's own last `window` queries count too (their most attention,
    as the reconstruction's): measured on SmolLM2-135M this lowered continuation KL at 50% kept from
    0.0185 / 0.0221 to 0.0153 / 0.0133 on two texts without losing a fact (scripts/bench_quality.py).
    Budgets are set over all layers at once (with `ratio`): a layer keeps, per head, as many
    positions as its heads have among the top scores of the whole model, so layers that need more
    keep more; each head keeps its own best. With `budget`, every layer keeps that many.
    """

    method: ClassVar[str] = "kvzip"
    window: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.window < 0:
            raise PressConfigError(f"kvzip: window must be >= 0, got {self.window}")

    @property
    def needs_queries(self) -> int:
        return self.window

    @property
    def needs_reconstruction(self) -> bool:
        return True

    def select_all(self, keys: dict[int, mx.array], observed: dict) -> dict[int, mx.array | None]:
        if not observed:
            raise PressConfigError("kvzip needs the reconstruction pass's scores (use prefill())")
        n = next(iter(keys.values())).shape[2]
        k = self.kept(n)
        if k >= n:
            return dict.fromkeys(keys)
        counts = dict.fromkeys(keys, k)
        if self.budget is None:
            counts = layer_budgets({layer: observed[layer] for layer in keys}, k)
        return {layer: mx.sort(mx.argsort(-observed[layer], axis=-1)[:, : counts[layer]], axis=-1) for layer in keys}


def layer_budgets(scores: dict[int, mx.array], per_layer: int) -> dict[int, int]:
    """Positions each layer keeps per head when `per_layer` per layer are kept on average, given
    to the layers whose heads hold the most of the model's top scores ({layer: (heads, n)} in)."""
    every = mx.concatenate([s.reshape(-1) for s in scores.values()])
    heads = sum(s.shape[0] for s in scores.values())
    total = per_layer * heads
    threshold = mx.sort(every)[every.size - total]
    n = next(iter(scores.values())).shape[1]
    above = {layer: cast(int, (s >= threshold).astype(mx.int32).sum().item()) for layer, s in scores.items()}
    return {layer: min(n, max(1, round(above[layer] / s.shape[0]))) for layer, s in scores.items()}


PRESSES: dict[str, type[Press]] = {
    cls.method: cls for cls in (Press, QuantizePress, StreamingLLMPress, KNormPress, SnapKVPress, KVzipPress)
}


def press_shown_by(cache: list) -> Press:
    """The press a cache made elsewhere (a file) shows in its layers: quantization at the bits of its
    quantized layers, or none. Which positions were evicted, and how, layers cannot tell."""
    quantized = [c for c in cache if isinstance(c, SparseQuantizedKVCache)]
    if quantized:
        return QuantizePress(kv_bits=quantized[0].bits, kv_group_size=quantized[0].group_size)
    return Press()


def press_named(method: str | None, config: dict | None = None) -> Press:
    """The press a user's options name (`kvmesh prefill`): without a method, bits alone quantize, so
    that they are recorded, measured and ranked as the lossy press they are; nothing at all is `full`."""
    if method is None:
        method = "quantize" if (config or {}).get("kv_bits") is not None else "full"
    return make_press(method, config)


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
