"""A transform codec for full-attention KV layers: a cache a fraction of its size on the wire.

Per layer and tensor (keys, values), rows are tokens with the layer's heads concatenated
(`kv_heads * head_dim` numbers). Keys lose their RoPE first (`kvmesh.codec.rotary`), so that one
basis fits every position. Then:

1. the first `sinks` rows (the attention sink: outliers that take much of the attention) and an optional
   recent window of `recent` rows travel raw, in the cache's own dtype (a bfloat16 cache's outliers
   may lie beyond float16's range, a float32 cache's are kept exact);
2. the other rows are centred and projected on the model's per-layer PCA basis
   (`kvmesh.codec.basis`), and the coefficients divided by the tensor's calibration RMS (of all its
   components together, so one step means the same relative error in every layer; dividing each
   component by its own RMS would give every component the same bits);
3. one quantization step per tensor rounds its coefficients: the global `step` (in those units)
   times the tensor's factor, fitted from the model's measured sensitivity to that layer's keys or
   values (`Basis.step_factor`, kvmesh.codec.sensitivity), so bits go to the layers that matter.
   Within a tensor a uniform step is reverse water-filling: a component whose calibration RMS is
   below what the step leaves as noise (step / sqrt(12)) is not sent at all (zero bits); the others
   get about log2(rms * sqrt(12) / step) bits each (`bit_allocation`), so bits go where the variance is.
   The optional `tail`, the last coded rows, is coded on its own at a finer step (the tokens that
   follow a prefix attend most to its end: on SmolLM2 the last 32 rows at a third of the step
   halved the continuation's KL for 1% more bytes);
4. per tensor, the components are cut into runs whose allocations round up to the same whole
   number of bits; each run's integers are zigzagged and packed four (codes < 4) or two (< 16) to a
   byte, or one a byte with 255 escaping to a separate uint32 array, component-major, and each run
   is zstd-compressed on its own (level 1: zstd's matches only cost here; its Huffman coding of
   the packed bytes is what compresses). Each run also carries the mean offset of its nonzero
   values within their bins, which the decoder adds (a centroid reconstruction: less error, no bits).

Steps 3 and 4 are kvmesh.codec.quantize's. At the step a basis's cross-layer predictors were fitted
at (`Basis.predicted_step`: `--compress small`), each layer after the first is coded as the residual
of its prediction from the layer before (kvmesh.codec.prediction), layer by layer.

`encode_layers(..., ratio=r)` searches the step (secant steps inside a bisected bracket) until the
bytes are 1/r of the fp16 cache's. With a basis fitted without step factors, `key_factor` makes
the keys' step that much coarser than the values' (2 measured best on SmolLM2 at 4-8x).
`kvmesh.codec.transform_decode.decode_layers` gives arrays of that dtype in mlx-lm's KVCache layout
(batch, kv_heads, tokens, head_dim), keys with RoPE re-applied at their positions. Both directions
are MLX graphs over a whole layer (all its heads in each operation), so a Mac runs them on its GPU;
only zstd, the headers and the escaped codes' rare uint32s pass through NumPy. Where MLX computes
on the CPU, the same steps run as NumPy's products and passes and as compiled loops that let the
GIL go (`kvmesh.codec.cpu_kernels`: the rotation, the rounding, the packing), quicker there and with
no hand-off to MLX's stream thread, to the same floats and bytes. No Python loop runs per value or
per head, only per layer and per run of components.

Each layer is its own blob (so a layer decodes as soon as its bytes arrive): `MAGIC` (`MAGIC_RAW_DTYPE`
when its raw rows are not float16, `MAGIC_TAIL` when it has a tail: an older kvmesh refuses what it
would misread), a little-endian u32 header length, a canonical JSON header (the basis's sha256 and the basis layer, the
shape, positions, steps and component counts, and the segments' offsets), then the segments. The
basis itself does not travel with each cache: the receiver needs the one whose id the header names.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvmesh.codec.basis import Basis, BasisError, LayerKV, TensorBasis
from kvmesh.codec.cpu_kernels import rotated_rows
from kvmesh.codec.layer_blob import (
    TransformCodecError,
    Writer,
    blob_magic,
    coded_regions,
)
from kvmesh.codec.layer_pool import map_layers, numpy_by_default
from kvmesh.codec.prediction import Coefficients, chained, unpredicted
from kvmesh.codec.quantize import coded_groups, coded_region, dequantized
from kvmesh.codec.rotary import Rotary, rotate, token_major_numpy_tables, token_major_tables
from kvmesh.codec.transform_decode import RAW_DTYPES

# Leading rows sent raw: the first token is the attention sink, whose keys and values are outliers
# no basis codes well. On SmolLM2 at the default level, coding it too took the worst text's KL from
# 0.0030 to 0.21 (a throwaway run); keeping the next three raw as well (StreamingLLM's four) left
# the KL as it was and, in a float32 cache, cost 2.6% of the bytes on the worst text
# (scripts/bench_quality.py, 2026-12-05: 5.07x with one, 4.94x with four).
SINKS = 1


# --- layout ---------------------------------------------------------------------------------------


def _f32(x: Any) -> mx.array:
    if isinstance(x, mx.array):
        return x.astype(mx.float32)
    return mx.array(np.asarray(x, dtype=np.float32))


def _positions_bht(positions: Any, b: int, h: int, t: int) -> np.ndarray:
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim == 1 and pos.shape[0] == t:
        pos = np.broadcast_to(pos[None, None], (b, h, t))
    elif pos.ndim == 2 and pos.shape == (h, t):
        pos = np.broadcast_to(pos[None], (b, h, t))
    elif pos.shape != (b, h, t):
        raise TransformCodecError(f"positions of shape {pos.shape} for {b}x{h} heads of {t} rows")
    return np.ascontiguousarray(pos, dtype=np.int32)


@dataclass
class _Prepared:
    """One tensor of one layer, projected once; quantized per trial step."""

    # (F, N) coefficients / tensor scale, component-major (as they are coded), of the body's rows
    # and of the tail's (coded at a finer step: `encode_layers`)
    coeffs: Coefficients
    tail: Coefficients
    basis: TensorBasis
    raw: bytes  # the sink and recent rows, (B, H, rows, D), in `raw_dtype`
    raw_dtype: str


def _raw_rows(x: Any, sinks: int, recent: int) -> tuple[bytes, str]:
    """The first `sinks` and last `recent` rows of one tensor (B, H, T, D), as bytes of the tensor's
    own dtype, and its name."""
    if not isinstance(x, mx.array):
        a = np.asarray(x)
        x = mx.array(a if a.dtype == np.float16 else a.astype(np.float32))
    name = str(x.dtype).rsplit(".", 1)[-1]
    if name not in RAW_DTYPES:
        raise TransformCodecError(f"a {name} cache: the transform codec takes float16, bfloat16 or float32 ones")
    t = x.shape[2]
    if x.dtype != mx.bfloat16:  # (in NumPy, on x's own buffer: no hand-off to MLX's stream thread)
        a = np.array(x, copy=False)
        return np.concatenate([a[:, :, :sinks], a[:, :, t - recent :]], axis=2).tobytes(), name
    rows = mx.concatenate([x[:, :, :sinks], x[:, :, t - recent :]], axis=2)
    return np.asarray(rows.view(mx.uint16)).tobytes(), name


def _prepare(
    layers: Sequence[LayerKV], basis: Basis, rows: tuple[int, int, int], basis_layers: Sequence[int]
) -> tuple[list, list[dict]]:
    """Each layer projected once (on the layer threads), and what its header says of it."""
    if len(layers) != len(basis_layers):
        raise BasisError(f"{len(layers)} layers for {len(basis_layers)} basis layers")
    if any(not 0 <= j < len(basis) for j in basis_layers):
        raise BasisError(f"basis layers {list(basis_layers)} for a basis of {len(basis)}")
    # Evaluated here: a graph is evaluated on the thread that made it, and the layers go to others.
    mx.eval([x for k, v, _ in layers for x in (k, v) if isinstance(x, mx.array)])
    memo: dict = {}
    done = map_layers(lambda item: _prepare_layer(*item, basis, rows, memo), list(enumerate(zip(layers, basis_layers))))
    return [p for p, _ in done], [meta for _, meta in done]


def prepared_coefficients(layers: Sequence[LayerKV], basis: Basis, sinks: int) -> list[list[np.ndarray]]:
    """Per layer of a cache (one per basis layer, in order), its keys' and values' coefficients past the
    `sinks` raw rows, (F, rows) float32 in units of each tensor's scale, as the encoder projects them."""
    prepared, _ = _prepare(layers, basis, (sinks, 0, 0), list(range(len(layers))))
    return [[np.array(p.coeffs) for p in layer] for layer, _ in prepared]


