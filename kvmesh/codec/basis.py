"""A per-model PCA basis for the transform codec: per layer, one for keys (RoPE removed), one for values.

Each basis spans the heads of a layer jointly: a row is one token's `kv_heads * head_dim` numbers (the
heads concatenated), so the correlation between heads is used too. It is fitted once per model from
calibration caches of ordinary text (`fit_basis`) and travels as bytes with a sha256 content id: peers
cannot recompute it bit for bit (BLAS sums in other orders), so a receiver checks the bytes against
the id the sender names (`Basis.from_bytes(data, digest)`).

The bytes are a safetensors file (readable by `mx.load` or `safetensors`; written, read and checked
sane by kvmesh.codec.basis_file, without MLX), the same basis always giving the same bytes:
`layers.{i}.{k|v}.mean` (float32, F), `.components` (float16 by default, (F, F): row j is component
j, in order of decreasing calibration variance), `.rms` (float32, F: the calibration RMS of each
component's coefficient), and in a basis that predicts each layer from the one before, for every
layer after the first, `.predictor` (float16) and `.residual_rms` (float32): kvmesh.codec.prediction;
the metadata holds each layer's rotary settings and how it was fitted (`info["predicted_step"]`: the
step its predictors were fitted at).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from kvmesh.codec.basis_file import FORMAT, BasisError, read_basis, safetensors_bytes
from kvmesh.codec.levels import Level
from kvmesh.codec.prediction import Predictor
from kvmesh.codec.rotary import Rotary, remove_rope

# What `info["weighted"]` says of a basis whose PCA weighed the features as attention does.
ATTENTION_WEIGHTS = "attention"


@dataclass
class TensorBasis:
    """The PCA of one tensor kind (keys or values) of one layer: x ≈ mean + coefficients @ components."""

    mean: np.ndarray  # (F,) float32
    components: np.ndarray  # (F, F) float16/float32, row j = component j
    rms: np.ndarray  # (F,) float32, decreasing
    # Its prediction from the layer before (kvmesh.codec.prediction), where the basis has them.
    predictor: Predictor | None = None
    _synthesis: np.ndarray | None = field(default=None, repr=False)
    _analysis: np.ndarray | None = field(default=None, repr=False)
    _mx: dict[str, mx.array] = field(default_factory=dict, repr=False)
    _np: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def features(self) -> int:
        return int(self.mean.shape[0])

    @functools.cached_property
    def scale(self) -> float:
        """The calibration RMS per feature (all components together): the unit coefficients are coded in."""
        return float(np.sqrt(np.mean(self.rms.astype(np.float64) ** 2))) or 1.0

    def synthesis(self) -> np.ndarray:
        """(F, F) float32: coefficients -> centred rows (what the decoder multiplies by)."""
        if self._synthesis is None:
            self._synthesis = np.ascontiguousarray(self.components.astype(np.float32))
        return self._synthesis

    def analysis(self) -> np.ndarray:
        """(F, F) float32: centred rows -> coefficients, the exact inverse of the stored (rounded)
        components, so that coding with no quantization reconstructs the input to float rounding."""
        if self._analysis is None:
            self._analysis = np.ascontiguousarray(np.linalg.inv(self.components.astype(np.float64)).astype(np.float32))
        return self._analysis

    def largest_weights(self) -> np.ndarray:
        """(F,) float64: each component's largest |weight| in the synthesis (kept): a decoded number
        is at most |mean| plus the sum of |coefficient| times these."""
        if "largest" not in self._np:
            self._np["largest"] = np.abs(self.synthesis().astype(np.float64)).max(axis=1)
        return self._np["largest"]

    @functools.cached_property
    def largest_mean(self) -> float:
        """max |mean|: with `largest_weights`, what bounds a decoded number."""
        return float(np.abs(self.mean).max(initial=0.0))

    def on_mlx(self, which: str) -> mx.array:
        """`mean`, `synthesis` or `analysis` as an MLX float32 array (kept for the next call)."""
        if which not in self._mx:
            source = {"mean": lambda: self.mean, "synthesis": self.synthesis, "analysis": self.analysis}[which]()
            self._mx[which] = mx.array(np.asarray(source, dtype=np.float32))
        return self._mx[which]

    def project(self, rows: np.ndarray) -> np.ndarray:
        """(N, F) rows -> (N, F) coefficients."""
        return (np.asarray(rows, dtype=np.float32) - self.mean) @ self.analysis()

    def reconstruct(self, coefficients: np.ndarray) -> np.ndarray:
        """(N, n) coefficients of the first n components -> (N, F) rows."""
        n = coefficients.shape[1]
        return np.asarray(coefficients, dtype=np.float32) @ self.synthesis()[:n] + self.mean


def fit_tensor_basis(
    rows: np.ndarray | None = None,
    *,
    moments: tuple | None = None,
    dtype=np.float16,
    weights: np.ndarray | None = None,
) -> TensorBasis:
    """The PCA of (N, F) rows, or of accumulated `moments` (count, sum (F,), sum of outer products (F, F)).

    With `weights` (F,), of the rows scaled by their square roots (the features an error costs more
    in: kvmesh.codec.attention_metric): the components are then the principal axes of the scaled
    rows, scaled back (so no longer orthonormal: the analysis is their inverse all the same), and
    the coefficients' RMS theirs, so that a uniform step spends its error where it costs least."""
    if moments is None:
        assert rows is not None
        r = np.asarray(rows, dtype=np.float64)
        moments = (r.shape[0], r.sum(axis=0), r.T @ r)
    count, total, outer = moments
    if count < 2:
        raise BasisError("a basis needs at least two calibration rows")
    mean = total / count
    cov = outer / count - np.outer(mean, mean)
    root = np.ones(len(mean)) if weights is None else np.sqrt(np.asarray(weights, dtype=np.float64))
    cov = cov * np.outer(root, root)
    cov = (cov + cov.T) / 2
    eigvals, eigvecs = np.linalg.eigh(cov)
    order = np.argsort(eigvals)[::-1]
    eigvals, eigvecs = np.clip(eigvals[order], 0.0, None), eigvecs[:, order]
    # A deterministic sign: each component's largest entry positive.
    signs = np.sign(eigvecs[np.argmax(np.abs(eigvecs), axis=0), np.arange(eigvecs.shape[1])])
    eigvecs = eigvecs * np.where(signs == 0, 1.0, signs)
    return TensorBasis(
        mean=mean.astype(np.float32),
        components=np.ascontiguousarray((eigvecs.T / root).astype(dtype)),
        rms=np.sqrt(eigvals).astype(np.float32),
    )


