"""The transform codec's MLX decoder (kvmesh.codec.transform_decode) against the NumPy decoder it
replaced, written here as the reference: the same floats from the same blobs, in every dtype, with
contiguous and per-head positions, both RoPE pairings, partial rotary dims, raw recent rows, a tail
(each region decoded and rotated on its own, as the decoder did before it made one block of a
tensor's regions), two sequences in a batch, and steps from fine (escaped one-byte codes) to coarse
(no component sent).

Bit for bit, on any device: both compute the same matrix product (MLX's, of the same operands),
and every other step is one correctly rounded float32 operation in the same order (table look-ups,
the scaling, the mean, the rotation's products and sums with the kernel's own cos/sin, the casts).
So the MLX decoder cannot change a generated token: the cache it gives is the one kvmesh gave.
"""

import contextlib
import itertools
import json
import os
import struct
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from test_transform_codec import random_layers, sparse_positions

from kvmesh.codec.basis import Basis, fit_basis
from kvmesh.codec.layer_blob import Segments, TransformCodecError, coded_regions, cut_layer, read_header
from kvmesh.codec.layer_pool import layer_pool, map_layers
from kvmesh.codec.rate import measure_decode_rate, synthetic_basis, synthetic_layers
from kvmesh.codec.rotary import Rotary, apply_rope
from kvmesh.codec.transform import SINKS, encode_layers
from kvmesh.codec.transform_decode import RAW_DTYPES, decode_layer, decode_layers
from support.references import rounded_alike


def reference_rotate(x: np.ndarray, positions: np.ndarray, rotary: Rotary) -> np.ndarray:
    """x (B, H, T, D) float32 rotated with the kernel's (cos, sin) of each position (the kernel
    applied to unit pairs), in NumPy: the previous decoder's arithmetic."""
    b, h, t, d = x.shape
    half, dims = rotary.dims // 2, rotary.dims
    unit = np.zeros((b, h, t, d), np.float32)
    if rotary.traditional:
        unit[..., 0:dims:2] = 1.0
    else:
        unit[..., :half] = 1.0
    table = np.asarray(apply_rope(mx.array(unit), positions, rotary))
    if rotary.traditional:
        cos, sin = table[..., 0:dims:2], table[..., 1:dims:2]
        a, c = x[..., 0:dims:2], x[..., 1:dims:2]
        out = x.copy()
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - c * sin, a * sin + c * cos
    else:
        cos, sin = table[..., :half], table[..., half:dims]
        a, c = x[..., :half], x[..., half:dims]
        out = x.copy()
        out[..., :half], out[..., half:dims] = a * cos - c * sin, a * sin + c * cos
    return out


def code_table(width: int) -> np.ndarray:
    """(256, 8 // width) float32: the signed values each packed byte holds."""
    per = 8 // width
    zz = (np.arange(256)[:, None] >> (np.arange(per) * width)) & ((1 << width) - 1)
    return ((zz >> 1) ^ -(zz & 1)).astype(np.float32)


TABLES = {width: code_table(width) for width in (2, 4, 8)}


def reference_group(width: int, plane: bytes, escapes: bytes, count: int, offset: float) -> np.ndarray:
    """The previous decoder's table look-up, the centroid offset folded into the table."""
    per = 8 // width
    packed = np.frombuffer(plane, dtype=np.uint8)
    table = TABLES[width] + np.float32(offset) * np.sign(TABLES[width])
    flat = table[packed].reshape(-1)[:count].copy()
    if per == 1:
        esc = np.frombuffer(escapes, dtype="<u4").astype(np.int64)
        values = ((esc >> 1) ^ -(esc & 1)).astype(np.float32)
        flat[packed == 255] = values + np.float32(offset) * np.sign(values)
    return flat