def _analysed(x: mx.array, tb: TensorBasis, rotation: tuple[mx.array, mx.array] | None, rotary: Rotary) -> mx.array:
    """(F, N) component-major coefficients of a region's rows (B, H, T', D), RoPE taken off with
    `rotation`'s tables (keys), in units of the tensor's scale: made contiguous once, not per trial
    step (MLX is slow on strided arrays). An MLX graph (what a GPU runs)."""
    b, h, m, d = x.shape
    block = x.transpose(0, 2, 1, 3)  # (B, T', H, D): token-major
    if rotation is not None:
        block = rotate(block, rotation[0], rotation[1], rotary, inverse=True)
    rows = block.reshape(b * m, h * d)
    coeffs = ((rows - tb.on_mlx("mean")) @ tb.on_mlx("analysis")) * mx.array(np.float32(1.0 / tb.scale))
    coeffs = mx.contiguous(coeffs.T)
    mx.eval(coeffs)
    return coeffs


def _analysed_numpy(
    x: np.ndarray,
    region: tuple[int, int],
    tb: TensorBasis,
    rotation: tuple[np.ndarray, np.ndarray] | None,
    rotary: Rotary,
) -> np.ndarray:
    """`_analysed` of rows [lo, hi) of x (B, H, T, D) where MLX computes on the CPU: its product is
    NumPy's (`kvmesh.codec.transform_decode._synthesised_into` says why); the rotation taken off and
    the mean in one compiled pass over the layer's own buffer (`kvmesh.codec.cpu_kernels`), with no
    hand-off to MLX's stream thread."""
    b, h, _, d = x.shape
    lo, hi = region
    rows = np.empty((b, hi - lo, h, d), np.float32)
    mean = tb.mean.reshape(h, d)
    if rotation is not None:
        rotated_rows(x, lo, rows, mean, rotation[0], rotation[1], rotary.dims, rotary.traditional, True)
    else:
        np.subtract(x[:, :, lo:hi].transpose(0, 2, 1, 3), mean, out=rows)
    coeffs = tb.analysis().T @ rows.reshape(-1, h * d).T
    coeffs *= np.float32(1.0 / tb.scale)
    return coeffs


