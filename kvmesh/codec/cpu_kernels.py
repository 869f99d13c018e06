"""The transform codec's elementwise loops where MLX computes on the CPU, compiled (numba) and run
without the GIL: rounding coefficients to codes, packing codes into bytes, and RoPE with the mean.

NumPy made each of these several passes over a tensor, each pass a call from Python: the rounding
alone twelve (divide, round, the extremes, the signs, two sums, the zigzag in three), the rotation
five. Between its calls a layer thread holds the GIL, and on two cores the other layer thread
waits for it: the coder's rounding and packing ran no faster on two threads than on one (81 against
67 ms for SmolLM2's 1,024-token cache, a throwaway split of the coder, 2026-12-07). Here each is one
pass in one call that lets the GIL go.

The numbers are NumPy's, bit for bit: each product, sum and quotient its own float32 operation, in
the same order (no fused multiply-add: numba contracts nothing unless told), as
`kvmesh.codec.rotary.rotate` and the graph's rounding (`kvmesh.codec.quantize._quantize`) make them;
only the sum of the rounding offsets is reassociated (a float32 sum, as MLX's and NumPy's are in
their own orders, that the coder rounds to four decimals). Compiled on first use (about 2 s, once)
and cached beside this file (numba's `cache=True`; in the user's cache directory where this one is not
writable): a process after the first imports numba (0.2 s) and loads them at its first call (0.14 s).
"""

import numpy as np
from numba import njit

# |q| from which a rounded coefficient does not fit 32 bits (the coder refuses it: the step is far too fine).
_LIMIT = np.float32(2.0**31)
# The one-byte code that escapes: its value is in the layer's escapes (kvmesh.codec.layer_blob).
ESCAPE = 255


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def quantized_rows(coeffs: np.ndarray, n: int, step: np.float32) -> tuple:
    """The first n rows of `coeffs` (F, rows >= 1) float32 rounded at `step` (q = rint(x / step)):
    (whether every q is finite and fits 32 bits; per row the smallest q, the largest, the count of
    nonzero ones and the sum over them of |x / step| - |q|, float64; the zigzagged codes (n, rows)
    uint32). A q that does not fit counts as 0 in the rest (the caller refuses the tensor)."""
    rows = coeffs.shape[1]
    lows, highs = np.empty(n), np.empty(n)
    count, offsets = np.empty(n), np.empty(n)
    codes = np.empty((n, rows), np.uint32)
    bad = 0
    for i in range(n):
        x, z = coeffs[i], codes[i]
        low, high, nonzero, offset = np.int64(2**32), np.int64(-(2**32)), 0, np.float32(0.0)
        for j in range(rows):
            s = x[j] / step
            q = np.rint(s)
            fits = abs(q) < _LIMIT  # (False for NaN)
            bad += not fits
            qi = np.int64(q) if fits else np.int64(0)
            low, high = min(low, qi), max(high, qi)
            sign = (qi > 0) - (qi < 0)
            nonzero += sign * sign
            offset += (s - q) * np.float32(sign)  # |s| - |q| where q is not 0 (s lies within half a step of q)
            z[j] = np.uint32(((qi << 1) ^ (qi >> 63)) & 0xFFFFFFFF)
        lows[i], highs[i], count[i], offsets[i] = low, high, nonzero, offset + np.float32(0.0)
    return bad == 0, lows, highs, count, offsets, codes