def reference_decode(blob: bytes, basis: Basis, *, numpy_product: bool) -> list[mx.array]:
    """The NumPy decoder the MLX one replaced: keys and values of one layer's blob; the inverse
    transform's product made by NumPy or by MLX (two BLAS's products round apart)."""
    header, body = read_header(blob)
    seg = Segments(header, body)
    j, (b, h, t, d) = header["layer"], header["shape"]
    s, r = header["sinks"], header["recent"]
    pm = header["positions"]
    if "seg" in pm:
        pos = np.frombuffer(seg(pm["seg"], 4 * b * h * t), dtype="<i4").reshape(b, h, t)
    else:
        pos = np.broadcast_to(np.arange(pm["start"], pm["start"] + t, dtype=np.int32)[None, None], (b, h, t))
    out = []
    for kind, tb in (("k", basis.keys[j]), ("v", basis.values[j])):
        km = header[kind]
        raw_dtype = km.get("raw_dtype", "float16")
        raw = mx.array(np.frombuffer(seg(km["raw"], 1 << 30), "<u2" if raw_dtype != "float32" else "<f4"))
        raw = raw.view(RAW_DTYPES[raw_dtype]) if raw_dtype != "float32" else raw
        raw = np.asarray(raw.astype(mx.float32 if raw_dtype != "float16" else mx.float16)).reshape(b, h, s + r, d)
        full = np.empty((b, h, t, d), raw.dtype)
        full[:, :, :s], full[:, :, t - r :] = raw[:, :, :s], raw[:, :, s:]
        for (lo, hi), region in zip(coded_regions(t, s, r, header.get("tail", 0)), (km, km.get("tail"))):
            m = hi - lo
            if not m:
                continue
            n = region["n"]
            coded = np.concatenate(
                [
                    reference_group(w, seg(p, 1 << 30), seg(e, 1 << 30) if e else b"", c * b * m, o).reshape(c, b * m)
                    for c, w, p, e, o in region["groups"]
                ]
                or [np.zeros((0, b * m), np.float32)]
            )
            synthesis = tb.synthesis()[:n] * np.float32(region["step"] * tb.scale)
            if n and numpy_product:  # (per sequence, as the decoder multiplies)
                rows = np.matmul(coded.T.reshape(b, m, n), synthesis).reshape(b * m, -1) + tb.mean
            elif n:
                rows = np.asarray(mx.array(coded).T @ mx.array(synthesis) + mx.array(tb.mean))
            else:
                rows = np.broadcast_to(tb.mean, (b * m, h * d))
            block = np.ascontiguousarray(rows.reshape(b, m, h, d).transpose(0, 2, 1, 3))
            if kind == "k":
                block = reference_rotate(block, pos[:, :, lo:hi], basis.rotaries[j])
            full[:, :, lo:hi] = block
        out.append(mx.array(full).astype(RAW_DTYPES[raw_dtype]))
    return out


@pytest.mark.parametrize("numpy", [False, True], ids=["graph", "numpy"])
@pytest.mark.parametrize("traditional, dims", [(False, 16), (True, 16), (False, 8)])
def test_the_mlx_decoder_gives_the_reference_s_floats(traditional, dims, numpy):
    """Both ways of decoding (the MLX graph a GPU runs; the table look-ups and NumPy product a CPU
    runs) give the reference's floats, with the same library's product."""
    rng = np.random.default_rng(17)
    rotaries = [Rotary(dims=dims, traditional=traditional, base=10000.0)] * 2
    basis = fit_basis([random_layers(rng, 2, 2, 200, 16) for _ in range(2)], rotaries)
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        for positions in (None, np.stack([sparse_positions(rng, 60, 300) for _ in range(2)])):
            layers = [
                (mx.array(k).astype(dtype), mx.array(v).astype(dtype), p)
                for k, v, p in random_layers(rng, 2, 2, 60, 16, positions=positions)
            ]
            caches = [layers]
            if positions is None:  # and two sequences in a batch
                (k1, v1, p1), (k2, v2, p2) = layers
                caches.append([(mx.concatenate([k1, k2]), mx.concatenate([v1, v2]), p) for p in (p1, p2)])
            # Fine (escaped codes), middling, and so coarse that no component is sent; without and
            # with a tail (at 50 with a tail of a sixteenth of it, only the body sends none).
            for cache, step, tail in itertools.product(caches, (0.002, 0.3, 50.0), (0, 10)):
                for blob in encode_layers(cache, basis, step=step, recent=3, tail=tail, tail_factor=1 / 16).blobs:
                    header = read_header(blob)[0]
                    got_kv = decode_layer(blob, basis, numpy=numpy)
                    want_kv = reference_decode(blob, basis, numpy_product=numpy)
                    for got, want in zip(got_kv, want_kv, strict=True):
                        assert got.dtype == want.dtype and got.shape == want.shape
                        np.testing.assert_array_equal(*(np.asarray(a.astype(mx.float32)) for a in (got, want)))
                    assert header["k"]["n"] == 0 or step < 50.0


