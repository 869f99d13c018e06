"""Fitting a basis's cross-layer predictors (kvmesh.codec.prediction) on calibration caches.

Each map is a ridge regression fitted in the closed loop, layer by layer, at the one step the
encoder will predict at: its inputs are the calibration texts' coefficients of the layer before
(and for values this layer's keys) as a receiver decodes them at that step, coded by the codec
itself (`kvmesh.codec.transform.coded_tensor`), so the map learns from the noise it will be fed.
The weights are kept in float16 (as the basis stores them) before the residual's RMS is measured
with them. On SmolLM2 (30 layers, 192 features) the maps take 11 MB beside the basis's 4.5 MB.
"""

from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np

from kvmesh.codec.basis import Basis, BasisError, LayerKV
from kvmesh.codec.layer_blob import Writer
from kvmesh.codec.prediction import Coefficients, Predictor
from kvmesh.codec.sensitivity import KEY_FACTOR
from kvmesh.codec.transform import SINKS, coded_tensor, prepared_coefficients

# Ridge regularisation, as a share of each input's own energy (the constant's too), plus a
# trace-scaled floor for inputs that are all zero (components the layer before did not send):
# scripts/study_cross_layer.py's, measured there.
RIDGE = 0.01


def fit_predictors(calibration: Sequence[Sequence[LayerKV]], basis: Basis, step: float) -> Basis:
    """`basis` with a predictor for the keys and values of each layer after the first, fitted on the
    calibration caches (per text, per basis layer: keys, values, positions) coded at the global
    `step` (each tensor's: its factor times it); the basis records the step (`Basis.predicted_step`)."""
    if not basis.has_step_factors:
        raise BasisError("predictors are fitted for a basis with per-layer step factors")
    texts = [prepared_coefficients(layers, basis, SINKS) for layers in calibration]
    decoded: list[list[list[np.ndarray]]] = [[] for _ in texts]  # [text][layer][k, v], (F, rows)
    fitted: dict[str, list] = {"k": [], "v": []}
    for j in range(len(basis)):
        for d in decoded:
            d.append([])
        for i, (kind, tb) in enumerate(zip("kv", basis.pair(j), strict=True)):
            inputs = [d[j - 1] + d[j][:i] for d in decoded] if j else None
            exact = [text[j][i] for text in texts]
            predictor = _fitted(inputs, exact) if inputs is not None else None
            tb = replace(tb, predictor=predictor)
            fitted[kind].append(tb)
            tensor_step = step * basis.step_factor(j, kind, KEY_FACTOR)
            for t, (d, x) in enumerate(zip(decoded, exact, strict=True)):
                given: list[Coefficients] | None = list(inputs[t]) if inputs is not None else None
                d[j].append(coded_tensor(Writer(1), mx.array(x), tb, tensor_step, True, given)[1])
        for d, text in zip(decoded, texts, strict=True):  # (what the next layers no longer read)
            text[j] = []
            if j:
                d[j - 1] = []
    info = {**basis.info, "predicted_step": step}
    return Basis(fitted["k"], fitted["v"], list(basis.rotaries), info)


def ridge_map(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The ridge regression of rows `y` (N, F) on rows `x` (N, inputs), float64 (inputs, F)."""
    gram = x.T @ x
    gram += RIDGE * np.diag(np.diag(gram)) + 1e-6 * np.trace(gram) / len(gram) * np.eye(len(gram))
    return np.linalg.solve(gram, x.T @ y)


def _fitted(inputs: list[list[np.ndarray]], exact: list[np.ndarray]) -> Predictor:
    """The ridge map from the inputs (per text, the arrays (F', rows) they stack) and a constant to
    the exact coefficients (per text, (F, rows)), its weights in float16."""
    ones = [np.ones((1, parts[0].shape[1]), np.float32) for parts in inputs]
    x = np.concatenate([np.concatenate([*parts, one]) for parts, one in zip(inputs, ones, strict=True)], axis=1)
    x = x.astype(np.float64).T
    y = np.concatenate(exact, axis=1).astype(np.float64).T
    weights = ridge_map(x, y).astype(np.float16)
    residual = y - x @ weights.astype(np.float64)
    return Predictor(weights, np.sqrt((residual**2).mean(axis=0)).astype(np.float32))