def _prepare_layer(
    i: int, layer: tuple[LayerKV, int], basis: Basis, rows: tuple[int, int, int], memo: dict
) -> tuple[tuple[list[_Prepared], np.ndarray | None], dict]:
    """Layer i's tensors projected on basis layer j, its positions when not contiguous, its header.
    `rows`: the (sinks, tail, recent) rows asked for, fewer where the layer is shorter."""
    (k, v, positions), j = layer
    keys, values = _f32(k), _f32(v)
    if keys.ndim != 4 or keys.shape != values.shape:
        raise TransformCodecError(f"layer {i}: keys {keys.shape} and values {values.shape}")
    b, h, t, d = keys.shape
    if h * d != basis.keys[j].features:
        raise BasisError(f"layer {i}: {h} heads of {d} for a basis of {basis.keys[j].features} features")
    pos = _positions_bht(positions, b, h, t)
    s = min(rows[0], t)
    r = min(rows[2], t - s)
    tail = min(rows[1], t - s - r)
    meta: dict[str, Any] = {"layer": j, "shape": [b, h, t, d], "sinks": s, "recent": r}
    if tail:
        meta["tail"] = tail
    prepared = []
    numpy = numpy_by_default()
    for kind, x, tb in (("k", keys, basis.keys[j]), ("v", values, basis.values[j])):
        regions: list[Coefficients] = []
        rows_of = np.array(x, copy=False) if numpy else None  # (MLX evaluates x here, on this thread)
        for lo, hi in coded_regions(t, s, r, tail):
            rotary, at = basis.rotaries[j], pos[:, :, lo:hi]
            if hi == lo:
                regions.append(np.zeros((h * d, 0), np.float32) if numpy else mx.zeros((h * d, 0)))
            elif rows_of is not None:
                tables = token_major_numpy_tables(rotary, at, memo) if kind == "k" else None
                regions.append(_analysed_numpy(rows_of, (lo, hi), tb, tables, rotary))
            else:
                graph_tables = token_major_tables(rotary, at, memo) if kind == "k" else None
                regions.append(_analysed(x[:, :, lo:hi], tb, graph_tables, rotary))
        body, tail_coeffs = regions
        prepared.append(_Prepared(body, tail_coeffs, tb, *_raw_rows(k if kind == "k" else v, s, r)))
    contiguous = t == 0 or bool((pos == pos.flat[0] + np.arange(t, dtype=np.int32)).all())
    meta["positions"] = {"start": int(pos.flat[0]) if t else 0} if contiguous else {"shape": list(pos.shape)}
    return (prepared, pos if not contiguous else None), meta