def test_the_decode_rate_is_measured_on_a_synthetic_cache_that_round_trips():
    basis = synthetic_basis(1, 2, 32)
    (keys, values, positions), *_ = synthetic_layers(basis, 64, dtype=mx.float32)
    blob = encode_layers([(keys, values, positions)], basis, step=0.05).blobs[0]
    got_k, got_v = decode_layer(blob, basis)
    # Coded at a fine step, the synthetic cache comes back close (what is timed decodes real numbers).
    for want, got in ((keys, got_k), (values, got_v)):
        assert mx.abs(got - want).max().item() < 0.1 * mx.abs(want).max().item()
    assert measure_decode_rate(2, 32, tokens=64, repeat=1) > 0


def with_header(blob: bytes, change) -> bytes:
    """The blob with its header changed by `change(header)` (its segments as they were)."""
    header, body = read_header(blob)
    change(header)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return bytes(blob[:5]) + struct.pack("<I", len(text)) + text + bytes(body)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_a_step_that_takes_coded_rows_beyond_float16_is_refused(kind):
    """The coded rows are read for their magnitude only when the codes' widths do not bound them
    inside float16's range: a sender's step that takes them beyond it, or is not a number, is refused;
    one whose bound passes float16's range but whose rows stay inside it decodes as the step says."""
    rng = np.random.default_rng(5)
    basis = fit_basis([random_layers(rng, 1, 2, 200, 16)], [Rotary(dims=16, traditional=False)])
    layers = [(mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16), p) for k, v, p in random_layers(rng, 1)]
    (blob,) = encode_layers(layers, basis, step=0.3).blobs
    honest = decode_layer(blob, basis)[kind == "v"]

    def scaled(factor: float):
        def change(header):
            header[kind]["step"] *= factor

        return with_header(blob, change)

    # A bound beyond float16 (the codes' widths allow 127 steps), the rows inside it: decoded.
    big = decode_layer(scaled(2e3), basis)[kind == "v"]
    coded = slice(SINKS, None)  # past the raw sink
    assert float(mx.abs(big[:, :, coded]).max()) > 20 * float(mx.abs(honest[:, :, coded]).max())
    assert bool(mx.isfinite(big).all())
    for factor in (1e6, float("inf"), float("nan")):
        with pytest.raises(TransformCodecError, match="NaN or infinite"):
            decode_layer(scaled(factor), basis)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("field", ["step", "offset"])
def test_a_tail_whose_step_or_offset_is_not_a_number_is_refused(kind, field):
    """Each region's bound is checked on its own: a tail's step, or a run's centroid offset (which
    no manifest states), that is not a number is refused though the body's bound is finite."""
    rng = np.random.default_rng(5)
    basis = fit_basis([random_layers(rng, 1, 2, 200, 16)], [Rotary(dims=16, traditional=False)])
    layers = [(mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16), p) for k, v, p in random_layers(rng, 1)]
    (blob,) = encode_layers(layers, basis, step=0.3, tail=10, tail_factor=0.25).blobs

    def change(header):
        tail = header[kind]["tail"]
        if field == "step":
            tail["step"] = float("nan")
        else:
            tail["groups"][0][4] = float("nan")

    decode_layer(blob, basis)
    with pytest.raises(TransformCodecError, match="NaN or infinite"):
        decode_layer(with_header(blob, change), basis)


def _drop(key):
    def change(header):
        del header[key]["tail"]

    return change


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda h: h.update(tail=h["shape"][2]), "a tail of 60 rows where 59 are coded"),
        (lambda h: h.update(tail=-2), "a tail of -2 rows"),
        (lambda h: h.update(tail=1.5), "a tail of 1.5 rows"),
        (_drop("v"), "steps for it missing"),
        (lambda h: h.pop("tail"), "a tail of 0 rows, and steps for it without one"),
    ],
    ids=["beyond", "negative", "fraction", "no steps", "steps only"],
)
def test_a_blob_whose_tail_lies_is_refused_by_decode_and_cut(change, says):
    """A tail beyond the coded rows, not a count, or steps for a tail the header does not have (and
    the other way round) is refused with its reason, by the decoder and by a cut."""
    rng = np.random.default_rng(12)
    basis = fit_basis([random_layers(rng, 1, 2, 200, 16)], [Rotary(dims=16, traditional=False)])
    (blob,) = encode_layers(random_layers(rng, 1), basis, step=0.3, tail=10, tail_factor=0.25).blobs
    lying = with_header(blob, change)
    for read in (lambda: decode_layer(lying, basis), lambda: cut_layer(lying, 30)):
        with pytest.raises(TransformCodecError, match=says):
            read()


