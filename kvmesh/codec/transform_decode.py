"""The transform codec's decoder (`kvmesh.codec.transform` makes the blobs): one MLX graph per layer.

A layer's blob becomes its keys and values in a handful of large MLX operations over all its heads
at once: the packed codes looked up in a table per byte (the centroid offset folded in), the
inverse transform as one product with the basis's components and the mean added, RoPE re-applied
with the model's own kernel (`mx.fast.rope`), and the raw sink and recent rows placed around the
coded ones. Only what must run on the CPU stays in Python and NumPy: zstd, the header, and finding
the rare escaped codes. So a Mac runs the decoder on its GPU, and on a CPU the whole layer is one
evaluation with no NumPy copy of its numbers.

The floats are the same as the NumPy decoder's that came before it (the same products, the same
conversions; `tests/test_transform_codec.py` checks them against it), except the keys' rotation:
the kernel computes it in one step where NumPy multiplied and added table entries, which may differ
by a rounding of float32 (about 1e-7 relative, far below float16's 5e-4 and the codec's own error).
"""

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import zstandard

from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.layer_blob import ESCAPE, Segments, TransformCodecError, read_header
from kvmesh.codec.rotary import apply_rope

# The dtypes raw rows travel in (a header without one: float16).
RAW_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _code_table(width: int) -> np.ndarray:
    """(256, 8 // width) float32: the signed values each packed byte holds."""
    per = 8 // width
    zz = (np.arange(256)[:, None] >> (np.arange(per) * width)) & ((1 << width) - 1)
    return ((zz >> 1) ^ -(zz & 1)).astype(np.float32)


TABLES = {width: _code_table(width) for width in (2, 4, 8)}


def decode_group(width: int, plane: bytes, escapes: bytes, count: int, offset: float) -> mx.array:
    """Packed codes -> (count,) float32 values q + offset * sign(q): one table look-up per byte (the
    table has the offset folded in); escaped one-byte codes are scattered in after."""
    per = 8 // width
    packed = np.frombuffer(plane, dtype=np.uint8)
    if packed.size != -(-count // per):
        raise TransformCodecError(f"{packed.size} packed bytes for {count} codes of {width} bits")
    table = TABLES[width]
    if offset:
        table = table + np.float32(offset) * np.sign(table)
    values = mx.take(mx.array(table), mx.array(packed), axis=0).reshape(-1)
    if per != 1:
        return values[:count] if count % per else values
    esc = np.frombuffer(escapes, dtype="<u4").astype(np.int64)
    at = np.flatnonzero(packed == ESCAPE)
    if esc.size != at.size:
        raise TransformCodecError("escape count does not match the plane")
    if at.size:
        big = ((esc >> 1) ^ -(esc & 1)).astype(np.float32)
        values[mx.array(at.astype(np.int32))] = mx.array(big + np.float32(offset) * np.sign(big))
    return values


def check_header(header: dict, expect: dict[str, Any]) -> None:
    """The blob's header says what the manifest said: its shape, basis layer, raw rows, steps and
    component counts (`expect`, the same keys as the header's), positions from 0 when `start` is
    expected (a layer that kept every one; `kvmesh.codec.coded.check_kept_positions` checks the others).
    A sender's blob may not decode to anything else, nor allocate beyond that."""
    got = {
        "shape": header.get("shape"),
        "layer": header.get("layer"),
        "sinks": header.get("sinks"),
        "recent": header.get("recent"),
        "start": header.get("positions", {}).get("start"),
        "key_step": header.get("k", {}).get("step"),
        "value_step": header.get("v", {}).get("step"),
        "key_components": header.get("k", {}).get("n"),
        "value_components": header.get("v", {}).get("n"),
    }
    wrong = [f"{k} {got[k]!r} (the manifest says {v!r})" for k, v in expect.items() if got[k] != v]
    if wrong:
        raise TransformCodecError("the layer's blob disagrees with its manifest: " + "; ".join(wrong))


def decode_layer(
    data: bytes | memoryview, basis: Basis, *, expect: dict[str, Any] | None = None
) -> tuple[mx.array, mx.array]:
    """One layer's (keys, values) in its raw rows' dtype (B, kv_heads, tokens, head_dim), keys rotated back.
    With `expect` (what the manifest says: `check_header`), a blob that says otherwise is refused
    before anything is allocated.

    Raises TransformCodecError for bytes that do not decode, or decode to numbers that are not
    finite (their digest was checked before: this guards against a sender's bug or a lie, not the
    link), BasisError for a blob of another basis."""
    header, body = read_header(data)
    if expect is not None:
        check_header(header, expect)
    try:
        keys, values = _decode_layer(header, body, basis)
    except (KeyError, IndexError, TypeError, ValueError, zstandard.ZstdError) as e:
        if isinstance(e, (TransformCodecError, BasisError)):
            raise
        raise TransformCodecError(f"a malformed layer blob: {type(e).__name__}: {e}") from None
    if not finite(keys, values):
        raise TransformCodecError("the layer decodes to NaN or infinite numbers")
    return keys, values


def finite(*arrays: mx.array) -> bool:
    """Every number of `arrays` is finite (evaluating them, in one evaluation): so that a cache of
    NaNs (a lying sender's steps or raw rows, a basis that passed its checks) is never kept."""
    checks = [mx.isfinite(a).all() for a in arrays]
    mx.eval(*arrays, *checks)
    return all(bool(c) for c in checks)


def _raw_array(data: bytes, dtype: str, shape: tuple[int, ...]) -> mx.array:
    """Raw rows from their bytes, in their own dtype."""
    if dtype not in RAW_DTYPES:
        raise TransformCodecError(f"raw rows of an unknown dtype {dtype!r}")
    bits = np.frombuffer(data, dtype={"float16": "<f2", "bfloat16": "<u2", "float32": "<f4"}[dtype]).reshape(shape)
    return mx.array(bits).view(mx.bfloat16) if dtype == "bfloat16" else mx.array(bits)


def _coefficients(km: dict, seg: Segments, rows: int) -> mx.array:
    """(n, rows) float32: a tensor's coefficients in units of its step, component-major."""
    n, parts, at = km["n"], [], 0
    for count, width, plane_ref, esc_ref, delta in km["groups"]:
        if width not in TABLES or not 0 < count <= n - at:
            raise TransformCodecError(f"a group of {count} components of {width} bits")
        values = count * rows
        esc = seg(esc_ref, 4 * values) if esc_ref is not None else b""
        plane = seg(plane_ref, -(-values // (8 // width)))
        parts.append(decode_group(width, plane, esc, values, delta))
        at += count
    if at != n:
        raise TransformCodecError(f"groups of {at} components where {n} were sent")
    return mx.concatenate(parts).reshape(n, rows) if len(parts) > 1 else parts[0].reshape(n, rows)


def _decode_layer(header: dict, body: memoryview, basis: Basis) -> tuple[mx.array, mx.array]:
    if header["basis"] != basis.digest:
        raise BasisError(
            f"the cache was coded with basis {header['basis'][:16]}..., this basis is {basis.digest[:16]}..."
        )
    j = header["layer"]
    if not 0 <= j < len(basis):
        raise BasisError(f"basis layer {j} of a basis of {len(basis)}")
    seg = Segments(header, body)
    b, h, t, d = header["shape"]
    if h * d != basis.keys[j].features:
        raise BasisError(f"{h} heads of {d} for a basis layer of {basis.keys[j].features} features")
    s, r = header["sinks"], header["recent"]
    m = t - s - r
    pm = header["positions"]
    if "seg" in pm:
        pos = np.frombuffer(seg(pm["seg"], 4 * b * h * t), dtype="<i4").reshape(b, h, t)
    else:
        pos = np.broadcast_to(np.arange(pm["start"], pm["start"] + t, dtype=np.int32)[None, None], (b, h, t))
    tensors = []
    for kind, tb in (("k", basis.keys[j]), ("v", basis.values[j])):
        km = header[kind]
        n = km["n"]
        raw_dtype = km.get("raw_dtype", "float16")
        raw = _raw_array(seg(km["raw"], 4 * b * h * (s + r) * d), raw_dtype, (b, h, s + r, d))
        parts = [raw[:, :, :s]]
        if m:
            if n:
                # (The same float32 scaling of the components as the encoder's references.)
                synthesis = tb.on_mlx("synthesis")[:n] * mx.array(np.float32(km["step"] * tb.scale))
                rows = _coefficients(km, seg, b * m).T @ synthesis + tb.on_mlx("mean")
            else:
                rows = mx.broadcast_to(tb.on_mlx("mean"), (b * m, h * d))
            block = rows.reshape(b, m, h, d).transpose(0, 2, 1, 3)
            if kind == "k":
                block = apply_rope(block, pos[:, :, s : t - r], basis.rotaries[j])
            parts.append(block.astype(raw.dtype))
        parts.append(raw[:, :, s:])
        tensors.append(mx.concatenate(parts, axis=2))
    return tensors[0], tensors[1]


def decode_layers(blobs: Sequence[bytes], basis: Basis) -> list[tuple[mx.array, mx.array]]:
    """Per layer, (keys, values) in its raw rows' dtype (B, kv_heads, tokens, head_dim), keys rotated back."""
    return [decode_layer(blob, basis) for blob in blobs]
