"""Wire encoding: bit-exact round trips, and every kind of bad chunk refused with a clear error."""

import itertools
import threading
from dataclasses import replace

import mlx.core as mx
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache, truncate
from kvmesh.codec.chunks import ordered_map, parse_frame
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import CacheDecoder, decode_chunks
from kvmesh.codec.encode import EncodeOptions, build_manifest, encode_cache, encode_chunks
from kvmesh.codec.manifest import chunk_count, chunk_plan, content_id
from kvmesh.codec.prefix import PrefixKey
from kvmesh.errors import IntegrityError
from support.references import assert_same_caches

PRESSES = {
    "dense": ("full", {}),
    "sparse": ("snapkv", {"ratio": 0.5, "window": 16}),
    "quantized": ("quantize", {"kv_bits": 4}),
    "sparse+quantized": ("knorm", {"ratio": 0.5, "kv_bits": 8}),
}
CODECS = [("none", False), ("zstd", False), ("zstd", True)]


@pytest.fixture(scope="module")
def caches(tiny_in, prompt_ids):
    """{(kind, dtype): (cache, press)} of the 300-token prompt, every cache kind, two dtypes."""
    out = {}
    for dtype in (mx.float32, mx.bfloat16):
        for kind, (method, config) in PRESSES.items():
            press = make_press(method, config)
            out[kind, dtype] = (prefill(tiny_in(dtype), prompt_ids, press).cache, press)
    return out


def encoded(cache, press, fp, prompt_ids, codec="zstd", shuffle=True, chunk_size=8192):
    manifest, chunks = encode_cache(cache, fp, prompt_ids, press, options=EncodeOptions(codec, 1, shuffle, chunk_size))
    return manifest, list(chunks)


