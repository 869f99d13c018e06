"""Cross-layer prediction for the transform codec: each layer's coefficients predicted from the layer before.

A token's keys and values in layer l are projections of nearly the same residual stream as in layer
l - 1, so a linear map fitted once per model predicts part of them from what the receiver already
decoded: layer l's keys from layer l - 1's decoded keys and values, its values from those and
layer l's own decoded keys (plus a constant each). Only the residual travels, coded as the codec
codes coefficients (kvmesh.codec.transform), its components taken in the order of their
calibration residual's RMS (falling, as the codec's bits and runs assume). On SmolLM2 it made
`--compress small` 8.11x smaller than fp16 at KL 0.0167, against 7.04x at KL 0.0194 with each layer
coded alone (scripts/bench_quality.py: kvmesh.codec.levels; scripts/study_cross_layer.py measured
its variants).

The maps are fitted in the closed loop at one step (kvmesh.codec.prediction_fit): each from the
layer before as a receiver decodes it at that step, so the encoder predicts only at that step
(`Basis.predicted_step`). The sender predicts from what it decoded itself, the same float32
operations as the receiver (`chained`), in NumPy: where the receiver's products are NumPy's too (a
CPU) the two agree bit for bit on the same BLAS; a GPU's products, or another BLAS, round otherwise,
within float32 rounding (0.001 of a step on SmolLM2, printed by the study; on a tiny model's 24
layers the gap stayed within 5e-5 of the scale).

Units: coefficients in units of the tensor's scale (`TensorBasis.scale`), component-major
(components, coded rows), float32 (NumPy arrays where the codec's products are NumPy's, MLX arrays
in MLX's graph).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kvmesh.codec.layer_blob import TransformCodecError

Coefficients = np.ndarray | mx.array


@dataclass
class Predictor:
    """One tensor's map: `weights` (inputs + 1, F) float16, the inputs' coefficients (the layer
    before's keys then values; for values, this layer's keys last) to this tensor's, the constant
    last; `residual_rms` (F,) float32, the calibration residual's RMS per component."""

    weights: np.ndarray
    residual_rms: np.ndarray
    _np: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _mx: dict[str, mx.array] = field(default_factory=dict, repr=False)

    @property
    def inputs(self) -> int:
        return int(self.weights.shape[0]) - 1

    def order(self) -> np.ndarray:
        """The components in the order their residual is coded: falling calibration RMS."""
        if "order" not in self._np:
            self._np["order"] = np.argsort(-self.residual_rms.astype(np.float64), kind="stable")
        return self._np["order"]

    def coded_rms(self) -> np.ndarray:
        """The residual's RMS in coding order (what the codec's bit allocation reads)."""
        return self.residual_rms[self.order()]

    def _matrices(self, numpy: bool) -> tuple[Coefficients, Coefficients]:
        """(inputs, F) and (1, F) float32: the map and the constant, token-major, in NumPy or in MLX
        (each made on first use by its path: a GPU's decoder holds no NumPy copy)."""
        cache = self._np if numpy else self._mx
        if "map" not in cache:
            if numpy:
                w = self.weights.astype(np.float32)
                self._np["map"], self._np["constant"] = np.ascontiguousarray(w[:-1]), np.ascontiguousarray(w[-1:])
            else:
                w16 = mx.array(self.weights)
                self._mx["map"], self._mx["constant"] = w16[:-1].astype(mx.float32), w16[-1:].astype(mx.float32)
                mx.eval(self._mx["map"], self._mx["constant"])
        return cache["map"], cache["constant"]

    def _check(self, inputs: int) -> None:
        if inputs != self.inputs:
            raise TransformCodecError(f"{inputs} coefficients to predict from, the map takes {self.inputs}")

    def predicted(self, inputs: list[Coefficients], *, numpy: bool) -> Coefficients:
        """(F, rows) float32: this tensor's coefficients predicted from `inputs`, each (F', rows).

        The product runs token-major ((rows, inputs) x (inputs, F)), as the decoder's synthesis
        does (`rowwise_product`): a prefix cut from a cache decodes to the whole's first rows, exactly
        where the BLAS rounds each row alike whatever the number of rows."""
        matrix, constant = self._matrices(numpy)
        if numpy:
            stacked = np.concatenate([np.asarray(x) for x in inputs]) if len(inputs) > 1 else np.asarray(inputs[0])
            self._check(stacked.shape[0])
            out = rowwise_product(stacked.T, np.asarray(matrix))
            out += constant
            return np.ascontiguousarray(out.T)
        stacked_mx = mx.concatenate([mx.array(x) if isinstance(x, np.ndarray) else x for x in inputs])
        self._check(stacked_mx.shape[0])
        return mx.contiguous((stacked_mx.T @ matrix + constant).T)


