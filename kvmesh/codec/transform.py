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

`encode_layers(..., ratio=r)` searches the step (secant steps inside a bisected bracket) until the
bytes are 1/r of the fp16 cache's. With a basis fitted without step factors, `key_factor` makes
the keys' step that much coarser than the values' (2 measured best on SmolLM2 at 4-8x).
`kvmesh.codec.transform_decode.decode_layers` gives arrays of that dtype in mlx-lm's KVCache layout
(batch, kv_heads, tokens, head_dim), keys with RoPE re-applied at their positions. Both directions
are MLX graphs over a whole layer (all its heads in each operation), so a Mac runs them on its GPU;
only zstd, the headers and the escaped codes' rare uint32s pass through NumPy. No Python loop runs
per value or per head, only per layer and per run of components.

Each layer is its own blob (so a layer decodes as soon as its bytes arrive): `MAGIC` (`MAGIC_RAW_DTYPE`
when its raw rows are not float16, `MAGIC_TAIL` when it has a tail: an older kvmesh refuses what it
would misread), a little-endian u32 header length, a canonical JSON header (the basis's sha256 and the basis layer, the
shape, positions, steps and component counts, and the segments' offsets), then the segments. The
basis itself does not travel with each cache: the receiver needs the one whose id the header names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvmesh.codec.basis import Basis, BasisError, LayerKV, TensorBasis
from kvmesh.codec.layer_blob import (
    ESCAPE,
    TransformCodecError,
    Writer,
    blob_magic,
    coded_regions,
    pack_zigzag,
)
from kvmesh.codec.layer_pool import map_layers, numpy_by_default
from kvmesh.codec.rotary import rotate, token_major_tables
from kvmesh.codec.transform_decode import RAW_DTYPES

SQRT12 = math.sqrt(12.0)
# Leading rows sent raw: the first token is the attention sink, whose keys and values are outliers
# no basis codes well. On SmolLM2 at the default level, coding it too took the worst text's KL from
# 0.0030 to 0.21 (a throwaway run); keeping the next three raw as well (StreamingLLM's four) left
# the KL as it was and, in a float32 cache, cost 2.6% of the bytes on the worst text
# (scripts/bench_quality.py, 2026-12-05: 5.07x with one, 4.94x with four).
SINKS = 1


def bit_allocation(rms: np.ndarray, step: float) -> np.ndarray:
    """Bits per component that a uniform quantization step gives (reverse water-filling, high-rate
    approximation): max(0, log2(rms * sqrt(12) / step)). `rms` and `step` in the same units; a
    component with zero bits is not sent."""
    r = np.asarray(rms, dtype=np.float64)
    with np.errstate(divide="ignore"):
        bits = np.log2(np.maximum(r, 0.0) * SQRT12 / float(step))
    return np.maximum(bits, 0.0)


def kept_components(rms: np.ndarray, step: float) -> int:
    """How many leading components (rms decreasing) get bits at this step."""
    return int(np.count_nonzero(bit_allocation(rms, step) > 0))


# --- integers <-> bytes -----------------------------------------------------------------------------


def pack_integers(q: np.ndarray) -> tuple[bytes, bytes]:
    """Signed integers -> (one zigzagged byte each, the escaped ones as little-endian uint32)."""
    zz, top = _zigzag_all(q)
    return _pack(zz, 8, top)


def _zigzag_all(q: np.ndarray | mx.array) -> tuple[mx.array, int]:
    """Signed integers -> (zigzagged, flat; the largest of them)."""
    flat = (q if isinstance(q, mx.array) else mx.array(np.asarray(q, dtype=np.int64))).reshape(-1)
    lo, hi = _bounds(np.asarray(mx.stack([flat.min(), flat.max()]))) if flat.size else (0, 0)
    return _zigzag(flat, lo, hi), max(2 * hi, -2 * lo - 1, 0)


def _bounds(bounds: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) of some integers, refused unless they fit 32 bits."""
    if not np.isfinite(bounds).all():
        raise TransformCodecError("the cache holds NaN or infinite numbers")
    if bounds[1] >= 2**31 or bounds[0] < -(2**31):
        raise TransformCodecError("a coefficient beyond 32 bits: the step is far too fine")
    return int(bounds[0]), int(bounds[1])


def _zigzag_in_int32(lo: int, hi: int) -> bool:
    """Whether integers between lo and hi zigzag in 32 bits (2q must fit), else in 64."""
    return lo >= -(2**30) and hi < 2**30


def _zigzag(q: mx.array, lo: int, hi: int) -> mx.array:
    """Signed integers between lo and hi (in any dtype that holds them) -> zigzagged uint32
    (0, -1, 1, -2 -> 0, 1, 2, 3)."""
    wide = mx.int32 if _zigzag_in_int32(lo, hi) else mx.int64
    flat = q.astype(wide)
    bits = mx.array(1, wide), mx.array(31 if wide == mx.int32 else 63, wide)
    return ((flat << bits[0]) ^ (flat >> bits[1])).astype(mx.uint32)


def code_width(top: int) -> int:
    """Bits per code of zigzagged codes whose largest is `top`: see `pack_codes`."""
    return 8 if top >= 16 else 2 if top < 4 else 4


def pack_codes(q: np.ndarray | mx.array) -> tuple[int, bytes, bytes]:
    """Signed integers of similar size -> (bits per code, packed codes, escapes).

    Zigzagged codes below 4 go four to a byte, below 16 two to a byte (so that the entropy coder,
    which codes bytes, sees the joint statistics of several small codes and can spend less than a
    bit on each); larger ones one byte each, 255 escaping to a uint32 in `escapes`."""
    zz, top = _zigzag_all(q)
    width = code_width(top)
    return (width, *_pack(zz, width, top))


def _pack(zz: mx.array, width: int, top: int) -> tuple[bytes, bytes]:
    """Zigzagged codes (flat uint32) -> (codes packed at `width` bits, escapes), packed in MLX: the
    bytes `kvmesh.codec.layer_blob.pack_zigzag` makes."""
    if width == 8:
        plane = np.asarray(mx.minimum(zz, ESCAPE).astype(mx.uint8)).tobytes()
        if top < ESCAPE:
            return plane, b""
        big = np.asarray(zz)
        return plane, big[big >= ESCAPE].astype("<u4").tobytes()
    per = 8 // width
    pad = -zz.size % per
    codes = mx.concatenate([zz, mx.zeros((pad,), mx.uint32)]) if pad else zz
    shifts = mx.array(np.arange(per, dtype=np.uint32) * width)
    packed = (codes.reshape(-1, per) << shifts).sum(axis=1).astype(mx.uint8)
    return np.asarray(packed).tobytes(), b""


@dataclass
class _Quantized:
    """One tensor's coefficients rounded at its step. Per component: the smallest and largest code,
    the count of nonzero codes and the sum of |x| - |q| over them, x in units of the step (float64,
    to be summed over a group's components: `_centroid_offset`); and the zigzagged codes."""

    lows: np.ndarray
    highs: np.ndarray
    nonzero: np.ndarray
    offsets: np.ndarray
    zigzagged: mx.array | np.ndarray

    def tops(self) -> np.ndarray:
        """The largest zigzagged code of each component, from its extremes."""
        negative = np.where(self.lows < 0, -2 * self.lows - 1, 0)
        return np.maximum(2 * np.maximum(self.highs, 0), negative).astype(np.int64)

    def pack(self, at: int, count: int, width: int, top: int) -> tuple[bytes, bytes]:
        """Components [at, at + count) packed at `width` bits: (plane, escapes)."""
        zz = self.zigzagged[at : at + count].reshape(-1)
        return pack_zigzag(zz, width) if isinstance(zz, np.ndarray) else _pack(zz, width, top)


def _quantize(coeffs: mx.array, n: int, step: float) -> _Quantized:
    """The first n components rounded at `step`, in MLX's graph (what a GPU runs)."""
    scaled = coeffs[:n] / mx.array(np.float32(step))
    q = mx.round(scaled)
    nonzero = q != 0
    stats = (
        q.min(axis=1),
        q.max(axis=1),
        nonzero.astype(mx.int32).sum(axis=1),
        mx.where(nonzero, mx.abs(scaled) - mx.abs(q), 0.0).sum(axis=1),
    )
    mx.eval(*stats)
    lows, highs, count, offsets = (np.asarray(a).astype(np.float64) for a in stats)
    return _Quantized(lows, highs, count, offsets, _zigzag(q, *_bounds(np.array([lows.min(), highs.max()]))))


def _quantize_numpy(coeffs: mx.array, n: int, step: float) -> _Quantized:
    """`_quantize` in NumPy, on the MLX buffer itself (where MLX computes on the CPU): the same codes,
    in fewer and quicker passes. A nonzero code's |x| - |q| is (x - q) * sign(q) exactly
    (x lies within half a step of q), and sign(q) is q clipped to [-1, 1], which is 0 where q is: so
    no mask is made, and the counts of nonzero codes are the sums of sign(q) squared."""
    scaled = np.array(coeffs, copy=False)[:n] / np.float32(step)
    q = np.rint(scaled)
    lows, highs = q.min(axis=1).astype(np.float64), q.max(axis=1).astype(np.float64)
    lo, hi = _bounds(np.array([lows.min(), highs.max()]))
    sign = np.clip(q, -1.0, 1.0)
    scaled -= q
    # (float32 sums, as the graph's; + 0.0 so that a sum of negative zeros is written as 0.0)
    offsets = np.einsum("ij,ij->i", scaled, sign).astype(np.float64) + 0.0
    count = np.einsum("ij,ij->i", sign, sign).astype(np.float64)
    wide = np.int32 if _zigzag_in_int32(lo, hi) else np.int64
    zigzagged = q.astype(wide)
    negative = zigzagged >> (31 if wide == np.int32 else 63)
    zigzagged <<= 1
    zigzagged ^= negative
    return _Quantized(
        lows, highs, count, offsets, zigzagged.view(np.uint32) if wide == np.int32 else zigzagged.astype(np.uint32)
    )


def _centroid_offset(count: np.ndarray, total: np.ndarray) -> float:
    """The mean of |x| - |q| over a group's nonzero codes (from the `_Quantized` of its components):
    where a nonzero code's values lie on average within its bin (below its centre for peaked
    distributions). The decoder reconstructs q + offset * sign(q), which lowers the error at no
    cost in bits."""
    nonzero = int(count.sum())
    return round(float(total.sum() / nonzero), 4) if nonzero else 0.0


def component_groups(rms: np.ndarray, step: float, n: int) -> list[int]:
    """Sizes of the runs of the first n components (rms decreasing) whose bit allocations round up to
    the same whole number (capped at 8): each run is packed and entropy-coded on its own."""
    if n == 0:
        return []
    key = np.minimum(np.ceil(bit_allocation(rms[:n], step)), 8)
    cuts = np.flatnonzero(np.diff(key)) + 1
    return np.diff(np.concatenate([[0], cuts, [n]])).astype(int).tolist()


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
    coeffs: mx.array
    tail: mx.array
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
    rows = mx.concatenate([x[:, :, :sinks], x[:, :, t - recent :]], axis=2)
    return np.asarray(rows.view(mx.uint16) if x.dtype == mx.bfloat16 else rows).tobytes(), name


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


def _analysed(rows: mx.array, tb: TensorBasis) -> mx.array:
    """(F, N) component-major coefficients of (N, F) rows, in units of the tensor's scale: made
    contiguous once, not per trial step (MLX is slow on strided arrays). The product runs in NumPy
    where MLX computes on the CPU (`kvmesh.codec.transform_decode._synthesised` says why)."""
    if numpy_by_default():
        centred = np.asarray(rows) - tb.mean
        coeffs = tb.analysis().T @ centred.T
        coeffs *= np.float32(1.0 / tb.scale)
        return mx.array(coeffs)
    coeffs = ((rows - tb.on_mlx("mean")) @ tb.on_mlx("analysis")) * mx.array(np.float32(1.0 / tb.scale))
    return mx.contiguous(coeffs.T)


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
    for kind, x, tb in (("k", keys, basis.keys[j]), ("v", values, basis.values[j])):
        regions = []
        for lo, hi in coded_regions(t, s, r, tail):
            coeffs = mx.zeros((h * d, 0))
            if hi > lo:
                block = x[:, :, lo:hi].transpose(0, 2, 1, 3)  # (B, T', H, D): token-major
                if kind == "k":
                    cos, sin = token_major_tables(basis.rotaries[j], pos[:, :, lo:hi], memo)
                    block = rotate(block, cos, sin, basis.rotaries[j], inverse=True)
                coeffs = _analysed(block.reshape(b * (hi - lo), h * d), tb)
            mx.eval(coeffs)
            regions.append(coeffs)
        body, tail_coeffs = regions
        prepared.append(_Prepared(body, tail_coeffs, tb, *_raw_rows(k if kind == "k" else v, s, r)))
    contiguous = t == 0 or bool((pos == pos.flat[0] + np.arange(t, dtype=np.int32)).all())
    meta["positions"] = {"start": int(pos.flat[0]) if t else 0} if contiguous else {"shape": list(pos.shape)}
    return (prepared, pos if not contiguous else None), meta


def _coded_groups(
    out: Writer, coeffs: mx.array, rms: np.ndarray, step: float, numpy: bool, *, one_run: bool = False
) -> dict:
    """One region's coefficients rounded at `step`, packed and added to `out` by runs of components
    (`one_run`: all in one, for a region of few rows, whose runs would each cost the decoder a call
    more than their closer fit saves): what the header says of them (the step, the components sent,
    the runs)."""
    n = kept_components(rms, step)
    groups: list = []
    if n and coeffs.shape[1]:
        quantized = (_quantize_numpy if numpy else _quantize)(coeffs, n, step)
        tops = quantized.tops()
    at = 0
    for count in [n] if one_run and n else component_groups(rms, step, n):
        if not coeffs.shape[1]:
            groups.append([count, 2, out.add(b"", True), None, 0.0])
            continue
        top = int(tops[at : at + count].max())
        width = code_width(top)
        plane, esc = quantized.pack(at, count, width, top)
        delta = _centroid_offset(quantized.nonzero[at : at + count], quantized.offsets[at : at + count])
        groups.append([count, width, out.add(plane, True), out.add(esc, True) if esc else None, delta])
        at += count
    return {"step": step, "n": n, "groups": groups}


def _assemble_layer(
    layer, pos, meta, basis: Basis, steps: tuple[float, float], key_factor: float, level: int, numpy: bool
) -> bytes:
    """One layer's blob, its body's coefficients rounded at `steps[0]` and its tail's at `steps[1]`
    (`numpy`: by `_quantize_numpy`)."""
    out = Writer(level)
    lm = dict(meta)
    if pos is not None:
        lm["positions"] = {**meta["positions"], "seg": out.add(pos.astype("<i4").tobytes(), True)}
    for kind, p in zip("kv", layer, strict=True):
        factor = basis.step_factor(meta["layer"], kind, key_factor)
        rms = p.basis.rms / p.basis.scale
        km = _coded_groups(out, p.coeffs, rms, steps[0] * factor, numpy)
        if "tail" in meta:
            km["tail"] = _coded_groups(out, p.tail, rms, steps[1] * factor, numpy, one_run=True)
        lm[kind] = {**km, "raw": out.add(p.raw, False), "raw_dtype": p.raw_dtype}
    return out.blob({"basis": basis.digest, **lm}, blob_magic({p.raw_dtype for p in layer}, "tail" in meta))


def _assemble(
    prepared, metas, basis: Basis, steps: tuple[float, float], key_factor: float, level: int, numpy: bool
) -> list[bytes]:
    """Each layer's blob at `steps` (the body's, the tail's), on the layer threads."""

    def assemble(item: tuple[tuple[list, np.ndarray | None], dict]) -> bytes:
        (layer, pos), meta = item
        return _assemble_layer(layer, pos, meta, basis, steps, key_factor, level, numpy)

    return map_layers(assemble, list(zip(prepared, metas, strict=True)))


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
    and pack in NumPy or in MLX's graph (None: `numpy_by_default`); the codes are the same."""
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