def test_tails_in_batches_and_in_either_coder():
    """With a tail, the NumPy and MLX encoders make the same bytes, the two decoders the same rows
    (to float32 rounding), and a cache of two sequences cuts to exactly its first rows at any length
    (in the sinks, the body, the tail and the raw recent rows), a cut of a cut too."""
    rng = np.random.default_rng(13)
    basis = fit_basis([random_layers(rng, 1, 2, 200, 16)], [Rotary(dims=16, traditional=False)])
    (k1, v1, _), (k2, v2, _) = random_layers(rng, 2)
    layer = (np.concatenate([k1, k2]), np.concatenate([v1, v2]), np.arange(60))  # (2, heads, 60, dim)
    options = {"step": 0.3, "sinks": 4, "tail": 10, "tail_factor": 0.25, "recent": 3}
    (graph,) = encode_layers([layer], basis, numpy=False, **options).blobs
    (blob,) = encode_layers([layer], basis, numpy=True, **options).blobs
    assert graph == blob
    whole = decode_layer(blob, basis, numpy=True)
    for mine, theirs in zip(whole, decode_layer(blob, basis, numpy=False), strict=True):
        assert mx.allclose(mine, theirs, atol=1e-5).item()
    for n in (3, 20, 47, 50, 57, 59):
        cut = cut_layer(blob, n)
        assert ("tail" in read_header(cut)[0]) == (n > 47) and cut[:5] == (blob[:5] if n > 47 else b"KVTC\x02")
        for got, want in zip(decode_layer(cut, basis), whole, strict=True):
            assert rounded_alike(got, want[:, :, :n])
        again = cut_layer(cut, n - 2)
        for got, want in zip(decode_layer(again, basis), whole, strict=True):
            assert rounded_alike(got, want[:, :, : n - 2])


def test_layers_decoded_at_once_are_the_layers_decoded_one_by_one():
    """`decode_layers` runs layers on the process's layer threads: the same arrays as one at a time."""
    rng = np.random.default_rng(9)
    rotaries = [Rotary(dims=16, traditional=False)] * 4
    basis = fit_basis([random_layers(rng, 4, 2, 200, 16)], rotaries)
    blobs = encode_layers(random_layers(rng, 4, 2, 60, 16), basis, step=0.2).blobs
    together = decode_layers(blobs, basis)
    for blob, (keys, values) in zip(blobs, together, strict=True):
        one_k, one_v = decode_layer(blob, basis)
        assert np.array_equal(np.asarray(keys), np.asarray(one_k))
        assert np.array_equal(np.asarray(values), np.asarray(one_v))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_makes_its_own_layer_threads():
    """A child forked after the pool was made has none of its parent's threads: its pool is its own
    (the parent's would take its work and never run it)."""
    parent = layer_pool()
    assert layer_pool() is parent
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if a fresh pool runs work, and never return to pytest
        ok = False
        with contextlib.suppress(BaseException):
            ok = layer_pool() is not parent and map_layers(lambda x: x + 1, [1, 2]) == [2, 3]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


BLAS_THREADS_AROUND_THE_POOL = """
import json
import numpy  # (threadpoolctl sees the BLAS of the libraries loaded)
from threadpoolctl import threadpool_info
from kvmesh.codec.layer_pool import layer_pool, numpy_by_default

def blas():
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

before = blas()
layer_pool()
print(json.dumps({"numpy": numpy_by_default(), "before": before, "after": blas()}))
"""


@pytest.mark.slow
def test_the_layer_pool_gives_numpy_s_blas_one_thread_where_the_codec_s_products_are_numpy_s():
    """Each layer thread runs its products on one BLAS thread (kvmesh.codec.layer_pool), set when the
    pool is made: in a fresh process, since the limit holds for the whole process."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", BLAS_THREADS_AROUND_THE_POOL], capture_output=True, text=True, env=env, check=True
    )
    seen = json.loads(done.stdout)
    assert seen["numpy"], "MLX computes on the CPU here"
    assert seen["before"] and max(seen["before"]) == 2, seen
    assert seen["after"] == [1] * len(seen["before"]), seen
