"""How fast this machine decodes (and encodes) transform-coded caches of a geometry: measured, not guessed.

Whether fetching a coded cache beats prefilling it depends on the decode rate as much as on the link
(a decoder slower than the link makes the fetch decoder-bound), and that rate depends on the machine
(CPU or a Mac's GPU) and on the geometry (heads x head_dim sets the inverse transform's size).
`measure_decode_rate` times the real decoder on a small synthetic cache of that geometry, coded with
a synthetic basis of the same size: cheap enough to call before a choice (well under a second).

`synthetic_layers` and `synthetic_basis` also make the 8B-geometry cache of the codec's benchmark.
"""

import time
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import numpy as np

from kvmesh.codec.basis import Basis, LayerKV, TensorBasis
from kvmesh.codec.coded import TransformCoding
from kvmesh.codec.layer_pool import LAYER_THREADS
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.prediction import Predictor
from kvmesh.codec.rotary import Rotary, apply_rope
from kvmesh.codec.transform import fp16_nbytes
from kvmesh.codec.transform_decode import decode_layers

# Spread of the synthetic components' calibration RMS (largest / smallest = e^SPREAD), about a real
# model's: the default step then keeps most components, at a few bits each.
SPREAD = 4.0


def synthetic_basis(
    layers: int, heads: int, head_dim: int, *, base: float = 500000.0, predicted_step: float | None = None
) -> Basis:
    """A basis of the geometry's size whose components are the features themselves (any orthogonal
    basis costs the decoder the same; the identity is its own inverse, so none is computed), with
    RMS decaying over the components as a fitted one's do (with `predicted_step`:
    `with_zero_predictors`)."""
    f = heads * head_dim
    rms = np.exp(-SPREAD * np.arange(f) / f).astype(np.float32)
    eye = np.eye(f, dtype=np.float32)
    tensors = [
        TensorBasis(np.zeros(f, np.float32), eye.astype(np.float16), rms, _synthesis=eye, _analysis=eye)
        for _ in range(2 * layers)
    ]
    rotary = Rotary(dims=head_dim, traditional=False, base=base)
    basis = Basis(tensors[:layers], tensors[layers:], [rotary] * layers, {"synthetic": True})
    return basis if predicted_step is None else with_zero_predictors(basis, predicted_step)


def with_zero_predictors(basis: Basis, step: float) -> Basis:
    """`basis` with predictors from the layer before (kvmesh.codec.prediction) for coding at `step`
    that predict nothing: zero weights, the residual's RMS the tensor's own. A fitted map costs the
    codec what these do, so they time it without a calibration."""

    def predicting(tb: TensorBasis, layer: int, inputs: int) -> TensorBasis:
        if not layer:
            return tb
        weights = np.zeros((inputs + 1, tb.features), np.float16)
        return replace(tb, predictor=Predictor(weights, (tb.rms / tb.scale).astype(np.float32)), _mx={}, _np={})

    before = [0] + [tb.features + tv.features for tb, tv in zip(basis.keys, basis.values, strict=True)]
    keys = [predicting(tb, i, before[i]) for i, tb in enumerate(basis.keys)]
    values = [predicting(tb, i, before[i] + tb.features) for i, tb in enumerate(basis.values)]
    info = {**basis.info, "predicted_step": step}
    return replace(basis, keys=keys, values=values, info=info, _bytes=None, _digest=None)


def synthetic_layers(basis: Basis, tokens: int, *, seed: int = 0, dtype: mx.Dtype = mx.float16) -> list[LayerKV]:
    """Per basis layer, (keys, values, positions) of `tokens` rows drawn from the basis's spectrum,
    keys rotated by its RoPE: numbers the codec sees as it sees a real cache's."""
    rng = np.random.default_rng(seed)
    out: list[LayerKV] = []
    for tk, tv, rotary in zip(basis.keys, basis.values, basis.rotaries, strict=True):
        d = rotary.dims
        h = tk.features // d
        k, v = (
            mx.array((rng.standard_normal((tokens, tb.features)) * tb.rms).astype(np.float32))
            .reshape(1, tokens, h, d)
            .transpose(0, 2, 1, 3)
            for tb in (tk, tv)
        )
        positions = np.arange(tokens)
        out.append((apply_rope(k, positions, rotary).astype(dtype), v.astype(dtype), positions))
    return out


def measure_decode_rate(
    heads: int, head_dim: int, *, tokens: int = 256, step: float | None = None, repeat: int = 2
) -> float:
    """Bytes per second of fp16-equivalent cache this machine's transform decoder produces for layers
    of `heads` KV heads of `head_dim` (the best of `repeat` decodes, after a warm-up), as many
    layers as it decodes at once (`kvmesh.codec.layer_pool`).

    `step` defaults to the `--compress` default level's. The decoder's cost is one matrix product
    per tensor ((tokens, components) x (components, heads * head_dim)) and a few passes over the
    codes, so the rate depends on the BLAS: on a 2-core Linux box with OpenBLAS, 0.07-0.10 GB/s at
    SmolLM2's geometry (3 x 64) and 0.08-0.10 at 8B's (8 x 128), below what long caches decode at
    (a layer's fixed costs weigh more on 256 tokens); with MLX's own reference BLAS (Linux without
    OpenBLAS preloaded) an order of magnitude less at 8B's. A Mac (Accelerate, or its GPU) is far
    quicker."""
    basis = synthetic_basis(LAYER_THREADS, heads, head_dim)
    layers = synthetic_layers(basis, tokens)
    coding = TransformCoding.at_level(basis, LEVELS["default"])
    blobs = (coding if step is None else replace(coding, step=step)).encode(layers).blobs
    return fp16_nbytes(layers) / fastest_run(lambda: mx.eval(decode_layers(blobs, basis)), repeat=repeat)


def fastest_run(run: Callable[[], object], *, repeat: int) -> float:
    """Seconds of the fastest of `repeat` calls of `run`, after one that warms it up (its first run
    pays for MLX's kernels, the allocator's first buffers and the layer threads' streams, which a
    process pays once)."""
    run()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
