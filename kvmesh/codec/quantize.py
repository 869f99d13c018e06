"""Rounding a transform-coded tensor's coefficients at a step, and packing the codes into bytes: the
quantizer of the transform codec (kvmesh.codec.transform lays the layers out and writes their blobs;
kvmesh.codec.transform_decode reads them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kvmesh.codec.cpu_kernels import dequantized_rows, quantized_rows
from kvmesh.codec.layer_blob import ESCAPE, TransformCodecError, Writer, pack_zigzag

SQRT12 = math.sqrt(12.0)
NOT_FINITE = "the cache holds NaN or infinite numbers"
TOO_FINE = "a coefficient beyond 32 bits: the step is far too fine"


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
        raise TransformCodecError(NOT_FINITE)
    if bounds[1] >= 2**31 or bounds[0] < -(2**31):
        raise TransformCodecError(TOO_FINE)
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


def _quantize(coeffs: mx.array | np.ndarray, n: int, step: float) -> _Quantized:
    """The first n components rounded at `step`, in MLX's graph (what a GPU runs)."""
    sent = coeffs[:n] if isinstance(coeffs, mx.array) else mx.array(coeffs[:n])  # (NumPy's where a CPU projected)
    scaled = sent / mx.array(np.float32(step))
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


def _quantize_numpy(coeffs: mx.array | np.ndarray, n: int, step: float) -> _Quantized:
    """`_quantize` where MLX computes on the CPU: the same codes, in one compiled pass over the
    coefficients' own buffer that lets the GIL go (`kvmesh.codec.cpu_kernels.quantized_rows`)."""
    values = np.ascontiguousarray(np.array(coeffs, copy=False)[:n])
    fits, lows, highs, count, offsets, zigzagged = quantized_rows(values, n, np.float32(step))
    if not fits:
        raise TransformCodecError(NOT_FINITE if not np.isfinite(values).all() else TOO_FINE)
    return _Quantized(lows, highs, count, offsets, zigzagged)


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


def coded_groups(
    out: Writer, coeffs: mx.array | np.ndarray, rms: np.ndarray, step: float, numpy: bool, *, one_run: bool = False
) -> dict:
    """One region's coefficients rounded at `step`, packed and added to `out` by runs of components
    (`one_run`: all in one, for a region of few rows, whose runs would each cost the decoder a call
    more than their closer fit saves): what the header says of them (the step, the components sent,
    the runs)."""
    return coded_region(out, coeffs, rms, step, numpy, one_run=one_run)[0]


def coded_region(
    out: Writer, coeffs: mx.array | np.ndarray, rms: np.ndarray, step: float, numpy: bool, *, one_run: bool = False
) -> tuple[dict, _Quantized | None]:
    """`coded_groups`, and the codes it rounded to (None where nothing was sent)."""
    n = kept_components(rms, step)
    groups: list = []
    quantized = None
    if n and coeffs.shape[1]:
        quantized = (_quantize_numpy if numpy else _quantize)(coeffs, n, step)
        tops = quantized.tops()
    at = 0
    for count in [n] if one_run and n else component_groups(rms, step, n):
        if quantized is None:
            groups.append([count, 2, out.add(b"", True), None, 0.0])
            continue
        top = int(tops[at : at + count].max())
        width = code_width(top)
        plane, esc = quantized.pack(at, count, width, top)
        delta = _centroid_offset(quantized.nonzero[at : at + count], quantized.offsets[at : at + count])
        groups.append([count, width, out.add(plane, True), out.add(esc, True) if esc else None, delta])
        at += count
    return {"step": step, "n": n, "groups": groups}, quantized


def dequantized(quantized: _Quantized | None, entry: dict) -> np.ndarray | None:
    """The (n, rows) float32 values, in units of the step, that the decoder makes of a region's codes
    (`entry`: what `coded_groups` said of them): q + offset * sign(q), the same float32 operations
    as `kvmesh.codec.transform_decode`'s, in one compiled pass (a predicted layer's coder runs this
    on the chain of layers, one after another). None where nothing was sent."""
    if quantized is None:
        return None
    offsets = np.concatenate([np.full(count, delta, np.float32) for count, _, _, _, delta in entry["groups"]])
    return dequantized_rows(np.ascontiguousarray(quantized.zigzagged, dtype=np.uint32), offsets)