def _assemble_layer(
    layer, pos, meta, basis: Basis, steps: tuple[float, float], key_factor: float, level: int, numpy: bool
) -> bytes:
    """One layer's blob, its body's coefficients rounded at `steps[0]` and its tail's at `steps[1]`
    (`numpy`: rounded in NumPy, kvmesh.codec.quantize)."""

    def code(out: Writer, kind: str, p: _Prepared) -> dict:
        factor = basis.step_factor(meta["layer"], kind, key_factor)
        rms = p.basis.rms / p.basis.scale
        km = coded_groups(out, p.coeffs, rms, steps[0] * factor, numpy)
        if "tail" in meta:
            km["tail"] = coded_groups(out, p.tail, rms, steps[1] * factor, numpy, one_run=True)
        return km

    return _layer_blob(layer, pos, meta, basis, level, code)


def _layer_blob(
    layer, pos, meta, basis: Basis, level: int, code: Callable[[Writer, str, _Prepared], dict], predicted: bool = False
) -> bytes:
    """One layer's blob: its positions (where they are not a run), each tensor's codes as `code(out,
    kind, tensor)` adds them to the blob and says them for its header, each tensor's raw rows."""
    out = Writer(level)
    lm = dict(meta)
    if pos is not None:
        lm["positions"] = {**meta["positions"], "seg": out.add(pos.astype("<i4").tobytes(), True)}
    for kind, p in zip("kv", layer, strict=True):
        lm[kind] = {**code(out, kind, p), "raw": out.add(p.raw, False), "raw_dtype": p.raw_dtype}
    if predicted:
        lm["predicted"] = True
    magic = blob_magic({p.raw_dtype for p in layer}, "tail" in meta, predicted)
    return out.blob({"basis": basis.digest, **lm}, magic)


def _assemble(
    prepared, metas, basis: Basis, steps: tuple[float, float], key_factor: float, level: int, numpy: bool
) -> list[bytes]:
    """Each layer's blob at `steps` (the body's, the tail's), on the layer threads."""

    def assemble(item: tuple[tuple[list, np.ndarray | None], dict]) -> bytes:
        (layer, pos), meta = item
        return _assemble_layer(layer, pos, meta, basis, steps, key_factor, level, numpy)

    return map_layers(assemble, list(zip(prepared, metas, strict=True)))


def predicted_layers(metas: list[dict], basis: Basis, step: float, tail: int) -> list[bool]:
    """Which layers are coded as predicted from the one before (kvmesh.codec.prediction): at the
    step the basis's predictors were fitted at, without a tail, each layer whose layer before is
    coded too, with the same rows at the same positions (so a prefix cut cuts both alike). A press
    that kept other positions in each layer, another step, a tail: each layer on its own, as before."""
    if not basis.predicts(step, tail):
        return [False] * len(metas)
    return [False] + [
        meta["layer"] == before["layer"] + 1
        and "start" in meta["positions"]
        and all(meta[key] == before[key] for key in ("shape", "sinks", "recent", "positions"))
        for before, meta in itertools.pairwise(metas)
    ]


def _assemble_predicted(
    prepared, metas, basis: Basis, step: float, key_factor: float, level: int, numpy: bool, predicted: list[bool]
) -> list[bytes]:
    """Each layer's blob at `step`, those `predicted` coded as the residual of their prediction from
    the layer before as the receiver decodes it (so layer by layer, on this thread)."""
    blobs: list[bytes] = []
    before: list[Coefficients] = []
    for ((layer, pos), meta), predict in zip(zip(prepared, metas, strict=True), predicted, strict=True):
        predicted_from = before if predict else None
        blob, before = _chained_layer(layer, pos, meta, basis, step, key_factor, level, numpy, predicted_from)
        blobs.append(blob)
    return blobs


