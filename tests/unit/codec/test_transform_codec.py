"""The transform codec (kvmesh.codec.rotary, .basis, .transform) against NumPy references written here."""

import math

import mlx.core as mx
import numpy as np
import pytest

from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.basis import Basis, BasisError, fit_basis, fit_tensor_basis
from kvmesh.codec.coded import TransformCoding, decoded, transform_code
from kvmesh.codec.cpu_kernels import dequantized_rows, rotated_rows
from kvmesh.codec.layer_blob import (
    ESCAPE,
    MAGIC,
    MAGIC_RAW_DTYPE,
    MAGIC_TAIL,
    TransformCodecError,
    cut_codes,
    pack_zigzag,
    read_header,
)
from kvmesh.codec.quantize import (
    _quantize,
    _quantize_numpy,
    bit_allocation,
    component_groups,
    kept_components,
    pack_codes,
    pack_integers,
)
from kvmesh.codec.rotary import (
    Rotary,
    apply_rope,
    model_rotaries,
    remove_rope,
    rotary_of,
    rotate,
    token_major_numpy_tables,
    token_major_tables,
)
from kvmesh.codec.transform import _analysed, _analysed_numpy, encode_layers, layers_of_cache
from kvmesh.codec.transform_decode import decode_group, decode_layers


def rope_np(x, positions, dims, base, scale=1.0, traditional=False, inverse=False):
    """Reference RoPE in float64: x (..., T, D), positions (T,) or broadcastable to x[..., 0]."""
    x = np.asarray(x, dtype=np.float64)
    inv = scale * base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    theta = np.asarray(positions, dtype=np.float64)[..., None] * inv  # (..., T, dims/2)
    if inverse:
        theta = -theta
    cos, sin = np.cos(theta), np.sin(theta)
    out = x.copy()
    if traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = a * cos - b * sin
        out[..., 1:dims:2] = a * sin + b * cos
    else:
        half = dims // 2
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half] = a * cos - b * sin
        out[..., half:dims] = a * sin + b * cos
    return out


def sparse_positions(rng, t, span):
    return np.sort(rng.choice(span, size=t, replace=False)).astype(np.int32)


# --- RoPE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope_removal_against_numpy(traditional, dims):
    rng = np.random.default_rng(0)
    rot = Rotary(dims=dims, traditional=traditional, base=10000.0, scale=1.0)
    x = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    pos = sparse_positions(rng, 40, 3000)
    rotated = rope_np(x, pos, dims, 10000.0, traditional=traditional)
    # apply_rope is the NumPy rotation; remove_rope undoes it (float32 angles: ~1e-4 at position 3000).
    np.testing.assert_allclose(np.asarray(apply_rope(mx.array(x), pos, rot)), rotated, atol=2e-3)
    back = np.asarray(remove_rope(mx.array(rotated.astype(np.float32)), pos, rot))
    np.testing.assert_allclose(back, x, atol=2e-3)
    # At small positions the match is tight.
    small = np.arange(40)
    np.testing.assert_allclose(
        np.asarray(
            remove_rope(
                mx.array(rope_np(x, small, dims, 10000.0, traditional=traditional).astype(np.float32)), small, rot
            )
        ),
        x,
        atol=2e-5,
    )


def test_rope_round_trip_and_model_kernel():
    rng = np.random.default_rng(1)
    rot = Rotary(dims=64, traditional=True, base=100000.0, scale=1.0)
    x = mx.array(rng.standard_normal((1, 3, 50, 64)).astype(np.float32))
    # Contiguous positions: exactly what the model's own call computes.
    model = mx.fast.rope(x, 64, traditional=True, base=100000.0, scale=1.0, offset=7)
    assert mx.array_equal(apply_rope(x, np.arange(7, 57), rot), model)
    # Removal then re-application, per-head sparse positions.
    pos = np.stack([sparse_positions(rng, 50, 5000) for _ in range(3)])
    back = apply_rope(remove_rope(x, pos, rot), pos, rot)
    assert float(mx.abs(back - x).max()) < 2e-6