@pytest.mark.parametrize("codec, shuffle", CODECS, ids=["none", "zstd", "zstd+shuffle"])
@pytest.mark.parametrize("kind", PRESSES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_round_trip_is_bit_exact(caches, tiny_fp, prompt_ids, kind, dtype, codec, shuffle):
    cache, press = caches[kind, dtype]
    manifest, chunks = encoded(cache, press, tiny_fp, prompt_ids, codec, shuffle)
    assert len(chunks) == manifest.encoding.chunk_count > 1
    assert manifest.encoding.encoded_bytes == sum(len(c.data) for c in chunks)
    assert_same_caches(decode_chunks(manifest, chunks), cache)


def test_chunks_hold_whole_rows_and_respect_the_chunk_size(caches, tiny_fp, prompt_ids):
    cache, press = caches["dense", mx.float32]
    manifest, chunks = encoded(cache, press, tiny_fp, prompt_ids, chunk_size=10_000)
    row = 2 * 64 * 4  # kv heads x head dim x float32
    assert all(c.raw_length % row == 0 and c.raw_length <= 10_000 for c in chunks)
    assert sum(c.raw_length for c in chunks) == manifest.encoding.raw_bytes


def test_encoding_twice_gives_the_same_id_and_digest(caches, tiny_fp, prompt_ids):
    cache, press = caches["sparse", mx.float32]
    a, _ = encoded(cache, press, tiny_fp, prompt_ids)
    b, _ = encoded(cache, press, tiny_fp, prompt_ids)
    assert a.encoding.payload_digest == b.encoding.payload_digest
    assert content_id(a) == content_id(b)


def test_one_thread_and_two_encode_the_same(caches, tiny_fp, prompt_ids):
    cache, press = caches["dense", mx.bfloat16]
    manifest = build_manifest(cache, tiny_fp, PrefixKey.of(prompt_ids), press, options=EncodeOptions(chunk_size=8192))
    one = [c.frame() for c in encode_chunks(cache, manifest, threads=1)]
    two = [c.frame() for c in encode_chunks(cache, manifest, threads=2)]
    assert one == two


def test_a_result_goes_out_once_it_is_done_and_the_next_item_has_come():
    """ordered_map hands on each result, in order, once it is done and the next item has come (a
    fetch's coded layer decodes as soon as its chunk is out), not only once 2x threads items are in
    flight: items that come one at a time, each after the last one's work ran, as chunks off a wire."""
    ran = [threading.Event() for _ in range(6)]
    out: list[int] = []
    out_before_the_last_item: list[int] = []

    def work(i: int) -> int:
        ran[i].set()
        return i

    def arriving():
        for i in range(6):
            if i == 5:
                out_before_the_last_item.append(len(out))
            yield i
            assert ran[i].wait(timeout=60)

    for result in ordered_map(work, arriving(), threads=2):
        out.append(result)
    assert out == list(range(6))
    # Results 0-3 had run when item 5 was asked for: three at least were handed on (the last check
    # may come before its worker marks it done); waiting for 2x threads in flight handed on two.
    assert out_before_the_last_item[0] >= 3


def test_an_item_picked_to_run_inline_goes_out_before_the_next_item_is_asked_for():
    """An item `inline` picks, when nothing is in flight, runs on the caller's thread and goes out
    at once (a coded layer's chunk: its layer starts to decode before the next chunk comes off the
    wire); the others still run on the pool, and every result comes out in order."""
    asked: list[int] = []
    out: list[tuple[int, int, bool]] = []  # (result, items asked for by then, ran on the caller's thread)
    caller = threading.get_ident()

    def work(i: int) -> tuple[int, bool]:
        return i, threading.get_ident() == caller

    def arriving():
        for i in range(8):
            asked.append(i)
            yield i

    for i, here in ordered_map(work, arriving(), threads=2, inline=lambda i: i % 2 == 0):
        out.append((i, len(asked), here))
    assert [i for i, _, _ in out] == list(range(8))
    # Item 0 is inline and nothing is in flight: out before item 1 was asked for.
    assert out[0] == (0, 1, True)
    assert not any(here for i, _, here in out if i % 2)  # the others ran on the pool


@pytest.fixture
def stream(caches, tiny_fp, prompt_ids):
    cache, press = caches["dense", mx.bfloat16]
    return encoded(cache, press, tiny_fp, prompt_ids)


def feed_all(manifest, chunks):
    decoder = CacheDecoder(manifest)
    decoder.feed_all(chunks, threads=1)
    return decoder.finish()


def test_corrupt_chunk(stream):
    manifest, chunks = stream
    data = bytearray(chunks[3].data)
    data[len(data) // 2] ^= 0x01
    chunks[3].data = bytes(data)
    with pytest.raises(IntegrityError, match="chunk 3 (is corrupt|is not valid zstd data)"):
        feed_all(manifest, chunks)


def test_corrupt_chunk_without_compression(caches, tiny_fp, prompt_ids):
    cache, press = caches["dense", mx.float32]
    manifest, chunks = encoded(cache, press, tiny_fp, prompt_ids, codec="none")
    chunks[2].data = chunks[2].data[:-1] + bytes([chunks[2].data[-1] ^ 0x80])
    with pytest.raises(IntegrityError, match="chunk 2 is corrupt: its checksum does not match"):
        feed_all(manifest, chunks)


def test_truncated_stream(stream):
    manifest, chunks = stream
    with pytest.raises(IntegrityError, match=f"truncated: {len(chunks) - 1} of {len(chunks)} chunks"):
        feed_all(manifest, chunks[:-1])


def test_reordered_chunks(stream):
    manifest, chunks = stream
    chunks[1], chunks[2] = chunks[2], chunks[1]
    with pytest.raises(IntegrityError, match="chunk 2 arrived where chunk 1 was expected"):
        feed_all(manifest, chunks)


def test_duplicated_chunk(stream):
    manifest, chunks = stream
    with pytest.raises(IntegrityError, match="chunk 4 arrived where chunk 5 was expected"):
        feed_all(manifest, chunks[:5] + [chunks[4]] + chunks[5:])


def test_extra_chunk(stream):
    manifest, chunks = stream
    extra = replace(chunks[-1], index=len(chunks))
    with pytest.raises(IntegrityError, match=f"beyond the {len(chunks)} the manifest announced"):
        feed_all(manifest, chunks + [extra])


def test_oversized_chunk(stream):
    manifest, chunks = stream
    chunks[0].data = chunks[0].data + bytes(2 * chunks[0].raw_length)
    with pytest.raises(IntegrityError, match="chunk 0 is oversized"):
        feed_all(manifest, chunks)


def test_chunk_that_lies_about_its_place(stream):
    manifest, chunks = stream
    chunks[1].byte_offset += 256
    with pytest.raises(IntegrityError, match="chunk 1 claims tensor 0 bytes"):
        feed_all(manifest, chunks)


def test_chunk_that_decodes_to_another_length(caches, tiny_fp, prompt_ids):
    """Right place, plausible size, but the zstd frame holds other than the announced length."""
    manifest, chunks = encoded(*caches["dense", mx.float32], tiny_fp, prompt_ids)
    _, other = encoded(*caches["dense", mx.float32], tiny_fp, prompt_ids, chunk_size=4096)
    chunks[0].data = other[0].data
    with pytest.raises(IntegrityError, match="chunk 0 decodes to 4096 bytes, 8192 were announced"):
        feed_all(manifest, chunks)


def test_wrong_manifest_digest(stream):
    manifest, chunks = stream
    manifest.encoding.payload_digest = b"\xff" * 16
    with pytest.raises(IntegrityError, match="payload digest does not match"):
        feed_all(manifest, chunks)


def test_chunk_plan_covers_every_byte_once(stream):
    manifest, _ = stream
    plan = chunk_plan(manifest)
    for tensor, slots in itertools.groupby(plan, key=lambda s: s.tensor):
        offset = 0
        for slot in slots:
            assert slot.byte_offset == offset
            offset += slot.raw_length
        assert offset == [t for layer in manifest.layers for t in layer.tensors][tensor].nbytes


def test_decoding_on_two_threads_gives_the_same_caches(stream, caches):
    manifest, chunks = stream
    assert_same_caches(decode_chunks(manifest, chunks, threads=2), caches["dense", mx.bfloat16][0])


@pytest.mark.parametrize("damage", ["reorder", "corrupt"])
def test_decoding_on_two_threads_refuses_the_same_damage(stream, damage):
    manifest, chunks = stream
    if damage == "reorder":
        chunks[4], chunks[5] = chunks[5], chunks[4]
        expected = "chunk 5 arrived where chunk 4 was expected"
    else:
        chunks[6].checksum ^= 1
        expected = "chunk 6 is corrupt"
    with pytest.raises(IntegrityError, match=expected):
        decode_chunks(manifest, chunks, threads=2)


@pytest.mark.parametrize("codec, shuffle", CODECS, ids=["none", "zstd", "zstd+shuffle"])
@pytest.mark.parametrize("kind", ["dense", "quantized"])
def test_a_cut_prefix_is_the_fresh_encoding_of_that_prefix(caches, tiny_fp, prompt_ids, kind, codec, shuffle):
    """Cutting 128 of 300 tokens from the chunks gives exactly what encoding those 128 gives."""
    cache, press = caches[kind, mx.bfloat16]
    manifest, chunks = encoded(cache, press, tiny_fp, prompt_ids, codec, shuffle, chunk_size=5000)
    records = [c.frame() for c in chunks]
    cut, stream = cut_prefix(manifest, lambda: iter(records), 128)
    cut_chunks = [parse_frame(r) for r in stream]
    fresh, fresh_chunks = encoded(
        [truncate(c, 128) for c in cache], press, tiny_fp, prompt_ids[:128], codec, shuffle, chunk_size=5000
    )
    assert cut.cache_id == content_id(fresh) and cut.encoding == fresh.encoding
    assert [c.frame() for c in cut_chunks] == [c.frame() for c in fresh_chunks]
    assert_same_caches(decode_chunks(cut, cut_chunks), [truncate(c, 128) for c in cache])


def test_a_cut_refuses_what_it_cannot_serve_and_damage_it_reads(caches, tiny_fp, prompt_ids):
    sparse, _ = encoded(*caches["sparse", mx.float32], tiny_fp, prompt_ids)
    with pytest.raises(ValueError, match="evicted tokens"):
        cut_prefix(sparse, lambda: iter(()), 128)
    manifest, chunks = encoded(*caches["dense", mx.float32], tiny_fp, prompt_ids, chunk_size=5000)
    with pytest.raises(ValueError, match="multiples of 128"):
        cut_prefix(manifest, lambda: iter(()), 100)
    # A blockwise cache's chunks end at block edges: a block-aligned cut re-encodes none of them.
    assert not [s for s in chunk_plan(manifest) if s.byte_offset < 128 * s.row_bytes < s.byte_offset + s.raw_length]
    # A cache made before caches went by blocks (stores still hold them) has chunks across the cut:
    # a partial chunk (re-encoded by the cut) whose bytes do not match its checksum is refused.
    cache, press = caches["dense", mx.float32]
    manifest = build_manifest(
        cache, tiny_fp, PrefixKey.of(prompt_ids), press, options=EncodeOptions("zstd", 1, True, 5000)
    )
    manifest.encoding.block_rows = 0
    manifest.encoding.chunk_count = chunk_count(manifest)
    chunks = list(encode_chunks(cache, manifest))
    partial = next(
        i
        for i, s in enumerate(chunk_plan(manifest))
        if s.byte_offset < 128 * s.row_bytes < s.byte_offset + s.raw_length
    )
    chunks[partial].checksum ^= 1
    records = [c.frame() for c in chunks]
    with pytest.raises(IntegrityError, match=f"chunk {partial} is corrupt"):
        cut_prefix(manifest, lambda: iter(records), 128)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
def test_a_number_that_is_not_finite_is_refused_in_every_float_dtype(tiny_fp, dtype):
    """NaN, +inf and -inf in a tensor sent as it is fail the transfer; a tensor holding the dtype's
    largest and smallest numbers, -0 and subnormals passes (the check reads the exponent bits)."""
    info = {mx.float16: (65504.0, 2.0**-24), mx.bfloat16: (3.3895e38, 2.0**-133), mx.float32: (3.4028e38, 2.0**-149)}
    largest, tiniest = info[dtype]
    keys = mx.zeros((1, 2, 64, 16), dtype)
    edges = mx.array([largest, -largest, tiniest, -tiniest, -0.0, 1.0]).astype(dtype)
    keys[0, 1, 7, :6] = edges
    assert bool(mx.isfinite(keys).all())
    manifest, chunks = encode_cache([SparseKVCache.from_arrays(keys, keys, 64)], tiny_fp, list(range(64)))
    decoded = decode_chunks(manifest, list(chunks))
    assert mx.array_equal(decoded[0].keys_and_values()[0], keys)
    for bad in (mx.nan, mx.inf, -mx.inf):
        values = mx.zeros((1, 2, 64, 16), dtype)
        values[0, 0, 63, 15] = bad
        manifest, chunks = encode_cache([SparseKVCache.from_arrays(keys, values, 64)], tiny_fp, list(range(64)))
        with pytest.raises(IntegrityError, match=r"tensor 1 \(values\) of the cache holds NaN or infinite"):
            decode_chunks(manifest, list(chunks))