def _chained_layer(
    layer, pos, meta, basis: Basis, step: float, key_factor: float, level: int, numpy: bool, before: list | None
) -> tuple[bytes, list[Coefficients]]:
    """One layer's blob at `step`, predicted from `before` (the layer before's decoded coefficients;
    None: coded on its own), and its own coefficients as the receiver decodes them, for the next."""
    decoded: list[Coefficients] = []

    def code(out: Writer, kind: str, p: _Prepared) -> dict:
        tensor_step = step * basis.step_factor(meta["layer"], kind, key_factor)
        inputs = None if before is None else (before + decoded[:1] if kind == "v" else before)
        km, coefficients = coded_tensor(out, p.coeffs, p.basis, tensor_step, numpy, inputs)
        decoded.append(coefficients)
        return km

    return _layer_blob(layer, pos, meta, basis, level, code, before is not None), decoded


def coded_tensor(
    out: Writer,
    coeffs: Coefficients,
    tb: TensorBasis,
    step: float,
    numpy: bool,
    inputs: list[Coefficients] | None = None,
) -> tuple[dict, np.ndarray]:
    """A tensor's coefficients (F, rows), in units of its scale, coded into `out` at `step`: on their
    own, or (`inputs`) as the residual of their prediction from the layer before (`tb.predictor`),
    its components in the predictor's order. What the header says of them, and the coefficients
    (F, rows, float32) the receiver decodes: the sender predicts from those, the same float32
    operations as the receiver (`kvmesh.codec.prediction.chained`)."""
    exact = np.asarray(coeffs)
    if inputs is None:
        km, quantized = coded_region(out, coeffs, tb.rms / tb.scale, step, numpy)
        features, rows = exact.shape
        return km, np.asarray(unpredicted(dequantized(quantized, km), features, rows, step, numpy=True))
    if tb.predictor is None:
        raise BasisError("a layer predicted from the one before, with a basis without a predictor for it")
    prediction = np.asarray(tb.predictor.predicted(inputs, numpy=True))
    order = tb.predictor.order()
    residual = mx.array(np.ascontiguousarray((exact - prediction)[order]))
    km, quantized = coded_region(out, residual, tb.predictor.coded_rms(), step, numpy)
    return km, np.asarray(chained(prediction, dequantized(quantized, km), order, step))


def fp16_nbytes(layers: Sequence[LayerKV]) -> int:
    """Bytes of the layers' keys and values in float16."""
    return sum(2 * 2 * int(np.prod(np.shape(k))) for k, _, _ in layers)


@dataclass
class Encoded:
    """Per layer, its blob; coded with one global `step` (each tensor's is its factor times it)."""

    blobs: list[bytes]
    step: float
    fp16_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    @property
    def ratio(self) -> float:
        return self.fp16_bytes / max(1, self.nbytes)