def _rows(x: Any) -> np.ndarray:
    """(B, H, T, D) -> (B*T, H*D): one row per token, heads concatenated."""
    a = np.asarray(x, dtype=np.float32)
    b, h, t, d = a.shape
    return a.transpose(0, 2, 1, 3).reshape(b * t, h * d)


@dataclass
class Basis:
    """Per layer, the key and value bases, and the rotary settings the keys were un-rotated with."""

    keys: list[TensorBasis]
    values: list[TensorBasis]
    rotaries: list[Rotary]
    info: dict[str, Any] = field(default_factory=dict)
    _bytes: bytes | None = field(default=None, repr=False)
    _digest: str | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def pair(self, layer: int) -> tuple[TensorBasis, TensorBasis]:
        """Layer `layer`'s key and value bases."""
        return self.keys[layer], self.values[layer]

    def to_bytes(self) -> bytes:
        """The basis as deterministic safetensors bytes."""
        if self._bytes is None:
            tensors: dict[str, np.ndarray] = {}
            for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
                for kind, tb in (("k", k), ("v", v)):
                    tensors[f"layers.{i}.{kind}.mean"] = tb.mean
                    tensors[f"layers.{i}.{kind}.components"] = tb.components
                    tensors[f"layers.{i}.{kind}.rms"] = tb.rms
                    if tb.predictor is not None:
                        tensors[f"layers.{i}.{kind}.predictor"] = tb.predictor.weights
                        tensors[f"layers.{i}.{kind}.residual_rms"] = tb.predictor.residual_rms
            meta = {
                "format": FORMAT,
                "rotaries": json.dumps([r.to_dict() for r in self.rotaries], sort_keys=True, separators=(",", ":")),
                "info": json.dumps(self.info, sort_keys=True, separators=(",", ":")),
            }
            self._bytes = safetensors_bytes(tensors, meta)
        return self._bytes

    @property
    def digest(self) -> str:
        """sha256 of the bytes, hex: the basis's content id."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.to_bytes()).hexdigest()
        return self._digest

    @property
    def nbytes(self) -> int:
        return len(self.to_bytes())

    @property
    def has_step_factors(self) -> bool:
        """Whether calibration fitted a step factor per layer and tensor (kvmesh.codec.sensitivity)."""
        return "steps" in self.info

    @property
    def weighted(self) -> bool:
        """Whether its PCA was fitted with the attention's weights (kvmesh.codec.attention_metric):
        the `--compress` levels' steps were measured on such bases; one fitted before them needs
        its own (kvmesh.codec.levels)."""
        return self.info.get("weighted") == ATTENTION_WEIGHTS

    @property
    def predicted_step(self) -> float | None:
        """The global step its predictors were fitted at (kvmesh.codec.prediction_fit): layers
        coded at it are predicted from the layer before; None: it has none."""
        step = self.info.get("predicted_step")
        return float(step) if step is not None else None

    def step_at(self, level: Level) -> float:
        """The global step a `--compress` level codes with on this basis."""
        return level.step_for(factors=self.has_step_factors, weighted=self.weighted, predicted_step=self.predicted_step)

    def predicts(self, step: float, tail: int) -> bool:
        """Whether layers coded with this basis at the global `step`, with a tail of `tail` rows,
        are predicted from the one before (kvmesh.codec.transform.predicted_layers): at the step its
        predictors were fitted at, without a tail."""
        return self.predicted_step is not None and step == self.predicted_step and not tail

    def predicts_at(self, level: Level) -> bool:
        """Whether a cache coded at `level` with this basis has its layers predicted (`predicts`)."""
        return self.predicts(self.step_at(level), level.tail)

    def without_step_factors(self) -> Basis:
        """This basis as fitted before per-layer step factors: one step for every layer."""
        if not self.has_step_factors:
            return self
        info = {k: v for k, v in self.info.items() if k != "steps"}
        return replace(self, info=info, _bytes=None, _digest=None).without_predictors()

    def without_predictors(self) -> Basis:
        """This basis as fitted before cross-layer prediction (kvmesh.codec.prediction)."""
        if self.predicted_step is None:
            return self
        info = {k: v for k, v in self.info.items() if k != "predicted_step"}
        keys, values = ([replace(tb, predictor=None) for tb in tbs] for tbs in (self.keys, self.values))
        return replace(self, keys=keys, values=values, info=info, _bytes=None, _digest=None)

    def step_factor(self, layer: int, kind: str, key_factor: float) -> float:
        """What the global step is multiplied by for basis layer `layer`'s keys ("k") or values
        ("v"): the factor fitted from measured sensitivity (kvmesh.codec.sensitivity), or, for a
        basis fitted without factors, `key_factor` for keys and 1 for values."""
        if not self.has_step_factors:
            return key_factor if kind == "k" else 1.0
        return float(self.info["steps"][kind][layer])

    def covered(self) -> list[int]:
        """The model layer each layer of the basis codes (the fit's `layers`; one each, in order, for
        a basis that does not say)."""
        return list(self.info.get("layers", range(len(self))))

    @classmethod
    def from_bytes(cls, data: bytes, digest: str) -> Basis:
        """The basis of `data`, refused unless its sha256 is `digest` (hex) and its numbers are sane
        (kvmesh.codec.basis_file.read_basis: the digest proves whose bytes they are, not that they are
        a basis)."""
        got = hashlib.sha256(data).hexdigest()
        if got != digest.lower():
            raise BasisError(f"basis bytes do not match their id: sha256 {got[:16]}..., expected {digest[:16]}...")
        tensors, meta = read_basis(data)
        try:
            rotaries = [Rotary.from_dict(r) for r in json.loads(meta["rotaries"])]
            info = json.loads(meta.get("info", "{}"))
            keys: list[TensorBasis] = []
            values: list[TensorBasis] = []
            for i in range(len(rotaries)):
                for kind, out in (("k", keys), ("v", values)):
                    p = f"layers.{i}.{kind}."
                    mean, components, rms = tensors[p + "mean"], tensors[p + "components"], tensors[p + "rms"]
                    f = mean.shape[0] if mean.ndim == 1 else -1
                    if f < 1 or components.shape != (f, f) or rms.shape != (f,):
                        raise BasisError(f"basis tensors {p}*: mean {mean.shape}, components {components.shape}")
                    out.append(TensorBasis(mean, components, rms, _predictor(tensors, p, i, kind, keys)))
        except KeyError as e:
            raise BasisError(f"basis lacks {e.args[0]}") from None
        except (ValueError, TypeError, AttributeError) as e:
            if isinstance(e, BasisError):
                raise
            raise BasisError(f"unreadable basis metadata: {e}") from None
        if not isinstance(info, dict):
            raise BasisError("unreadable basis metadata: info is not an object")
        layers = info.get("layers", [])
        if not isinstance(layers, list) or not all(type(x) is int for x in layers):
            raise BasisError(f"unreadable basis metadata: the layers it covers are {layers!r:.80}")
        step = info.get("predicted_step")
        predicts = [tb.predictor is not None for tb in keys[1:] + values[1:]]
        if step is not None and not (type(step) in (int, float) and 0 < step < float("inf")):
            raise BasisError(f"unreadable basis metadata: its predicted step is {step!r:.40}")
        if (step is None and any(predicts)) or (step is not None and not all(predicts)):
            raise BasisError("a basis predicts every layer after the first at its predicted step, or none")
        return cls(keys, values, rotaries, info, _bytes=bytes(data))


def _predictor(
    tensors: dict[str, np.ndarray], prefix: str, layer: int, kind: str, keys: list[TensorBasis]
) -> Predictor | None:
    """The predictor stored under `prefix` (`layers.{i}.{k|v}.`), checked against the layers it reads:
    the layer before's keys and values, and for values this layer's keys (`keys` holds those read)."""
    weights, rms = tensors.get(prefix + "predictor"), tensors.get(prefix + "residual_rms")
    if weights is None and rms is None:
        return None
    if weights is None or rms is None or layer == 0:
        raise BasisError(f"basis tensors {prefix}*: a predictor needs its map and residual RMS, and a layer before")
    f = tensors[prefix + "mean"].shape[0]
    before = tensors[f"layers.{layer - 1}.k.mean"].shape[0] + tensors[f"layers.{layer - 1}.v.mean"].shape[0]
    inputs = before + (keys[layer].features if kind == "v" else 0)
    if weights.shape != (inputs + 1, f) or rms.shape != (f,):
        raise BasisError(f"basis tensors {prefix}*: a predictor {weights.shape} for {inputs} inputs of {f} features")
    return Predictor(weights, rms)


LayerKV = tuple[Any, Any, Any]  # (keys (B, H, T, D), values (B, H, T, D), positions (T,) | (H, T) | (B, H, T))


def fit_basis(
    calibration: Iterable[Sequence[LayerKV]],
    rotaries: Sequence[Rotary],
    skip: int = 4,
    dtype=np.float16,
    info: dict[str, Any] | None = None,
    weights: Sequence[tuple[np.ndarray | None, np.ndarray | None]] | None = None,
) -> Basis:
    """Fit the per-layer key and value bases from calibration caches.

    `calibration` yields caches, each a sequence of per-layer (keys, values, positions); keys are
    un-rotated with `rotaries` first. The first `skip` rows of each cache are left out of the fit:
    the attention sink, which the codec sends raw (`kvmesh.codec.transform.SINKS`), and three more,
    which it sent raw too before 2026-12-05 (they code as well as any; left out still, a refit finds
    the components it found before). `weights`, per layer (keys', values'), weigh the features
    (`fit_tensor_basis`; None: not weighed); the basis then says so (`Basis.weighted`).
    """
    n_layers = len(rotaries)
    acc: list[list[Any]] = [[None, None] for _ in range(n_layers)]
    caches = 0
    for cache in calibration:
        caches += 1
        if len(cache) != n_layers:
            raise BasisError(f"a calibration cache of {len(cache)} layers for {n_layers} rotaries")
        for i, (k, v, pos) in enumerate(cache):
            keys = mx.array(np.asarray(k, dtype=np.float32)) if not isinstance(k, mx.array) else k.astype(mx.float32)
            pos_np = np.asarray(pos)
            keys = remove_rope(keys, pos_np, rotaries[i])
            for j, x in enumerate((keys, v)):
                rows = _rows(x[:, :, skip:, :]).astype(np.float64)
                m = (rows.shape[0], rows.sum(axis=0), rows.T @ rows)
                if acc[i][j] is None:
                    acc[i][j] = list(m)
                else:
                    acc[i][j][0] += m[0]
                    acc[i][j][1] = acc[i][j][1] + m[1]
                    acc[i][j][2] = acc[i][j][2] + m[2]
    if caches == 0:
        raise BasisError("no calibration caches")
    w = list(weights) if weights is not None else [(None, None)] * n_layers
    if len(w) != n_layers:
        raise BasisError(f"weights for {len(w)} layers of {n_layers}")
    keys_b = [fit_tensor_basis(moments=tuple(a[0]), dtype=dtype, weights=w[i][0]) for i, a in enumerate(acc)]
    values_b = [fit_tensor_basis(moments=tuple(a[1]), dtype=dtype, weights=w[i][1]) for i, a in enumerate(acc)]
    meta = {"caches": caches, "skip": skip, **(info or {})}
    if any(x is not None for pair in w for x in pair):
        meta["weighted"] = ATTENTION_WEIGHTS
    return Basis(keys_b, values_b, list(rotaries), meta)