@pytest.mark.parametrize("traditional", [False, True])
def test_rows_at_positions_of_their_own_are_rotated_as_the_model_rotates_each_one(traditional):
    """Rows each at its own position, contiguous in memory or a broadcast block (as the rotation
    tables are made), come back as the model's own call rotates each row at its offset: the kernel
    is only ever called as the model calls it (MLX's CUDA kernel misread a broadcast block given
    one offset per row: every coded key decoded wrong on an H200)."""
    rng = np.random.default_rng(3)
    rot = Rotary(dims=16, traditional=traditional, base=10000.0, scale=1.0)
    pos = np.stack([sparse_positions(rng, 30, 4000) for _ in range(2)])  # (H, T): per head
    rows = mx.array(rng.standard_normal((1, 2, 30, 32)).astype(np.float32))
    for x in (rows, mx.broadcast_to(rows[:, :, :1], rows.shape)):
        got = np.asarray(apply_rope(x, pos, rot))
        for h in range(2):
            for t in range(30):
                one = mx.contiguous(x[:, h : h + 1, t : t + 1])
                want = mx.fast.rope(one, 16, traditional=traditional, base=10000.0, scale=1.0, offset=int(pos[h, t]))
                np.testing.assert_allclose(got[:, h : h + 1, t : t + 1], np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("traditional, dims", [(False, 16), (True, 16), (False, 8)])
@pytest.mark.parametrize("heads", ["shared", "per head"])
def test_the_compiled_rotations_give_the_graph_s_floats(traditional, dims, heads):
    """The CPU's compiled rotations (kvmesh.codec.cpu_kernels) give `rotate`'s floats bit for bit,
    both pairings, partial rotary dims, either way, at positions shared by the heads or each head's
    own: the decoder's (the mean added, written into the rows of the layer's array it is given) and
    the coder's (the rotation taken off, then the mean), inputs left as they were."""
    rng = np.random.default_rng(8)
    rot = Rotary(dims=dims, traditional=traditional, base=10000.0)
    if heads == "shared":
        pos = np.broadcast_to(np.arange(100, 140, dtype=np.int32), (1, 2, 40))
    else:
        pos = np.stack([sparse_positions(rng, 40, 3000) for _ in range(2)])[None]  # (B, H, T)
    tables = token_major_tables(rot, pos, {})
    numpy_tables = token_major_numpy_tables(rot, pos, {})
    x = (rng.standard_normal((1, 40, 2, 16)) * 30).astype(np.float32)  # token-major (B, T, H, D)
    mean = (rng.standard_normal((2, 16)) * 3).astype(np.float32)
    before = x.copy()

    want = np.asarray(rotate(mx.array(x) + mx.array(mean), *tables, rot)).transpose(0, 2, 1, 3)
    layer = np.full((1, 2, 45, 16), np.nan, np.float32)
    rotated_rows(layer, 3, x, mean, *numpy_tables, dims, traditional, False)
    np.testing.assert_array_equal(layer[:, :, 3:43], want)
    assert np.isnan(layer[:, :, :3]).all() and np.isnan(layer[:, :, 43:]).all() and np.array_equal(x, before)

    head_major = np.ascontiguousarray(np.concatenate([x[:, :2], x], axis=1).transpose(0, 2, 1, 3))  # (B, H, 42, D)
    want = np.asarray(rotate(mx.array(x), *tables, rot, inverse=True) - mx.array(mean))
    out = np.full(x.shape, np.nan, np.float32)
    rotated_rows(head_major, 2, out, mean, *numpy_tables, dims, traditional, True)
    np.testing.assert_array_equal(out, want)


def test_the_compiled_rounding_and_packing_give_numpy_s_codes():
    """The CPU's compiled rounding gives the graph's codes and statistics (the offsets' sums to float32
    rounding), refuses NaN and codes beyond 32 bits as the graph does, its packing writes the bytes a
    NumPy reading of the format makes (at every width, lengths that fill their last byte or not,
    escapes in order), and the values it makes of codes are the decoder's, bit for bit."""
    rng = np.random.default_rng(5)
    coeffs = (rng.standard_normal((12, 301)) * np.geomspace(40, 0.01, 12)[:, None]).astype(np.float32)
    for step in (0.003, 0.1, 2.0, 1e3):
        graph, mine = _quantize(coeffs, 10, step), _quantize_numpy(coeffs, 10, step)
        for field in ("lows", "highs", "nonzero"):
            np.testing.assert_array_equal(getattr(mine, field), getattr(graph, field))
        np.testing.assert_allclose(mine.offsets, graph.offsets, rtol=1e-5, atol=1e-3)
        np.testing.assert_array_equal(mine.zigzagged, np.asarray(graph.zigzagged))
    for bad, says in ((np.nan, "NaN or infinite"), (np.inf, "NaN or infinite"), (1e12, "beyond 32 bits")):
        poisoned = coeffs.copy()
        poisoned[3, 7] = bad
        for quantize in (_quantize, _quantize_numpy):
            with pytest.raises(TransformCodecError, match=says):
                quantize(poisoned, 10, 0.1)
    for width, top in ((2, 3), (4, 15), (8, 254), (8, 100_000)):
        for size in (1, 7, 64, 1001, 1002, 1003):
            zz = rng.integers(0, top + 1, size).astype(np.uint32)
            plane, escapes = pack_zigzag(zz, width)
            per = 8 // width
            codes = np.minimum(zz, 255) if width == 8 else zz
            padded = np.zeros(-(-size // per) * per, np.uint32)
            padded[:size] = codes
            want = (padded.reshape(-1, per) << (np.arange(per, dtype=np.uint32) * width)).sum(axis=1)
            assert plane == want.astype(np.uint8).tobytes()
            assert escapes == zz[zz >= 255].astype("<u4").tobytes() if width == 8 else escapes == b""
            # the coder's values of the codes (what it predicts the next layer from) are the decoder's
            offset = float(rng.choice([0.0, -0.1, 0.037]))
            got = dequantized_rows(zz[None], np.array([offset], np.float32))[0]
            want = np.asarray(decode_group(width, plane, escapes, size, offset))
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_encoder_s_two_projections_agree():
    """The encoder's projection as an MLX graph (what a GPU runs) and in NumPy (a CPU) give the same
    coefficients, but for their products' rounding (two BLAS's): RoPE taken off at per-head
    positions, the mean, the scale, component-major."""
    rng = np.random.default_rng(9)
    rot = Rotary(dims=16, traditional=False, base=10000.0)
    basis = fit_basis([random_layers(rng, 1, 2, 200, 16)], [rot])
    pos = np.stack([sparse_positions(rng, 50, 3000) for _ in range(2)])[None]
    x = rng.standard_normal((1, 2, 50, 16)).astype(np.float32)
    for tb, rotation in ((basis.keys[0], True), (basis.values[0], False)):
        graph = _analysed(mx.array(x), tb, token_major_tables(rot, pos, {}) if rotation else None, rot)
        mine = _analysed_numpy(x, (0, 50), tb, token_major_numpy_tables(rot, pos, {}) if rotation else None, rot)
        assert isinstance(mine, np.ndarray) and mine.shape == (32, 50)
        np.testing.assert_allclose(mine, np.asarray(graph), rtol=1e-4, atol=1e-4)


def test_rotary_with_freqs_and_scale():
    """A rope given as periods (mlx-lm's _freqs, as Llama3RoPE) and a linear scale."""
    rng = np.random.default_rng(2)
    periods = 10000.0 ** (np.arange(0, 64, 2) / 64)
    rot = Rotary(dims=64, traditional=False, base=None, scale=0.5, freqs=tuple(periods.tolist()))
    np.testing.assert_allclose(rot.inverse_frequencies(), 0.5 / periods)
    x = rng.standard_normal((1, 1, 20, 64)).astype(np.float32)
    pos = np.arange(100, 120)
    want = rope_np(x, pos, 64, 10000.0, scale=0.5)
    np.testing.assert_allclose(np.asarray(apply_rope(mx.array(x), pos, rot)), want, atol=1e-4)
    assert Rotary.from_dict(rot.to_dict()) == rot


def test_rotaries_of_the_tiny_model(tiny):
    import mlx.nn as nn

    model, _ = tiny
    rots = model_rotaries(model)
    assert len(rots) == len(model.layers)
    assert rots[0] == Rotary(dims=64, traditional=False, base=500000.0, scale=1.0)
    assert rotary_of(nn.RoPE(32, traditional=True, base=1e4, scale=0.25)) == Rotary(32, True, 1e4, 0.25)


# --- basis -----------------------------------------------------------------------------------------


def correlated_rows(rng, n, f, decay=0.8, mix_seed=None):
    """Rows with a decaying spectrum; the same mix_seed, the same distribution."""
    fixed = np.random.default_rng(mix_seed) if mix_seed is not None else rng
    rotation, _ = np.linalg.qr(fixed.standard_normal((f, f)))
    offset = fixed.standard_normal(f)
    return ((rng.standard_normal((n, f)) * decay ** np.arange(f)) @ rotation + offset).astype(np.float32)


def test_pca_basis_inverse_and_reference():
    rng = np.random.default_rng(3)
    rows = correlated_rows(rng, 500, 24)
    tb = fit_tensor_basis(rows, dtype=np.float32)
    centred = rows.astype(np.float64) - rows.mean(axis=0)
    singular = np.linalg.svd(centred, compute_uv=False)
    np.testing.assert_allclose(tb.rms, singular / math.sqrt(len(rows)), rtol=1e-4)
    np.testing.assert_allclose(tb.components @ tb.components.T, np.eye(24), atol=1e-5)
    np.testing.assert_allclose(tb.reconstruct(tb.project(rows)), rows, atol=1e-4)
    # float16 components: the analysis matrix is their exact inverse, so the round trip stays exact.
    tb16 = fit_tensor_basis(rows)
    assert tb16.components.dtype == np.float16
    np.testing.assert_allclose(tb16.reconstruct(tb16.project(rows)), rows, atol=1e-4)
    # Truncated to the leading components, the error is the discarded variance.
    coeffs = tb.project(rows)
    err = rows - tb.reconstruct(coeffs[:, :10])
    assert np.mean(np.sum(err.astype(np.float64) ** 2, axis=1)) == pytest.approx(np.sum(tb.rms[10:] ** 2.0), rel=1e-3)


def random_layers(rng, n_layers=2, h=2, t=60, d=16, positions=None):
    """Per layer (keys, values, positions): keys are correlated rows rotated by RoPE at their positions."""
    layers = []
    pos = np.arange(t) if positions is None else positions
    for i in range(n_layers):
        k = correlated_rows(rng, t, h * d, mix_seed=2 * i).reshape(1, t, h, d).transpose(0, 2, 1, 3)
        k = np.asarray(apply_rope(mx.array(np.ascontiguousarray(k)), pos, Rotary(dims=d, traditional=False)))
        v = correlated_rows(rng, t, h * d, mix_seed=2 * i + 1).reshape(1, t, h, d).transpose(0, 2, 1, 3)
        layers.append(
            (np.ascontiguousarray(k), np.ascontiguousarray(v), np.arange(t) if positions is None else positions)
        )
    return layers


def small_basis(rng, n_layers=2, h=2, d=16, dtype=np.float16):
    rots = [Rotary(dims=d, traditional=False, base=10000.0)] * n_layers
    calibration = [random_layers(rng, n_layers, h, 200, d) for _ in range(2)]
    return fit_basis(calibration, rots, dtype=dtype, info={"test": True})


def test_basis_bytes_digest_and_refusal():
    basis = small_basis(np.random.default_rng(4))
    data = basis.to_bytes()
    assert data == small_basis(np.random.default_rng(4)).to_bytes()  # deterministic
    loaded = Basis.from_bytes(data, basis.digest)
    assert loaded.digest == basis.digest and loaded.rotaries == basis.rotaries and loaded.info == basis.info
    for a, b in zip(loaded.keys + loaded.values, basis.keys + basis.values):
        assert np.array_equal(a.components, b.components) and np.array_equal(a.mean, b.mean)
        assert np.array_equal(a.rms, b.rms)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    with pytest.raises(BasisError, match="do not match their id"):
        Basis.from_bytes(bytes(flipped), basis.digest)
    # mx.load reads it too (plain safetensors).
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "basis.safetensors"
        path.write_bytes(data)
        arrays = mx.load(str(path))
        assert np.array_equal(np.asarray(arrays["layers.1.v.rms"]), basis.values[1].rms)


# --- bit allocation and integers ---------------------------------------------------------------------


def test_bit_allocation_hand_case():
    # step = sqrt(12): bits = log2(rms), zero below rms 1.
    bits = bit_allocation(np.array([8.0, 2.0, 1.0, 0.1]), math.sqrt(12))
    np.testing.assert_allclose(bits, [3.0, 1.0, 0.0, 0.0])
    assert kept_components(np.array([8.0, 2.0, 1.0, 0.1]), math.sqrt(12)) == 2
    # Halving the step gives every kept component one more bit, and keeps one more component.
    np.testing.assert_allclose(bit_allocation(np.array([8.0, 2.0, 1.0, 0.1]), math.sqrt(12) / 2), [4.0, 2.0, 1.0, 0.0])


# Independent bit-level inverses of the packers (the codec itself decodes by table look-up,
# `decode_group`): what the round-trip tests check both against.


def unpack_integers(plane: bytes, escapes: bytes, count: int) -> np.ndarray:
    """The inverse of pack_integers: int32 values."""
    zz = np.frombuffer(plane, dtype=np.uint8)
    if zz.size != count:
        raise TransformCodecError(f"a plane of {zz.size} codes where {count} were expected")
    small = zz.astype(np.int32)
    out = (small >> 1) ^ -(small & 1)
    big = zz == ESCAPE
    esc = np.frombuffer(escapes, dtype="<u4")
    if esc.size != int(np.count_nonzero(big)):
        raise TransformCodecError("escape count does not match the plane")
    e = esc.astype(np.int64)
    out[big] = ((e >> 1) ^ -(e & 1)).astype(np.int32)
    return out


def unpack_codes(width: int, plane: bytes, escapes: bytes, count: int) -> np.ndarray:
    """The inverse of pack_codes: `count` int32 values."""
    if width == 8:
        return unpack_integers(plane, escapes, count)
    per = 8 // width
    packed = np.frombuffer(plane, dtype=np.uint8)
    if packed.size != -(-count // per):
        raise TransformCodecError(f"{packed.size} packed bytes for {count} codes of {width} bits")
    mask = np.uint8((1 << width) - 1)
    shifts = (np.arange(per, dtype=np.uint8) * np.uint8(width))[None, :]
    zz = ((packed[:, None] >> shifts) & mask).reshape(-1)[:count].astype(np.int32)
    return (zz >> 1) ^ -(zz & 1)


def test_integers_round_trip():
    rng = np.random.default_rng(5)
    q = np.concatenate([rng.integers(-5, 6, 1000), [0, -127, 127, -128, 128, 40000, -40000, 2**30]])
    plane, esc = pack_integers(q)
    assert len(plane) == q.size
    assert np.array_equal(unpack_integers(plane, esc, q.size), q)
    with pytest.raises(TransformCodecError):
        unpack_integers(plane, esc[:-4], q.size)


def test_codes_packed_several_per_byte():
    rng = np.random.default_rng(10)
    # Zigzagged codes below 4 (values -2..1) go four to a byte, below 16 (-8..7) two, others one.
    for lo, hi, width in ((-2, 1, 2), (-8, 7, 4), (-300, 300, 8), (0, 0, 2)):
        q = rng.integers(lo, hi + 1, 1001)
        got_width, plane, esc = pack_codes(q)
        assert got_width == width
        assert len(plane) == math.ceil(1001 / (8 // width))
        assert np.array_equal(unpack_codes(width, plane, esc, 1001), q)
        # The decoder's table look-up, with a centroid offset folded in.
        out = np.array(decode_group(width, plane, esc, 1001, -0.125))
        np.testing.assert_array_equal(out, q - 0.125 * np.sign(q))
    # Hand-checked: 1, -1, 0, -2 -> zigzag 2, 1, 0, 3 -> 2 | 1 << 2 | 0 << 4 | 3 << 6.
    assert pack_codes(np.array([1, -1, 0, -2]))[1] == bytes([2 | 1 << 2 | 3 << 6])


def test_one_byte_codes_whose_escapes_disagree_with_the_plane_are_refused():
    """A plane of one-byte codes has exactly as many escapes (255) as it sends escaped values: too
    few or too many, or one where none was sent, is refused (most planes escape nothing)."""
    width, plane, esc = pack_codes(np.array([3, -300, 5, 200]))
    assert width == 8 and len(esc) == 8 and plane.count(ESCAPE) == 2
    unescaped = bytes([ESCAPE, 0, 0, 0])
    cases = [(plane, esc[:4]), (plane, esc + esc[:4]), (plane, b""), (unescaped, b""), (bytes(4), esc[:4])]
    for p, e in [*cases, (memoryview(unescaped), b""), (memoryview(plane), b"")]:
        with pytest.raises(TransformCodecError, match="escape count"):
            decode_group(8, p, e, 4, 0.0)


def test_packed_codes_cut_to_their_first_columns():
    """A coded layer's prefix keeps the first columns (tokens) of every component's codes, at the
    same width; one-byte codes keep their escapes in order."""
    rng = np.random.default_rng(11)
    for lo, hi, width in ((-2, 1, 2), (-8, 7, 4), (-40000, 40000, 8)):
        q = rng.integers(lo, hi + 1, (7, 301))
        _, plane, esc = pack_codes(q)
        for kept in (1, 128, 300, 301):
            cut_plane, cut_esc = cut_codes(width, plane, esc, 7, 301, kept)
            assert np.array_equal(unpack_codes(width, cut_plane, cut_esc, 7 * kept).reshape(7, kept), q[:, :kept])
    with pytest.raises(TransformCodecError):
        cut_codes(4, plane, b"", 7, 301, 10)


def test_component_groups_hand_case():
    # step sqrt(12): bits log2(rms) = 3, 3, 1, 0.58, 0, 0 -> 4 sent, rounded up 3, 3, 1, 1.
    rms = np.array([8.0, 8.0, 2.0, 1.5, 1.0, 0.1])
    assert kept_components(rms, math.sqrt(12)) == 4
    assert component_groups(rms, math.sqrt(12), 4) == [2, 2]
    assert component_groups(rms, math.sqrt(12), 0) == []


# --- encode / decode ------------------------------------------------------------------------------


def test_round_trip_error_bounded_by_step():
    rng = np.random.default_rng(6)
    basis = small_basis(rng)
    layers = random_layers(rng, positions=None)
    step = 0.2
    enc = encode_layers(layers, basis, step=step, sinks=4, recent=3, key_factor=2.0)
    decoded = decode_layers(enc.blobs, basis)
    assert len(decoded) == 2
    for (k, v, pos), (dk, dv), i in zip(layers, decoded, range(2)):
        assert dk.dtype == mx.float32 and dk.shape == k.shape and dv.shape == v.shape  # the layers' own
        # Sinks and the recent window are the originals.
        for raw, got in ((k, dk), (v, dv)):
            assert np.array_equal(np.asarray(got[:, :, :4]), raw[:, :, :4])
            assert np.array_equal(np.asarray(got[:, :, -3:]), raw[:, :, -3:])
        rot = basis.rotaries[i]
        for raw, got, tb, un in (
            (k, dk, basis.keys[i], True),
            (v, dv, basis.values[i], False),
        ):
            mid, got_mid = raw[:, :, 4:-3], np.asarray(got[:, :, 4:-3].astype(mx.float32))
            if un:
                mid = np.asarray(remove_rope(mx.array(mid), pos[4:-3], rot))
                got_mid = np.asarray(remove_rope(mx.array(got_mid), pos[4:-3], rot))
            rows = mid.transpose(0, 2, 1, 3).reshape(-1, 32)
            got_rows = got_mid.transpose(0, 2, 1, 3).reshape(-1, 32)
            kstep = step * (2.0 if un else 1.0)  # the keys' step is key_factor times the values'
            n = kept_components(tb.rms / tb.scale, kstep)
            assert 0 < n < 32
            c, got_c = tb.project(rows), tb.project(got_rows)
            # A float16 output's rounding, carried into a coefficient (unit-norm analysis columns): a
            # bound for this float32 one too.
            fp16_slack = 2.0**-11 * math.sqrt(32) * np.abs(rows).max() * 1.5
            assert fp16_slack < 0.25 * kstep * tb.scale
            # Within half a step of the bin's centre, moved by at most the centroid offset.
            groups = read_header(enc.blobs[i])[0]["k" if un else "v"]["groups"]
            offset = max(abs(g[4]) for g in groups)
            assert offset < 0.5
            assert np.abs(c[:, :n] - got_c[:, :n]).max() <= kstep * tb.scale * (0.5 + offset) + fp16_slack
            # Components with no bits are not sent: their coefficient decodes as zero.
            assert np.abs(got_c[:, n:]).max() <= fp16_slack
    # Finer steps, smaller errors and more bytes.
    finer = encode_layers(layers, basis, step=step / 8, sinks=4, recent=3)
    assert finer.nbytes > enc.nbytes


def test_a_tail_is_coded_at_its_own_finer_step():
    """The last `tail` coded rows (before the raw recent ones) are rounded at `tail_factor` times each
    tensor's step, with more components sent: their coefficients come back within half that finer
    step, where the body's err by up to half the coarser one. A blob with a tail has its own magic."""
    rng = np.random.default_rng(9)
    basis = small_basis(rng)
    layers = random_layers(rng, t=60)
    step, tail = 0.4, 12
    plain = encode_layers(layers, basis, step=step, sinks=4, recent=3)
    enc = encode_layers(layers, basis, step=step, sinks=4, tail=tail, tail_factor=0.125, recent=3)
    assert plain.blobs[0][:5] == MAGIC_RAW_DTYPE and enc.blobs[0][:5] == MAGIC_TAIL  # (float32 rows)
    assert plain.nbytes < enc.nbytes
    errors = {}
    for i, ((k, v, pos), (dk, dv)) in enumerate(zip(layers, decode_layers(enc.blobs, basis), strict=True)):
        header = read_header(enc.blobs[i])[0]
        assert header["tail"] == tail
        for kind, raw, got, tb in (("k", k, dk, basis.keys[i]), ("v", v, dv, basis.values[i])):
            assert np.array_equal(np.asarray(got[:, :, -3:]), raw[:, :, -3:])  # the recent rows, raw
            km = header[kind]
            assert km["tail"]["step"] == pytest.approx(km["step"] / 8) and km["tail"]["n"] > km["n"]
            mid, got_mid = raw[:, :, 4:-3], np.asarray(got[:, :, 4:-3])
            if kind == "k":
                mid = np.asarray(remove_rope(mx.array(mid), pos[4:-3], basis.rotaries[i]))
                got_mid = np.asarray(remove_rope(mx.array(got_mid), pos[4:-3], basis.rotaries[i]))
            c = tb.project(mid.transpose(0, 2, 1, 3).reshape(-1, 32))
            got_c = tb.project(got_mid.transpose(0, 2, 1, 3).reshape(-1, 32))
            for region, rows in (("body", slice(0, -tail)), ("tail", slice(-tail, None))):
                m = km["tail"] if region == "tail" else km
                n, unit = m["n"], m["step"] * tb.scale
                offset = max((abs(g[4]) for g in m["groups"]), default=0.0)
                error = np.abs(c[rows, :n] - got_c[rows, :n]).max() / unit
                assert error <= 0.5 + offset + 1e-3
                errors.setdefault(region, []).append(np.abs(c[rows] - got_c[rows]).max())
    assert max(errors["tail"]) < 0.5 * min(errors["body"])
    # A kvmesh that reads these blobs names a later version of them for what it is.
    with pytest.raises(TransformCodecError, match=r"newer kvmesh \(version 9\): upgrade kvmesh"):
        read_header(b"KVTC\x09" + enc.blobs[0][5:])


def test_the_encoder_rounds_and_packs_alike_in_numpy_and_in_mlx_s_graph():
    """The encoder's NumPy steps (where MLX computes on the CPU) and its MLX graph (what a GPU runs)
    make the same blobs, byte for byte: from steps so fine that codes escape, through every width,
    to so coarse that nothing is sent, with per-head positions."""
    rng = np.random.default_rng(8)
    basis = small_basis(rng)
    positions = np.stack([sparse_positions(rng, 60, 300) for _ in range(2)])
    widths, escaped, empty = set(), False, False
    for layers in (random_layers(rng, positions=None), random_layers(rng, positions=positions)):
        for step in (0.002, 0.05, 0.3, 2.0, 50.0):
            graph = encode_layers(layers, basis, step=step, recent=3, numpy=False)
            numpy = encode_layers(layers, basis, step=step, recent=3, numpy=True)
            assert graph.blobs == numpy.blobs
            for header in (read_header(blob)[0] for blob in graph.blobs):
                widths |= {g[1] for kind in "kv" for g in header[kind]["groups"]}
                escaped |= any(g[3] is not None for kind in "kv" for g in header[kind]["groups"])
                empty |= header["k"]["n"] == 0
    assert widths == {2, 4, 8} and escaped and empty


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
def test_raw_rows_travel_in_the_cache_s_own_dtype(dtype):
    """A bfloat16 cache's sink beyond float16's range comes back as it was (as float16 it was
    infinite), a float32 cache's exactly; a float16 cache's blobs are those kvmesh always read."""
    rng = np.random.default_rng(9)
    basis = small_basis(rng)
    layers = [(mx.array(k).astype(dtype), mx.array(v).astype(dtype), pos) for k, v, pos in random_layers(rng)]
    if dtype == mx.bfloat16:
        layers[0][0][:, :, 0, 0] = 3e5  # float16 holds at most 65504
    enc = encode_layers(layers, basis, step=0.2, sinks=4, recent=3)
    assert all(blob.startswith(MAGIC if dtype == mx.float16 else MAGIC_RAW_DTYPE) for blob in enc.blobs)
    cache = [SparseKVCache.from_arrays(k, v, k.shape[2]) for k, v, _ in layers]
    coding = TransformCoding(basis, 0.2, sinks=4, recent=3)
    through_cache = [c.keys_and_values() for c in decoded(transform_code(cache, coding))]
    for (k, v, _), *decodes in zip(layers, decode_layers(enc.blobs, basis), through_cache, strict=True):
        for got_k, got_v in decodes:
            assert got_k.dtype == got_v.dtype == dtype
            for raw, got in ((k, got_k), (v, got_v)):
                assert mx.array_equal(got[:, :, :4], raw[:, :, :4]) and mx.array_equal(got[:, :, -3:], raw[:, :, -3:])


def test_target_ratio_bisection():
    rng = np.random.default_rng(7)
    basis = small_basis(rng)
    layers = random_layers(rng, t=400)
    enc = encode_layers(layers, basis, ratio=3.0, tolerance=0.02)
    assert 3.0 <= enc.ratio <= 3.0 / 0.98 + 1e-9
    assert enc.fp16_bytes == 2 * 2 * 2 * 400 * 32


def test_sparse_per_head_positions_and_wrong_basis():
    rng = np.random.default_rng(8)
    basis = small_basis(rng)
    pos = np.stack([sparse_positions(rng, 60, 1000), sparse_positions(rng, 60, 1000)])
    layers = random_layers(rng, positions=pos)
    enc = encode_layers(layers, basis, step=0.01)
    for (k, _, _), (dk, _) in zip(layers, decode_layers(enc.blobs, basis)):
        assert float(np.abs(np.asarray(dk.astype(mx.float32)) - k).max()) < 0.05 * np.abs(k).max()
    other = small_basis(np.random.default_rng(9))
    with pytest.raises(BasisError, match="coded with basis"):
        decode_layers(enc.blobs, other)
    with pytest.raises(TransformCodecError, match="magic"):
        decode_layers([b"nope" + enc.blobs[0]], basis)


def test_tiny_model_cache_round_trip(tiny, long_ids):
    """A real prefill of the tiny model: basis from one part of the text, coded cache of another; the
    next-token logits from the decoded cache match the original's closely at a fine step."""
    from mlx_lm.models.cache import KVCache

    from kvmesh.caches.prefill import run_prompt

    model, _ = tiny
    rots = model_rotaries(model)
    # Layer 0's keys are a function of the token alone: calibrate on enough distinct tokens.
    calib, _, _ = run_prompt(model, long_ids[:500])
    basis = fit_basis([layers_of_cache(calib)], rots)
    cache, _, _ = run_prompt(model, long_ids[500:650])
    layers = layers_of_cache(cache)
    enc = encode_layers(layers, basis, step=0.005)
    assert enc.ratio > 1.2
    rebuilt = []
    for dk, dv in decode_layers(enc.blobs, basis):
        c = KVCache()
        c.update_and_fetch(dk.astype(mx.float32), dv.astype(mx.float32))
        rebuilt.append(c)
    probe = mx.array(long_ids[650:660])[None]
    want = model(probe, cache=cache)[0]
    got = model(probe, cache=rebuilt)[0]
    lp_w = want - mx.logsumexp(want, axis=-1, keepdims=True)
    lp_g = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = (mx.exp(lp_w) * (lp_w - lp_g)).sum(-1).mean().item()
    assert kl < 1e-3


def test_rotary_of_mlx_lm_rope_modules():
    """Each supported mlx-lm rope module, read by rotary_of, rotates exactly as the module does."""
    from mlx_lm.models.rope_utils import initialize_rope

    x = mx.random.normal((1, 2, 9, 64), key=mx.random.key(0))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 8192
    for config in (None, {"rope_type": "linear", "factor": 4.0}, scaling):
        rope = initialize_rope(64, 500000.0, False, config, max_position_embeddings=131072)
        rot = rotary_of(rope)
        assert mx.allclose(apply_rope(x, np.arange(5, 14), rot), rope(x, offset=5), atol=1e-6)
    with pytest.raises(ValueError, match="not supported"):
        rotary_of(initialize_rope(64, 1e4, False, {"rope_type": "yarn", "factor": 4.0}, 4096))


def test_the_first_row_alone_travels_raw_by_default():
    """The attention sink (the first row) comes back exactly, however far it lies from what the
    basis was fitted on; the rows after it are coded like the rest."""
    rng = np.random.default_rng(21)
    basis = small_basis(rng)
    layers = [(mx.array(k), mx.array(v), pos) for k, v, pos in random_layers(rng)]
    layers[0][0][:, :, 0] = 40.0
    cache = [SparseKVCache.from_arrays(k, v, k.shape[2]) for k, v, _ in layers]
    coded = transform_code(cache, TransformCoding(basis, 0.2))
    for (k, v, _), layer in zip(layers, decoded(coded), strict=True):
        for raw, got in zip((k, v), layer.keys_and_values(), strict=True):
            assert mx.array_equal(got[:, :, :1], raw[:, :, :1]).item()
            assert not mx.array_equal(got[:, :, 1:2], raw[:, :, 1:2]).item()