def encode_layers(
    layers: Sequence[LayerKV],
    basis: Basis,
    step: float | None = None,
    ratio: float | None = None,
    *,
    basis_layers: Sequence[int] | None = None,
    sinks: int = SINKS,
    tail: int = 0,
    tail_factor: float = 1.0,
    recent: int = 0,
    key_factor: float = 2.0,
    level: int = 1,
    numpy: bool | None = None,
    tolerance: float = 0.01,
    max_iter: int = 24,
) -> Encoded:
    """Encode per-layer (keys, values, positions) with one global `step`, or with the step that makes
    the bytes `ratio` times smaller than fp16 (searched to `tolerance`: the largest encoding within
    the target size, or the coarsest step's if even that exceeds it). Layer i is coded with the
    basis's layer `basis_layers[i]` (default: i). Each tensor's step is the basis's factor for it
    times `step` (`Basis.step_factor`: for a basis without fitted factors, `key_factor` for keys).
    `sinks` leading and `recent` trailing rows travel raw (in the layers' own dtype); the `tail` rows
    before the recent ones are coded at `tail_factor` times each tensor's step (what a prompt's next
    tokens attend to most: a finer step there costs few bytes for much of the loss). `numpy`: round
    and pack in NumPy or in MLX's graph (None: `numpy_by_default`); the codes are the same. At the
    step a basis's predictors were fitted at, layers are predicted from the one before
    (`predicted_layers`); a search for a `ratio` never predicts."""
    if (step is None) == (ratio is None):
        raise TransformCodecError("give either step or ratio")
    if step is not None and not (math.isfinite(step) and step > 0):
        raise TransformCodecError(f"the step must be a positive number, not {step}")
    if not (math.isfinite(tail_factor) and tail_factor > 0):
        raise TransformCodecError(f"the tail's step factor must be a positive number, not {tail_factor}")
    if any(not (isinstance(rows, int) and rows >= 0) for rows in (sinks, tail, recent)):
        raise TransformCodecError(f"sinks, tail and recent rows must be counts, not {sinks}, {tail}, {recent}")
    indices = list(range(len(layers))) if basis_layers is None else list(basis_layers)
    numpy = numpy_by_default() if numpy is None else numpy
    prepared, metas = _prepare(layers, basis, (sinks, tail, recent), indices)
    full = fp16_nbytes(layers)
    if step is not None:
        predicted = predicted_layers(metas, basis, step, tail)
        if any(predicted):
            blobs = _assemble_predicted(prepared, metas, basis, step, key_factor, level, numpy, predicted)
            return Encoded(blobs, step, full)
        return Encoded(
            _assemble(prepared, metas, basis, (step, step * tail_factor), key_factor, level, numpy), step, full
        )
    assert ratio is not None
    target = full / ratio

    def trial(log_step: float) -> Encoded:
        s = math.exp(log_step)
        return Encoded(_assemble(prepared, metas, basis, (s, s * tail_factor), key_factor, level, numpy), s, full)

    # Secant steps on (log step, log bytes), kept inside the bracket once there is one.
    lo: tuple[float, float] | None = None  # a step whose bytes exceed the target
    hi: tuple[float, float] | None = None  # a step whose bytes fit it
    best: Encoded | None = None
    x, limit = math.log(0.3), (math.log(1e-5), math.log(1e3))
    history: list[tuple[float, float]] = []
    for _ in range(max_iter):
        enc = trial(x)
        y = math.log(enc.nbytes)
        if enc.nbytes <= target:
            hi = (x, y)
            if best is None or best.nbytes < enc.nbytes:
                best = enc
        else:
            lo = (x, y)
        if best is not None and best.nbytes >= (1 - tolerance) * target:
            break
        goal = math.log(target * (1 - tolerance / 2))
        if lo is not None and hi is not None:
            slope = (hi[1] - lo[1]) / (hi[0] - lo[0]) if hi[0] != lo[0] else 0.0
            guess = lo[0] + (goal - lo[1]) / slope if slope < 0 else (lo[0] + hi[0]) / 2
            inner = (min(lo[0], hi[0]), max(lo[0], hi[0]))
            margin = 0.02 * (inner[1] - inner[0])
            x = min(max(guess, inner[0] + margin), inner[1] - margin)
        else:
            # Not bracketed yet: the secant through the last two steps (at first, bytes falling by
            # ~40% of a log unit per log unit of step), overshooting a little to bracket the target.
            slope = (y - history[-1][1]) / (x - history[-1][0]) if history and x != history[-1][0] else -0.4
            slope = min(slope, -0.05)
            history.append((x, y))
            x = min(max(x + 1.2 * (goal - y) / slope, limit[0]), limit[1])
            if (lo is not None and x <= lo[0]) or (hi is not None and x >= hi[0]):
                break  # the step is at its limit
    if best is None:  # even the coarsest step is too big (raw rows alone exceed the target)
        best = trial(limit[1])
    return best


def layers_of_cache(cache: Sequence[Any], positions: Sequence[Any] | None = None) -> list[LayerKV]:
    """(keys, values, positions) per layer of an mlx-lm prompt cache (KVCache, or kvmesh's
    SparseKVCache): positions are 0..n-1 unless given (a sparse cache that evicted must give them)."""
    out: list[LayerKV] = []
    for i, layer in enumerate(cache):
        if hasattr(layer, "keys_and_values"):
            keys, values = layer.keys_and_values()
        else:
            n = layer.offset
            keys, values = layer.keys[..., :n, :], layer.values[..., :n, :]
        if isinstance(keys, tuple):
            raise TransformCodecError(f"layer {i}: a quantized cache; the transform codec takes float caches")
        t = keys.shape[2]
        if positions is not None:
            pos = positions[i]
        elif getattr(layer, "offset", t) != t:
            raise TransformCodecError(f"layer {i}: {t} rows kept of {layer.offset}: give their positions")
        else:
            pos = np.arange(t)
        out.append((keys, values, pos))
    return out