@njit(nogil=True, cache=True)
def dequantized_rows(zigzagged: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Zigzagged codes (n, rows) uint32 -> the float32 values q + offset * sign(q) the decoder makes of
    them, with each row's centroid `offsets` (n,) float32: q converted to float32, then the product
    and the sum each a float32 operation (the decoder's table holds the same floats)."""
    n, rows = zigzagged.shape
    out = np.empty((n, rows), np.float32)
    for i in range(n):
        offset, z, row = offsets[i], zigzagged[i], out[i]
        for j in range(rows):
            code = np.int64(z[j])
            q = np.float32((code >> 1) ^ -(code & 1))
            row[j] = q + offset * np.float32((q > 0) - (q < 0))
    return out


@njit(nogil=True, cache=True)
def packed_codes(zigzagged: np.ndarray, width: int) -> tuple:
    """Zigzagged codes (uint32, C order) -> (codes packed `8 // width` to a byte, the first in the
    lowest bits; escapes): `kvmesh.codec.layer_blob.pack_zigzag`'s bytes. One-byte codes of 255 and
    more are written as 255 (`ESCAPE`), their values kept in order as escapes; narrower ones must fit."""
    flat = zigzagged.reshape(-1)
    size = flat.size
    if width == 8:
        plane = np.empty(size, np.uint8)
        escaped = 0
        for k in range(size):
            escaped += flat[k] >= ESCAPE
            plane[k] = min(flat[k], ESCAPE)
        escapes = np.empty(escaped, np.uint32)
        at = 0
        for k in range(size if escaped else 0):
            if flat[k] >= ESCAPE:
                escapes[at] = flat[k]
                at += 1
        return plane, escapes
    per = 8 // width
    whole = size // per
    plane = np.empty(-(-size // per), np.uint8)
    if per == 4:  # (each case spelt out, so that the loop is one the compiler vectorises)
        for k in range(whole):
            plane[k] = flat[4 * k] | (flat[4 * k + 1] << 2) | (flat[4 * k + 2] << 4) | (flat[4 * k + 3] << 6)
    else:
        for k in range(whole):
            plane[k] = flat[2 * k] | (flat[2 * k + 1] << 4)
    if whole < plane.size:
        last = 0
        for j in range(size - whole * per):
            last |= flat[whole * per + j] << (width * j)
        plane[whole] = last
    return plane, np.empty(0, np.uint32)


@njit(nogil=True, cache=True, inline="always")
def _rotated(
    a: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray, dims: int, traditional: bool, inverse: bool
) -> None:
    """`rotate` of one row `a` (head_dim) into `out`: a * C + swapped(a) * S (inverse: minus), each
    product and the sum a float32 operation; dims beyond `dims` copied. (Loops over contiguous rows,
    written so that the compiler vectorises them.)"""
    half = dims // 2
    if traditional:
        for k in range(half):
            x0, x1 = a[2 * k], a[2 * k + 1]
            p0, s0 = x0 * cos[2 * k], x1 * sin[2 * k]
            p1, s1 = x1 * cos[2 * k + 1], x0 * sin[2 * k + 1]
            out[2 * k] = p0 - s0 if inverse else p0 + s0
            out[2 * k + 1] = p1 - s1 if inverse else p1 + s1
    else:
        for i in range(half):
            p0, s0 = a[i] * cos[i], a[i + half] * sin[i]
            p1, s1 = a[i + half] * cos[i + half], a[i] * sin[i + half]
            out[i] = p0 - s0 if inverse else p0 + s0
            out[i + half] = p1 - s1 if inverse else p1 + s1
    for i in range(dims, a.size):
        out[i] = a[i]


@njit(nogil=True, cache=True)
def rotated_rows(
    full: np.ndarray,
    start: int,
    block: np.ndarray,
    mean: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    dims: int,
    traditional: bool,
    inverse: bool,
) -> None:
    """Keys between rows [start, start + T') of a layer's `full` (B, H, T, D) and a token-major
    `block` (B, T', H, D), by the rotation tables (B or 1, T', H or 1, dims). The decoder's way
    (`inverse` False): `block` plus `mean` (H, D), rotated, written to `full`, as NumPy's `block +
    mean` and `rotate` make them. The coder's (`inverse`): `full`'s rows with the rotation taken off,
    less `mean`, written to `block`, as `rotate(..., inverse=True)` and NumPy's `- mean` make them."""
    b_all, t_all, h_all, d = block.shape
    a = np.empty(d, np.float32)
    for b in range(b_all):
        cb = b if cos.shape[0] > 1 else 0
        for t in range(t_all):
            for h in range(h_all):
                ch = h if cos.shape[2] > 1 else 0
                row, centre, layer_row = block[b, t, h], mean[h], full[b, h, start + t]
                if inverse:
                    _rotated(layer_row, cos[cb, t, ch], sin[cb, t, ch], a, dims, traditional, True)
                    for i in range(d):
                        row[i] = a[i] - centre[i]
                else:
                    for i in range(d):
                        a[i] = row[i] + centre[i]
                    _rotated(a, cos[cb, t, ch], sin[cb, t, ch], layer_row, dims, traditional, False)
