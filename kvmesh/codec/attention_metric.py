"""Where an error in a cached key or value moves attention: the weights each layer's basis is fitted in.

The transform codec's basis (kvmesh.codec.basis) spends its components, and a uniform step its bits,
where a tensor's own variance is; but what an error costs is how far it moves the model. A key's
error e moves a score by q . e: so a feature of the keys matters as much as the queries that read it
carry energy there, and a model's queries gather theirs in a few features (SmolLM2's: the 10 largest
of 192 hold 31-51% of it). A value's error reaches the layer's output through o_proj: so a feature
of the values matters as much as the columns of o_proj that read it are long.

So calibration records each layer's queries (`recording_queries`: the mean square of each feature of
q_proj's output, over the calibration text) and `layer_weights` gives per layer and tensor one
weight per feature (the basis's PCA is then fitted on rows scaled by their square roots:
`kvmesh.codec.basis.fit_tensor_basis`):
- keys: the queries' mean square, summed over the query heads that share each KV head, and averaged
  over each rotary pair (RoPE turns the pair by the distance between query and key, which mixes its
  two features over the distances a query looks back);
- values: the squared length of each column of o_proj, summed over the query heads of each KV head;
each normalised to a mean of 1 and floored at `WEIGHT_FLOOR` of it (a feature no query reads still
keeps some; a basis's components are checked against the norms that floor allows: kvmesh.codec.basis_file).

Measured on SmolLM2 with scripts/bench_quality.py (three texts, the worst; the per-layer step factors
fitted on top, kvmesh.codec.sensitivity), the default level at KL <= 0.003: 3.74x without weights,
4.27x with them (the keys' alone: 3.93x at KL 0.0019); a full (non-diagonal) metric for the keys,
their queries' covariance averaged over RoPE's turns, measured no better (4.08x at 0.0024, 4.37x at
0.0038). The README has the frontier.

A layer whose attention this cannot read (no `q_proj`, `o_proj` and head counts as mlx-lm's llama
names them) keeps plain PCA; one that norms its queries after q_proj (qwen3's and gemma3's q_norm),
plain PCA for its keys.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvmesh.codec.basis_file import WEIGHT_FLOOR
from kvmesh.codec.rotary import Rotary


class _QuerySquares:
    """Stands in for a layer's q_proj while calibration prefills: calls it, and adds up the squares
    of each feature of its output."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.sums: mx.array | None = None
        self.count = 0

    def __call__(self, x: mx.array) -> mx.array:
        y = self.inner(x)
        squares = mx.square(y.astype(mx.float32)).reshape(-1, y.shape[-1]).sum(axis=0)
        self.sums = squares if self.sums is None else self.sums + squares
        mx.eval(self.sums)
        self.count += int(np.prod(y.shape[:-1]))
        return y

    def total(self) -> np.ndarray:
        """Each feature's sum of squares so far (float64)."""
        return np.zeros(0) if self.sums is None else np.asarray(self.sums).astype(np.float64)


def _heads(attn: Any) -> bool:
    """Whether a layer's attention names its projections and head counts as mlx-lm's llama does."""
    return all(hasattr(attn, a) for a in ("q_proj", "o_proj", "n_heads", "n_kv_heads"))


def _readable(attn: Any) -> bool:
    """Whether q_proj's output is the layer's queries (no norm applied to them after it)."""
    return _heads(attn) and not hasattr(attn, "q_norm")


@contextmanager
def recording_queries(every_layer: Sequence[Any], layers: Sequence[int]) -> Iterator[dict[int, _QuerySquares]]:
    """While inside, the queries of `layers` (indices into the model's `every_layer`) are recorded,
    one `_QuerySquares` per layer it can read; the model's own q_proj is put back on the way out."""
    recorders: dict[int, _QuerySquares] = {}
    try:
        for i in layers:
            attn = getattr(every_layer[i], "self_attn", None)
            if attn is not None and _readable(attn):
                recorders[i] = _QuerySquares(attn.q_proj)
                attn.q_proj = recorders[i]
        yield recorders
    finally:
        for i, recorder in recorders.items():
            every_layer[i].self_attn.q_proj = recorder.inner


def _normalised(w: np.ndarray) -> np.ndarray:
    return np.maximum(w / w.mean(), WEIGHT_FLOOR) if w.size and w.mean() > 0 else np.ones_like(w)


def key_weights(mean_square: np.ndarray, n_heads: int, n_kv_heads: int, rotary: Rotary) -> np.ndarray:
    """(n_kv_heads * head_dim,) weights of the keys' features from the queries' mean squares
    (n_heads * head_dim,): summed over the query heads that share each KV head (query head i reads
    KV head i // (n_heads / n_kv_heads), as mlx-lm's attention repeats them), averaged over each
    rotary pair, normalised."""
    group = n_heads // n_kv_heads
    q = mean_square.reshape(n_kv_heads, group, -1).sum(axis=1)
    dims, half = rotary.dims, rotary.dims // 2
    if rotary.traditional:
        first, second = slice(0, dims, 2), slice(1, dims, 2)
    else:
        first, second = slice(0, half), slice(half, dims)
    pair = (q[:, first] + q[:, second]) / 2
    q[:, first], q[:, second] = pair, pair
    return _normalised(q.reshape(-1))


def value_weights(o_proj: Any, n_heads: int, n_kv_heads: int) -> np.ndarray | None:
    """(n_kv_heads * head_dim,) weights of the values' features: the squared lengths of o_proj's
    columns, summed over the query heads of each KV head, normalised; None for a projection that is
    not a (quantized) linear layer."""
    if isinstance(o_proj, nn.QuantizedLinear):
        w = mx.dequantize(o_proj.weight, o_proj.scales, o_proj.biases, o_proj.group_size, o_proj.bits)
    elif isinstance(o_proj, nn.Linear):
        w = o_proj.weight
    else:
        return None
    lengths = np.asarray(mx.square(w.astype(mx.float32)).sum(axis=0)).astype(np.float64)
    return _normalised(lengths.reshape(n_kv_heads, n_heads // n_kv_heads, -1).sum(axis=1).reshape(-1))


def layer_weights(
    every_layer: Sequence[Any],
    layers: Sequence[int],
    rotaries: Sequence[Rotary],
    recorded: Sequence[dict[int, _QuerySquares]],
) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """Per layer of `layers`, (keys' weights, values' weights), from the queries recorded over one or
    more prefills (`recording_queries`); None for a tensor this cannot weigh."""
    out: list[tuple[np.ndarray | None, np.ndarray | None]] = []
    for i, rotary in zip(layers, rotaries, strict=True):
        attn = getattr(every_layer[i], "self_attn", None)
        if attn is None or not _heads(attn):
            out.append((None, None))
            continue
        squares = [r[i] for r in recorded if i in r and r[i].count]
        keys = None
        if squares:
            mean_square = np.sum([s.total() for s in squares], axis=0) / sum(s.count for s in squares)
            keys = key_weights(mean_square, attn.n_heads, attn.n_kv_heads, rotary)
        out.append((keys, value_weights(attn.o_proj, attn.n_heads, attn.n_kv_heads)))
    return out