def rowwise_product(rows: np.ndarray, matrix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`rows @ matrix` ((..., N, K) x (K, M)), one row multiplied as two: NumPy hands a product of
    one row to BLAS's matrix-vector routine, whose sums round otherwise than its matrix-matrix one
    (on OpenBLAS, by up to an ulp). Most BLAS builds then round each row alike whatever N is, so a
    cut prefix decodes to exactly the whole's first rows; OpenBLAS 0.3.30-0.3.31 (NumPy 2.3-2.4's)
    on an AMD EPYC CPU rounds each row by how many rows it multiplies (every count tried, 1 to
    4,095 of 4,096), by up to an ulp of the row's largest terms. Products in blocks of a fixed
    number of rows would agree there too, but decoded SmolLM2's cache 15-23% slower on that CPU
    (throwaway A/B, 2026-12-07): those rows agree within float32 rounding instead."""
    if rows.shape[-2] != 1:
        return np.matmul(rows, matrix, out=out)
    padded = np.concatenate([rows, np.zeros_like(rows)], axis=-2)
    result = np.matmul(padded, matrix)[..., :1, :]
    if out is None:
        return result
    out[...] = result
    return out


def chained(prediction: Coefficients, residual: Coefficients | None, order: np.ndarray, step: float) -> Coefficients:
    """A tensor's decoded coefficients (F, rows): the prediction plus the decoded residual, whose
    (n, rows) values, in units of `step`, are those of the first n components of `order` (None: no
    component sent). The sender and the receiver both make theirs here: the same float32 operations."""
    if residual is None or residual.shape[0] == 0:
        return prediction
    n = residual.shape[0]
    if isinstance(prediction, np.ndarray):
        out = prediction.copy()
        out[order[:n]] += np.asarray(residual) * np.float32(step)
        return out
    rows = mx.array(order[:n].astype(np.int32))
    return prediction.at[rows].add(residual * mx.array(np.float32(step)))


def unpredicted(values: Coefficients | None, features: int, rows: int, step: float, *, numpy: bool) -> Coefficients:
    """A tensor coded without prediction as the next layer predicts from it: (F, rows) float32, its
    first n components' values (n, rows), in units of `step`, times the step, the rest zero."""
    if numpy:
        out = np.zeros((features, rows), np.float32)
        if values is not None and values.shape[0]:
            out[: values.shape[0]] = np.asarray(values) * np.float32(step)
        return out
    if values is None or values.shape[0] == 0:
        return mx.zeros((features, rows), mx.float32)
    sent = (values if isinstance(values, mx.array) else mx.array(values)) * mx.array(np.float32(step))
    rest = features - sent.shape[0]
    return mx.concatenate([sent, mx.zeros((rest, rows), mx.float32)]) if rest else sent


class LayerChain:
    """The decoded coefficients (keys, values) of a cache's coded layers, by basis layer, for the
    layers predicted from them; shared by the threads that decode them.

    Layers are `expect`ed in the order they are handed to those threads (all before any starts, or
    each as it is handed out: the pool takes them first in, first out), and a layer waits only for
    one expected before it, which was handed out first and so is running or done: waiting never
    deadlocks the pool, and a layer predicted from one expected after it, or never, fails at once.
    Each layer's coefficients are read once, by the layer after it, and dropped then (a decode holds
    one layer's, not the cache's)."""

    def __init__(self) -> None:
        self._layers: dict[int, Future[tuple[Coefficients, Coefficients]]] = {}
        self._order: dict[int, int] = {}  # basis layer -> when it was expected
        self._lock = threading.Lock()

    def expect(self, layer: int) -> None:
        self._future(layer)

    def _future(self, layer: int) -> Future[tuple[Coefficients, Coefficients]]:
        with self._lock:
            if layer not in self._layers:
                self._layers[layer] = Future()
                self._order.setdefault(layer, len(self._order))
            return self._layers[layer]

    def publish(self, layer: int, coefficients: tuple[Coefficients, Coefficients]) -> None:
        _settle(self._future(layer), coefficients)

    def fail(self, layer: int, error: BaseException) -> None:
        """Layer `layer` did not decode: those predicted from it fail too (with its error)."""
        _settle(self._future(layer), TransformCodecError(f"the layer it is predicted from did not decode: {error}"))

    def previous(self, layer: int) -> tuple[Coefficients, Coefficients]:
        """Basis layer `layer - 1`'s decoded coefficients, once decoded (`layer` expected already)."""
        with self._lock:
            future = self._layers.get(layer - 1)
            before, mine = self._order.get(layer - 1), self._order.get(layer)
        if future is None or before is None:
            raise TransformCodecError(
                f"basis layer {layer} is predicted from layer {layer - 1}, which is not decoded before it"
            )
        if mine is not None and before > mine:
            raise TransformCodecError(f"basis layer {layer} is predicted from layer {layer - 1}, which comes after it")
        coefficients = future.result()
        with self._lock:
            self._layers.pop(layer - 1, None)
        return coefficients

    def close(self, why: str) -> None:
        """Fail every layer not decoded yet (a transfer that stopped), so that nothing waits on it."""
        with self._lock:
            pending = [future for future in self._layers.values() if not future.done()]
        for future in pending:
            _settle(future, TransformCodecError(why))


def _settle(future: Future, outcome: object) -> None:
    """Give `future` its result (or exception) unless it has one: the first outcome stands."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass
