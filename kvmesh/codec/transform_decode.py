"""The transform codec's decoder (`kvmesh.codec.transform` makes the blobs): one MLX graph per layer.

A layer's blob becomes its keys and values in a handful of large MLX operations over all its heads
at once: the packed codes unpacked by shifts and masks and un-zigzagged (the centroid offset added), the
inverse transform as one product with the basis's components and the mean added, RoPE re-applied
with cos/sin tables read off the model's own kernel (`kvmesh.codec.rotary.rotate`: made once per
set of positions, so the kernel's sines and cosines are not recomputed per layer, which on a CPU
costs more than the rotation), and the raw sink and recent rows placed around the coded ones (a
tail's rows, at their own steps and components, are a product of their own written after the body's
into one block: the mean, the rotation and the placing run once per tensor). Only
what must run on the CPU stays in Python and NumPy: zstd, the header, and finding the rare escaped
codes. So a Mac runs the decoder on its GPU. Where MLX computes on the CPU, the layer is NumPy's
from end to end: the codes become numbers by table look-ups (one pass, where the graph makes
several, each on one core), the inverse transform is NumPy's product (MLX's Linux wheels link the
reference BLAS), and the mean, the rotation (a compiled loop that lets the GIL go:
`kvmesh.codec.cpu_kernels.rotated_rows`) and the placing are written into one NumPy array per
tensor, which MLX copies (`_numpy_tensor`): a layer thread never waits for MLX's stream thread but
to cast the rows to a narrower dtype (on a 2-core CPU a 1,024-token SmolLM2 cache decoded in 113-118
ms on one thread against 115-124 with the graph, 78-83 on two against 80-87: three alternated pairs
of processes, with the layer's arrays made by MLX then).

The floats are those of the NumPy decoder that came before it, on any device: the same products,
each product and sum of the rotation its own float32 operation, the same conversions
(`tests/unit/codec/test_transform_decoder.py` checks them against it, with its product made by the
same library as the path it checks).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import zstandard

from kvmesh.codec.basis import Basis, BasisError, TensorBasis
from kvmesh.codec.cpu_kernels import rotated_rows
from kvmesh.codec.layer_blob import (
    ESCAPE,
    WIDTHS,
    Segments,
    TransformCodecError,
    check_tail,
    coded_regions,
    coding_fields,
    read_header,
)
from kvmesh.codec.layer_pool import map_layers, numpy_by_default
from kvmesh.codec.prediction import Coefficients, LayerChain, chained, rowwise_product, unpredicted
from kvmesh.codec.rotary import Rotary, rotate, token_major_numpy_tables, token_major_tables

# The dtypes raw rows travel in (a header without one: float16).
RAW_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# Float32 magnitudes from which a cast to each dtype gives infinity (its largest finite number plus
# half an ulp): coded rows are checked in float32, where a reduction is cheap, before they are cast.
ROUNDS_TO_INFINITY = {
    mx.float16: 65520.0,
    mx.bfloat16: float(2.0**127 * (2 - 2.0**-8)),
    mx.float32: float("inf"),
}


# What a malformed blob raises as it is read (a header's wrong types, a segment that does not inflate).
MALFORMED = (KeyError, IndexError, TypeError, ValueError, zstandard.ZstdError)


def decode_group(width: int, plane: bytes, escapes: bytes, count: int, offset: float) -> mx.array:
    """Packed codes -> (count,) float32 values q + offset * sign(q)."""
    values = _values(_codes(width, plane, count), mx.array(np.float32(offset)))
    if width == 8:
        at, big = _escapes(plane, escapes, offset)
        if at.size:
            values[mx.array(at)] = mx.array(big)
    return values


def _codes(width: int, plane: bytes, count: int) -> mx.array:
    """(count,) uint8: the zigzagged codes packed `8 // width` to a byte, unpacked by shifts and masks
    (elementwise: on a CPU several times faster than MLX's table look-up, a gather)."""
    per = 8 // width if width in WIDTHS else 0
    packed = np.frombuffer(plane, dtype=np.uint8)
    if not per or packed.size != -(-count // per):
        raise TransformCodecError(f"{packed.size} packed bytes for {count} codes of {width} bits")
    codes = mx.array(packed)
    if per == 1:
        return codes
    shifts = mx.array(np.arange(per, dtype=np.uint8) * np.uint8(width))
    return ((codes[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)[:count]


def _values(codes: mx.array, offsets: mx.array | None) -> mx.array:
    """Zigzagged codes (uint8) -> float32 q + offset * sign(q) (offsets broadcast against the codes;
    None: 0). Un-zigzagged in bytes (a code of at most 255 is a q of -128..127), then cast once."""
    q = ((codes >> _ONE) ^ (_ZERO - (codes & _ONE))).view(mx.int8).astype(mx.float32)
    return q if offsets is None else q + offsets * mx.sign(q)


_ONE, _ZERO = mx.array(np.uint8(1)), mx.array(np.uint8(0))


def _escapes(plane: bytes, escapes: bytes, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Where a plane of one-byte codes escapes (255) and the float32 values those codes stand for."""
    # Most planes escape nothing: for those a byte search, not a pass of NumPy's (2-5% of decoding).
    if not escapes and ESCAPE not in plane:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    esc = np.frombuffer(escapes, dtype="<u4").astype(np.int64)
    at = np.flatnonzero(np.frombuffer(plane, dtype=np.uint8) == ESCAPE)
    if at.size != esc.size:
        raise TransformCodecError("escape count does not match the plane")
    big = ((esc >> 1) ^ -(esc & 1)).astype(np.float32)
    return at, big + np.float32(offset) * np.sign(big)


def check_header(header: dict, expect: dict[str, Any]) -> None:
    """The blob's header says what the manifest said: its shape, basis layer, raw rows, steps and
    component counts, its tail's rows, steps and components (`expect`, the same keys as the
    header's), positions from 0 when `start` is expected (a layer that kept every one;
    `kvmesh.codec.coded.check_kept_positions` checks the others).
    A sender's blob may not decode to anything else, nor allocate beyond that."""
    got = {
        "shape": header.get("shape"),
        "layer": header.get("layer"),
        "start": header.get("positions", {}).get("start"),
        **coding_fields(header),
    }
    wrong = [f"{k} {got[k]!r} (the manifest says {v!r})" for k, v in expect.items() if got[k] != v]
    if wrong:
        raise TransformCodecError("the layer's blob disagrees with its manifest: " + "; ".join(wrong))


def decode_layer(
    data: bytes | memoryview,
    basis: Basis,
    memo: dict | None = None,
    *,
    expect: dict[str, Any] | None = None,
    numpy: bool | None = None,
    chain: LayerChain | None = None,
) -> tuple[mx.array, mx.array]:
    """One layer's (keys, values) in its raw rows' dtype (B, kv_heads, tokens, head_dim), keys rotated back.
    With `expect` (what the manifest says: `check_header`), a blob that says otherwise is refused
    before anything is allocated. `memo` keeps rotation tables for the next layers (one per set of
    positions). `numpy`: codes to numbers by NumPy look-ups and the products in NumPy, or all in
    MLX's graph (None: `numpy_by_default`); the floats differ only as two BLAS's products round.
    `chain`: the cache's layers decoded so far, for a layer predicted from the one before
    (kvmesh.codec.prediction); this layer's coefficients are added to it for the next.

    Raises TransformCodecError for bytes that do not decode, or decode to numbers that are not
    finite (their digest was checked before: this guards against a sender's bug or a lie, not the
    link), BasisError for a blob of another basis."""
    header, body = read_header(data)
    layer = header.get("layer")
    if chain is not None and type(layer) is int:
        chain.expect(layer)
    try:
        if expect is not None:
            check_header(header, expect)
        use_numpy = numpy_by_default() if numpy is None else numpy
        keys, values, checks = _decode_layer(header, body, basis, {} if memo is None else memo, use_numpy, chain)
    except BaseException as e:
        if chain is not None and type(layer) is int:
            chain.fail(layer, e)  # (whatever it was: the layers predicted from this one wait for nothing)
        if isinstance(e, (TransformCodecError, BasisError)) or not isinstance(e, MALFORMED):
            raise
        raise TransformCodecError(f"a malformed layer blob: {type(e).__name__}: {e}") from None
    mx.eval(keys, values, *(c for c in checks if isinstance(c, mx.array)))
    if not all(bool(c) for c in checks):
        raise TransformCodecError("the layer decodes to NaN or infinite numbers")
    return keys, values


def _raw_array(data: bytes, dtype: str, shape: tuple[int, ...], numpy: bool) -> mx.array | np.ndarray:
    """Raw rows from their bytes: in their own dtype, or (`numpy`) as NumPy float32, exactly."""
    if dtype not in RAW_DTYPES:
        raise TransformCodecError(f"raw rows of an unknown dtype {dtype!r}")
    bits = np.frombuffer(data, dtype={"float16": "<f2", "bfloat16": "<u2", "float32": "<f4"}[dtype]).reshape(shape)
    if numpy:
        return (bits.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else bits.astype(np.float32)
    return mx.array(bits).view(mx.bfloat16) if dtype == "bfloat16" else mx.array(bits)


def _code_table(width: int) -> np.ndarray:
    """(256, 8 // width) float32: the signed values q that the codes packed in each byte stand for."""
    per = 8 // width
    zz = (np.arange(256)[:, None] >> (np.arange(per) * width)) & ((1 << width) - 1)
    return ((zz >> 1) ^ -(zz & 1)).astype(np.float32)


_TABLES = {width: _code_table(width) for width in WIDTHS}
_SIGNS = {width: np.sign(table) for width, table in _TABLES.items()}
# The largest |q| a code of each width stands for (255 escapes one-byte codes: their values are
# the escapes', which are counted apart).
_LARGEST = {2: 2, 4: 8, 8: 127}


@dataclass
class _Coefficients:
    """A tensor's coefficients in units of its step, (n, rows) float32 component-major (a NumPy
    array where the product is NumPy's, which is all that reads them), and per component the
    largest magnitude they may have (from the codes' widths and the escapes)."""

    values: mx.array | np.ndarray
    largest: np.ndarray


def _coefficients(km: dict, seg: Segments, rows: int, *, tables: bool) -> _Coefficients:
    """A tensor's coefficients (by `_unpack_tables` or `_unpack`: the same floats), and the bounds on
    them that its codes' widths and escapes give."""
    n, at = km["n"], 0
    planes = []
    for count, width, plane_ref, esc_ref, delta in km["groups"]:
        if width not in WIDTHS or not 0 < count <= n - at:
            raise TransformCodecError(f"a group of {count} components of {width} bits")
        values = count * rows
        plane = seg(plane_ref, -(-values // (8 // width)))
        where, big = (
            _escapes(plane, seg(esc_ref, 4 * values) if esc_ref is not None else b"", delta)
            if width == 8
            else (np.zeros(0, np.int64), np.zeros(0, np.float32))
        )
        planes.append((at, count, width, plane, delta, where, big))
        at += count
    if at != n:
        raise TransformCodecError(f"groups of {at} components where {n} were sent")
    largest = np.zeros(n)
    for at, count, width, _, delta, _, big in planes:
        beyond = float(np.abs(big).max()) if big.size else 0.0
        largest[at : at + count] = max(_LARGEST[width], beyond) + abs(delta)
    escaped = [(where + at * rows, big) for at, _, _, _, _, where, big in planes if where.size]
    if tables:
        values = _unpack_tables(planes, n, rows)
        for where, big in escaped:
            values.reshape(-1)[where] = big
        return _Coefficients(values, largest)
    out = _unpack(planes, n, rows)
    if escaped:
        flat = out.reshape(-1)
        flat[mx.array(np.concatenate([w for w, _ in escaped]).astype(np.int32))] = mx.array(
            np.concatenate([v for _, v in escaped])
        )
        out = flat.reshape(n, rows)
    return _Coefficients(out, largest)


def _unpack_tables(planes: list, n: int, rows: int) -> np.ndarray:
    """Each byte of codes looked up in a table of the values q + offset * sign(q) it holds, written
    straight into the array NumPy's product reads: one pass, where the graph makes several."""
    out = np.empty((n, rows), np.float32)
    for at, count, width, plane, delta, _, _ in planes:
        table = _TABLES[width] + np.float32(delta) * _SIGNS[width]
        packed = np.frombuffer(plane, dtype=np.uint8)
        into = out[at : at + count].reshape(-1)
        per = 8 // width
        whole = into.size // per  # bytes whose codes all belong to the group (the last may hold fewer)
        # mode="clip": a byte indexes all 256 rows, and NumPy's default ("raise") writes `out` through
        # a copy of it, twice over the layer's coefficients
        np.take(table, packed[:whole], axis=0, out=into[: whole * per].reshape(-1, per), mode="clip")
        if whole < packed.size:
            into[whole * per :] = table[packed[whole]][: into.size - whole * per]
    return out


def _unpack(planes: list, n: int, rows: int) -> mx.array:
    """The groups' codes joined as bytes, then turned into numbers in one pass."""
    codes = [_codes(width, plane, count * rows) for _, count, width, plane, _, _, _ in planes]
    joined = (mx.concatenate(codes) if len(codes) > 1 else codes[0]).reshape(n, rows)
    scales = np.concatenate([np.full(count, delta, np.float32) for _, count, _, _, delta, _, _ in planes])
    return _values(joined, mx.array(scales[:, None]) if scales.any() else None)


def _synthesised_into(out: np.ndarray, coefficients: np.ndarray, tb: TensorBasis, n: int, scale: float) -> None:
    """NumPy's product of a region's coefficients (n, B * rows) with the first n components times
    `scale`, written into `out` (B, rows, F): where MLX computes on the CPU. The mlx[cpu] wheels for
    Linux link the reference BLAS: a 1,024-token layer of 8B geometry took 0.70 s to decode with
    MLX's product, 0.04 s with NumPy's (OpenBLAS) on this 2-core box; MLX on a Mac's CPU has
    Accelerate, but there the GPU decodes."""
    rowwise_product(coefficients.T.reshape(*out.shape[:2], n), tb.synthesis()[:n] * np.float32(scale), out=out)


def _synthesised(coefficients: mx.array | np.ndarray, tb: TensorBasis, n: int, scale: float) -> mx.array:
    """The same product in MLX's graph (what a GPU runs): (B * rows, F)."""
    assert isinstance(coefficients, mx.array)
    return coefficients.T @ (tb.on_mlx("synthesis")[:n] * mx.array(np.float32(scale)))


def _magnitude_bound(largest: np.ndarray, tb: TensorBasis, scale: float, rotated: bool) -> float:
    """An upper bound on the magnitude of any decoded row's number, from the codes' widths alone:
    max |mean| + the sum over components of the largest |coefficient| times the component's largest
    |weight| (times sqrt(2) when RoPE mixes pairs), with a margin for float32 rounding. NaN when a
    step or offset is not a number."""
    weights = tb.largest_weights()[: largest.size]
    bound = tb.largest_mean + abs(scale) * float(largest @ weights)
    return bound * (math.sqrt(2.0) if rotated else 1.0) * 1.001


def _decode_layer(
    header: dict, body: memoryview, basis: Basis, memo: dict, numpy: bool, chain: LayerChain | None
) -> tuple[mx.array, mx.array, list]:
    """Keys, values, and the checks (scalars) that they are finite: the raw rows are, and the coded
    rows' float32 magnitudes stay below what their dtype rounds to infinity (NaN fails both), which
    is read off the rows only when the codes' widths do not bound them below it already.

    A layer predicted from the one before unpacks its codes first, then waits for that layer's
    coefficients (`chain`), and hands its own to the next layer before its products: so the
    layers' products still run side by side."""
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
    s, r, tail = header["sinks"], header["recent"], header.get("tail", 0)
    check_tail(header, t - s - r)
    predicted = header.get("predicted", False)
    if predicted is not False and (predicted is not True or tail or chain is None):
        raise TransformCodecError(
            "a layer predicted from the one before needs that layer decoded first, and no tail"
            if predicted is True
            else f"a layer whose `predicted` is {predicted!r:.20}"
        )
    pm = header["positions"]
    if "seg" in pm:
        pos = np.frombuffer(seg(pm["seg"], 4 * b * h * t), dtype="<i4").reshape(b, h, t)
    else:
        pos = np.broadcast_to(np.arange(pm["start"], pm["start"] + t, dtype=np.int32)[None, None], (b, h, t))
    tensors = [_unpacked(header[kind], seg, (b, h, t, d), (s, r, tail), numpy) for kind in "kv"]
    # Each tensor's coefficients of every component, where the next layer may predict from them
    # or this one is predicted (no tail: the body is all its coded rows).
    coefficients: list[Coefficients] = []
    if predicted:
        assert chain is not None
        if any(tb.predictor is None for tb in basis.pair(j)):
            raise BasisError(f"basis layer {j} is predicted from the one before, and the basis has no predictor for it")
        before = list(chain.previous(j))
        for tensor, tb in zip(tensors, basis.pair(j), strict=True):
            tensor.given = _predicted(tensor, tb, [*before, *coefficients], numpy)
            coefficients.append(tensor.given)
    elif chain is not None and not tail and j + 1 < len(basis) and _at_predicted_step(header, basis):
        coefficients = [tensor.sent(tb.features, numpy) for tensor, tb in zip(tensors, basis.pair(j), strict=True)]
        if not numpy:
            mx.eval(*coefficients)  # (here: an MLX graph is evaluated on the thread that made it)
    if chain is not None:
        if coefficients:
            chain.publish(j, (coefficients[0], coefficients[1]))
        else:
            chain.fail(j, TransformCodecError("it was not coded to be predicted from"))
    out: list[mx.array] = []
    checks: list[mx.array | bool] = []
    for tensor, tb, kind in zip(tensors, basis.pair(j), "kv", strict=True):
        rotated = kind == "k" and bool(tensor.regions)
        if numpy:
            tables = token_major_numpy_tables(basis.rotaries[j], pos[:, :, s : t - r], memo) if rotated else None
            x, finite = _numpy_tensor(tensor, tb, (b, h, t, d), (s, r), tables, basis.rotaries[j])
            checks.append(finite)
        else:
            graph_tables = token_major_tables(basis.rotaries[j], pos[:, :, s : t - r], memo) if rotated else None
            x, more = _graph_tensor(tensor, tb, (b, h, t, d), s, graph_tables, basis.rotaries[j])
            checks += more
        out.append(x)
    return out[0], out[1], checks


def _numpy_tensor(
    tensor: "_Tensor",
    tb: TensorBasis,
    shape: tuple[int, int, int, int],
    kept: tuple[int, int],
    rotation: tuple[np.ndarray, np.ndarray] | None,
    rotary: Rotary,
) -> tuple[mx.array, bool]:
    """A tensor (B, H, T, D) made in NumPy: its raw rows and its coded ones (the mean added, rotated
    back) written into one float32 array, which becomes an MLX array (a copy made on this thread, a
    tenth of a millisecond for SmolLM2's 1,024 tokens), cast by MLX to the raw rows' dtype; and whether
    its numbers are finite. No MLX operation runs but that cast: an array MLX made for NumPy to write
    would be made on MLX's stream thread, which a layer thread waited 0.6-1.9 ms a layer to run on a
    busy 2-core box (0.04 ms on an idle one)."""
    b, h, t, d = shape
    s, r = kept
    raw = tensor.raw
    assert isinstance(raw, np.ndarray)
    full = np.empty(shape, np.float32)
    full[:, :, :s], full[:, :, t - r :] = raw[:, :, :s], raw[:, :, s:]
    finite = bool(np.isfinite(raw).all())
    if tensor.regions:
        block = _coded_rows(tensor, tb, (b, h, d), rotation, rotary, into=(full, s))
        limit = ROUNDS_TO_INFINITY[tensor.dtype]
        if not all(bound < limit for bound in block.bounds):
            finite = finite and bool(np.abs(block.rows).max() < limit)
    x = mx.array(full)
    return (x if tensor.dtype == mx.float32 else x.astype(tensor.dtype)), finite


def _graph_tensor(
    tensor: "_Tensor",
    tb: TensorBasis,
    shape: tuple[int, int, int, int],
    sinks: int,
    rotation: tuple[mx.array, mx.array] | None,
    rotary: Rotary,
) -> tuple[mx.array, list[mx.array]]:
    """The same tensor as an MLX graph (what a GPU runs), and the checks (scalars) that it is finite."""
    b, h, _, d = shape
    raw = tensor.raw
    assert isinstance(raw, mx.array)
    parts = [raw[:, :, :sinks]]
    checks = [mx.isfinite(raw).all()]
    if tensor.regions:
        block = _coded_rows(tensor, tb, (b, h, d), rotation, rotary)
        assert isinstance(block.rows, mx.array)
        # (each bound compared: NaN, from a step or offset that is not a number, fails its own)
        if not all(bound < ROUNDS_TO_INFINITY[raw.dtype] for bound in block.bounds):
            checks.append(mx.abs(block.rows).max() < ROUNDS_TO_INFINITY[raw.dtype])
        rows = block.rows.transpose(0, 2, 1, 3)
        parts.append(rows if raw.dtype == mx.float32 else rows.astype(raw.dtype))
    parts.append(raw[:, :, sinks:])
    return mx.concatenate(parts, axis=2), checks


def _at_predicted_step(header: dict, basis: Basis) -> bool:
    """Whether a layer was coded at the step the basis's predictors were fitted at (so the next
    layer may be predicted from it: `kvmesh.codec.transform.predicted_layers`), as its values' step
    says (the global step times the layer's factor)."""
    step = basis.predicted_step
    return step is not None and header["v"]["step"] == step * basis.step_factor(header["layer"], "v", 1.0)


@dataclass
class _Tensor:
    """One tensor of a layer, its codes unpacked: its raw rows (B, H, sinks + recent, D) (NumPy float32
    where the decoder runs in NumPy), the dtype they came in, and its coded
    regions (the body, then the tail, each where it has rows: `check_tail`), each as (rows, the
    header's entry, its coefficients in units of its step, None where none were sent). `given`: its
    body's coefficients of every component in units of the tensor's scale, where it is predicted."""

    raw: mx.array | np.ndarray
    dtype: mx.Dtype
    regions: list[tuple[int, dict, _Coefficients | None]]
    rows: int
    given: Coefficients | None = None

    def body(self) -> tuple[float, Coefficients | None]:
        """Its body's step and its coefficients sent (n, rows), in units of that step (None: none
        were sent, or it has no coded rows)."""
        if not self.regions:
            return 1.0, None
        _, entry, coefficients = self.regions[0]
        return entry["step"], coefficients.values if coefficients is not None else None

    def sent(self, features: int, numpy: bool) -> Coefficients:
        """Its coefficients (F, rows), in units of its scale, as the next layer predicts from them."""
        step, values = self.body()
        return unpredicted(values, features, self.rows, step, numpy=numpy)


def _unpacked(
    km: dict, seg: Segments, shape: tuple[int, int, int, int], kept: tuple[int, int, int], numpy: bool
) -> _Tensor:
    """A tensor's raw rows and its regions' codes unpacked (`_Tensor`); `kept`: the layer's sink,
    recent and tail rows."""
    b, h, t, d = shape
    s, r, tail = kept
    dtype = km.get("raw_dtype", "float16")
    raw = _raw_array(seg(km["raw"], 4 * b * h * (s + r) * d), dtype, (b, h, s + r, d), numpy)
    regions = []
    for (lo, hi), region in zip(coded_regions(t, s, r, tail), (km, km.get("tail", {})), strict=True):
        if hi > lo:
            coefficients = _coefficients(region, seg, b * (hi - lo), tables=numpy) if region["n"] else None
            regions.append((hi - lo, region, coefficients))
    return _Tensor(raw, RAW_DTYPES[dtype], regions, b * (t - s - r))


def _predicted(tensor: _Tensor, tb: TensorBasis, inputs: list[Coefficients], numpy: bool) -> Coefficients:
    """A predicted tensor's coefficients (F, rows), in units of its scale: its prediction from `inputs`
    (the layer before's keys and values, and for values this layer's keys) plus the residual sent."""
    assert tb.predictor is not None  # (`_decode_layer` checked)
    if any(x.shape[1] != tensor.rows for x in inputs):
        raise TransformCodecError(f"a layer of {tensor.rows} coded rows predicted from one of {inputs[0].shape[1]}")
    step, residual = tensor.body()
    if residual is not None and residual.shape[0] > tb.features:
        raise TransformCodecError(f"{residual.shape[0]} components sent of {tb.features}")
    out = chained(tb.predictor.predicted(inputs, numpy=numpy), residual, tb.predictor.order(), step)
    if not numpy:
        mx.eval(out)
    return out


@dataclass
class _Rows:
    """A tensor's coded rows (the graph's: (B, rows, H, D), token-major; NumPy's: where it wrote
    them in the layer's array, (B, H, rows, D)), and per region the bound on their magnitude that
    its codes' widths give (`_magnitude_bound`)."""

    rows: mx.array | np.ndarray
    bounds: list[float]


def _coded_rows(
    tensor: _Tensor,
    tb: TensorBasis,
    shape: tuple[int, int, int],
    rotation: tuple[mx.array, mx.array] | tuple[np.ndarray, np.ndarray] | None,
    rotary: Rotary,
    *,
    into: tuple[np.ndarray, int] | None = None,
) -> _Rows:
    """A tensor's coded regions (the body, then the tail), each its own product with its own steps
    and components, as one block of rows (B, rows, H, D): the mean added and rotated back with
    `rotation`'s tables (keys) once per tensor, not once per region (2-6% quicker decoding with a
    tail). With `into` (the layer's array (B, H, T, D) and the row the block starts at) all of it
    in NumPy and compiled loops, the block written there; else an MLX graph. A predicted tensor's
    product is of its coefficients of every component (`_Tensor.given`)."""
    b, h, d = shape
    made = np.empty((b, sum(rows for rows, _, _ in tensor.regions), h * d), np.float32) if into is not None else None
    products: list[mx.array] = []
    bounds: list[float] = []
    at = 0
    for rows, region, coefficients in tensor.regions:
        scale = region["step"] * tb.scale
        n, largest = region["n"], np.zeros(0)
        values = coefficients.values if coefficients is not None else None
        if tensor.given is not None:
            scale, n, values = tb.scale, tb.features, tensor.given
            largest = _largest(values).astype(np.float64)
        elif coefficients is not None:
            largest = coefficients.largest
        if made is not None:
            if n:
                _synthesised_into(made[:, at : at + rows], np.asarray(values), tb, n, scale)
            else:
                made[:, at : at + rows] = 0.0
        elif n:
            assert values is not None  # (components were sent)
            products.append(_synthesised(values, tb, n, scale).reshape(b, rows, h * d))
        else:
            products.append(mx.zeros((b, rows, h * d), mx.float32))
        bounds.append(_magnitude_bound(largest, tb, scale, rotated=rotation is not None))
        at += rows
    if into is not None:
        assert made is not None  # (made with `into`)
        full, start = into
        mean, token_major = tb.mean.reshape(h, d), made.reshape(b, at, h, d)
        if rotation is None:
            np.add(token_major, mean, out=full[:, :, start : start + at].transpose(0, 2, 1, 3))
        else:
            cos, sin = rotation
            assert isinstance(cos, np.ndarray) and isinstance(sin, np.ndarray)
            rotated_rows(full, start, token_major, mean, cos, sin, rotary.dims, rotary.traditional, False)
        return _Rows(full[:, :, start : start + at], bounds)
    block = (mx.concatenate(products, axis=1) if len(products) > 1 else products[0]) + tb.on_mlx("mean")
    block = block.reshape(b, at, h, d)
    if rotation is not None:
        cos, sin = rotation
        assert isinstance(cos, mx.array) and isinstance(sin, mx.array)
        block = rotate(block, cos, sin, rotary)
    return _Rows(block, bounds)


def _largest(coefficients: Coefficients) -> np.ndarray:
    """Each component's largest magnitude over the rows (F,)."""
    if isinstance(coefficients, np.ndarray):
        return np.abs(coefficients).max(axis=1, initial=0.0)
    return np.asarray(mx.abs(coefficients).max(axis=1)) if coefficients.shape[1] else np.zeros(coefficients.shape[0])


def decode_layers(blobs: Sequence[bytes], basis: Basis) -> list[tuple[mx.array, mx.array]]:
    """Per layer, (keys, values) in its raw rows' dtype (B, kv_heads, tokens, head_dim), keys rotated
    back; several layers at once (`kvmesh.codec.layer_pool`), those predicted from the layer before
    (kvmesh.codec.prediction) once it has decoded."""
    memo: dict = {}
    chain = LayerChain()
    for blob in blobs:  # (in order, before any decodes: `LayerChain`)
        layer = read_header(blob)[0].get("layer")
        if type(layer) is int:
            chain.expect(layer)
    try:
        return map_layers(lambda blob: decode_layer(blob, basis, memo, chain=chain), blobs)
    finally:
        chain.close("a layer before it did not decode")
