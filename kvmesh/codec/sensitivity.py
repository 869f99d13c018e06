"""Per-layer quantization steps from measured sensitivity: where the transform codec's bits pay.

One global step spends bits alike in every layer, but the layers do not matter alike: an error in one
layer's keys moves the model's next-token distribution far more than the same error in another's
values. So at calibration the model measures it (`tensor_sensitivities`): each tensor (a layer's keys,
or its values) alone is coded at a probe step and decoded, and the KL divergence of the model's
predictions over a continuation of the calibration text, from those with the exact cache, is that
tensor's sensitivity `g` (KL ~ g * step^2 while the error is small).

A tensor coded at step s costs about n * log2(1 / s) bits per token (n: the components it keeps) and
adds g * s^2 of KL; minimising the bits for a total KL (a Lagrangian over the tensors) gives each
its step in proportion to sqrt(n / g). Keys then get twice that: the split between keys and values
that measured best with one global step, and measured best again here (on SmolLM2 and the three
texts of scripts/bench_quality.py, the worst text's ratio at KL 0.003 / 0.02, interpolated between
a few steps of one experiment: one step 3.77x / 5.18x; sqrt(n / g) alone 4.24x / 5.80x; with keys
at twice it 4.15x / 6.52x; the keys' and values' factors each normalised on their own 4.04x /
6.25x; the levels then measured at chosen steps: kvmesh.codec.levels). Those proportions, normalised so the values'
steps have a geometric mean of 1, are the basis's step factors (`Basis.step_factor`): the encoder
multiplies the global step by them, and each layer's blob already carries its own steps, so
receivers need nothing new.
"""

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvmesh.caches.quality import logprobs_given, mean_kl
from kvmesh.codec.basis import Basis, LayerKV
from kvmesh.codec.quantize import kept_components
from kvmesh.codec.transform import encode_layers
from kvmesh.codec.transform_decode import decode_layers
from kvmesh.progress import Progress

# The probe: values coded at this step (keys at KEY_FACTOR times it), coarse enough that every
# tensor's KL stands well above float32 noise, fine enough that KL still grows as the square of the step.
PROBE_STEP = 0.3
# Keys' steps to values', in the probe and in the factors (module docstring).
KEY_FACTOR = 2.0
# Tokens of the calibration text past the cache that the model predicts for each probe.
PROBE_TOKENS = 64
# A tensor's factor stays within this of the others' (geometric) mean: a KL at the noise floor
# would otherwise make a tensor's step unbounded.
FACTOR_SPREAD = 4.0
# A measured KL below this share of the median counts as this share (noise, not insensitivity).
KL_FLOOR = 0.02


def _with_layer(cache: Sequence[Any], i: int, keys: mx.array, values: mx.array) -> list[Any]:
    layer = KVCache()
    layer.state = (keys, values, keys.shape[2])
    return [*cache[:i], layer, *cache[i + 1 :]]


def tensor_sensitivities(
    model: Any,
    cache: Sequence[Any],
    layers: Sequence[int],
    basis: Basis,
    probe: Sequence[int],
    *,
    step: float = PROBE_STEP,
    progress: Progress | None = None,
) -> dict[str, np.ndarray]:
    """Per kind ("k", "v"), per basis layer j (model layer `layers[j]` of `cache`): the KL (nats per
    token over `probe`) that coding that tensor alone at `step` (keys at KEY_FACTOR times it)
    adds."""
    tokens = mx.array(list(probe))[None]
    reference = logprobs_given(model, cache, tokens)
    mx.eval(reference)
    out = {"k": np.zeros(len(layers)), "v": np.zeros(len(layers))}
    probing = basis.without_step_factors()  # the probe's own steps, whatever factors the basis holds
    for j, i in enumerate(layers):
        n = cache[i].offset
        keys, values = cache[i].keys[..., :n, :], cache[i].values[..., :n, :]
        kv: LayerKV = (keys, values, np.arange(keys.shape[2]))
        blobs = encode_layers([kv], probing, step=step, basis_layers=[j], key_factor=KEY_FACTOR).blobs
        ((coded_keys, coded_values),) = decode_layers(blobs, probing)
        out["k"][j] = mean_kl(reference, logprobs_given(model, _with_layer(cache, i, coded_keys, values), tokens))
        out["v"][j] = mean_kl(reference, logprobs_given(model, _with_layer(cache, i, keys, coded_values), tokens))
        if progress:
            progress(j + 1, len(layers))
    return out


def step_factors(
    basis: Basis, sensitivities: dict[str, np.ndarray], *, step: float = PROBE_STEP
) -> dict[str, list[float]]:
    """Per kind, per basis layer, the factor its step is the global step times: sqrt(n / g), twice
    that for keys (module docstring), n the components the tensor keeps at the probe's step and g
    its KL (measured at `step`: tensor_sensitivities) per squared step, bounded to FACTOR_SPREAD of
    the mean and normalised so the values' have a geometric mean of 1."""
    measured = np.concatenate(list(sensitivities.values()))
    finite = measured[np.isfinite(measured)]
    floor = max(KL_FLOOR * float(np.median(finite)) if finite.size else 0.0, 1e-12)
    # A KL that is not a number (the model's own overflow) counts as the most sensitive measured.
    top = max(float(finite.max()) if finite.size else floor, floor)
    raw: dict[str, np.ndarray] = {}
    for kind, tensors in (("k", basis.keys), ("v", basis.values)):
        probed = step * (KEY_FACTOR if kind == "k" else 1.0)
        kl = np.maximum(np.where(np.isfinite(sensitivities[kind]), sensitivities[kind], top), floor)
        kept = np.array([max(1, kept_components(tb.rms / tb.scale, probed)) for tb in tensors], dtype=np.float64)
        raw[kind] = np.sqrt(kept / (kl / probed**2)) * (KEY_FACTOR if kind == "k" else 1.0)
    logs = np.log(np.concatenate([raw["k"], raw["v"]]))
    centre, bound = float(logs.mean()), math.log(FACTOR_SPREAD)
    scale = float(np.exp(np.clip(np.log(raw["v"]), centre - bound, centre + bound).mean()))
    return {
        kind: [round(float(f), 4) for f in np.exp(np.clip(np.log(raw[kind]), centre - bound, centre + bound)) / scale]
        for kind in ("k", "v")
    }
