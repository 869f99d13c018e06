"""Transform-coded caches on the wire and in the store: the manifest says everything a receiver checks
before any byte, a coded cache decodes into mlx-lm's own classes, and every part that does not fit
(another basis, a missing one, a manifest that lies) is refused with its reason."""

import hashlib
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import zstandard

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.basis import BasisError
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.chunks import Chunk, parse_frame
from kvmesh.codec.coded import CodedLayer, TransformCoding, decoded, parse_basis, transform_code
from kvmesh.codec.compat import ReceiverProfile, basis_problem, check_manifest, quality_problem, validate_manifest
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.codec.layer_blob import read_header
from kvmesh.codec.manifest import layer_codec, layer_report, lossy, uncuttable_reason
from kvmesh.codec.transform_decode import decode_layer
from kvmesh.errors import IntegrityError, StoreError
from kvmesh.store.artifacts import ArtifactStore
from kvmesh.v1 import cache_pb2 as pb
from support.references import rounded_alike, same_tensors


@pytest.fixture(scope="module")
def calibrated(tiny):
    """The tiny model's basis, fitted the way `kvmesh model calibrate` fits it (Python's help topics)."""
    model, tokenizer = tiny
    return fit_model_basis(model, tokenizer, tokens_per_text=400)


@pytest.fixture(scope="module")
def coded(tiny, calibrated, prompt_ids):
    """(full cache, coded cache list) of the 300-token prompt, at a fine step."""
    model, _ = tiny
    full = prefill(model, prompt_ids, make_press("full")).cache
    return full, transform_code(full, TransformCoding(calibrated.basis, step=0.02))


@pytest.fixture(scope="module")
def wire(coded, tiny_fp, prompt_ids):
    """The coded cache's manifest and chunks."""
    _, cache = coded
    manifest, chunks = encode_cache(cache, tiny_fp, prompt_ids)
    return manifest, list(chunks)


def test_the_calibration_covers_every_full_attention_layer(tiny, calibrated):
    model, _ = tiny
    basis = calibrated.basis
    assert basis.info["layers"] == list(range(len(model.layers)))
    assert calibrated.tokens == 4 * 400
    assert basis.nbytes == len(basis.to_bytes()) and basis.digest == hashlib.sha256(basis.to_bytes()).hexdigest()


def test_the_manifest_states_the_codec_and_the_basis(coded, wire, calibrated):
    _, cache = coded
    manifest, _ = wire
    assert all(isinstance(layer, CodedLayer) for layer in cache)
    assert [a.sha256 for a in manifest.artifacts] == [calibrated.basis.digest]
    assert manifest.artifacts[0].kind == "transform-basis" and manifest.artifacts[0].nbytes == calibrated.basis.nbytes
    for layer in manifest.layers:
        assert layer.kind == pb.CACHE_KIND_TRANSFORM_KV and layer.n_kept == layer.offset == 300
        t = layer.transform
        assert t.basis_sha256 == calibrated.basis.digest
        assert (t.kv_heads, t.head_dim) == (manifest.num_kv_heads, manifest.head_dim)
        factors = calibrated.basis.info["steps"]  # each tensor's step: the global one times its factor
        assert t.key_step == pytest.approx(0.02 * factors["k"][t.basis_layer])
        assert t.value_step == pytest.approx(0.02 * factors["v"][t.basis_layer])
        assert 0 < t.value_components <= t.kv_heads * t.head_dim
        assert t.rotary.dims == manifest.head_dim and t.rotary.HasField("base")
    assert validate_manifest(manifest) is None
    # Its layers are entropy coded: no zstd over them, whatever the options ask (zstd by default).
    assert manifest.encoding.codec == pb.CODEC_NONE and manifest.encoding.encoded_bytes == manifest.encoding.raw_bytes
    assert lossy(manifest)
    assert uncuttable_reason(manifest) is None  # each position's row is coded: shorter prefixes are cut
    assert all(row["codec"].startswith("transform k ") for row in layer_report(manifest))
    # Smaller than the float32 cache's fp16 size even at this fine step.
    fp16 = 2 * 2 * 300 * manifest.num_kv_heads * manifest.head_dim * manifest.num_layers
    assert manifest.encoding.raw_bytes < fp16


def test_a_coded_cache_decodes_into_mlx_lm_classes_and_runs(tiny, coded, wire, calibrated, prompt_ids):
    model, _ = tiny
    full, cache = coded
    manifest, chunks = wire
    bases = {calibrated.basis.digest: calibrated.basis}
    got = decode_chunks(manifest, chunks, bases=bases)
    local = decoded(cache)
    for layer, same, dense in zip(got, local, full, strict=True):
        assert type(layer) is SparseKVCache and layer.keys.dtype == mx.float32
        keys, values = layer.keys_and_values()
        assert keys.shape == dense.keys_and_values()[0].shape and keys.shape[2] == 300
        assert mx.array_equal(keys, same.keys_and_values()[0]) and mx.array_equal(values, same.keys_and_values()[1])
    probe = mx.array(prompt_ids[-8:])[None]
    want = model(probe, cache=[_fork(c) for c in full])[0]
    have = model(probe, cache=[_fork(c) for c in got])[0]
    lp_w, lp_h = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (want, have))
    assert (mx.exp(lp_w) * (lp_w - lp_h)).sum(-1).mean().item() < 0.01


def test_a_coded_layer_decodes_alike_from_one_chunk_or_several(coded, wire, calibrated, tiny_fp, prompt_ids):
    """A layer's blob in one chunk is decoded from where its chunk's check left it; a blob split over
    several chunks is put together first: the same caches either way."""
    _, cache = coded
    manifest, chunks = wire
    assert len(chunks) == len(manifest.layers)  # (each layer's blob in one chunk)
    third = min(layer.tensors[0].nbytes for layer in manifest.layers) // 3
    split, split_chunks = encode_cache(cache, tiny_fp, prompt_ids, options=EncodeOptions(chunk_size=third))
    split_chunks = list(split_chunks)
    assert len(split_chunks) >= 3 * len(manifest.layers)
    bases = {calibrated.basis.digest: calibrated.basis}
    assert same_tensors(decode_chunks(manifest, chunks, bases=bases), decode_chunks(split, split_chunks, bases=bases))


def test_a_coded_cache_from_an_older_kvmesh_with_zstd_over_its_layers_decodes_alike(coded, wire, calibrated):
    """Before, a coded cache's chunks were zstd-coded like any other, and byte-shuffled when its
    dtype asked (bfloat16): such a cache, from an older peer or store, decodes as before."""
    manifest, chunks = wire
    older = pb.CacheManifest()
    older.CopyFrom(manifest)
    older.encoding.codec, older.encoding.level, older.encoding.byte_shuffle = pb.CODEC_ZSTD, 1, True
    compressor = zstandard.ZstdCompressor(level=1)
    older_chunks = [
        Chunk(c.index, c.tensor, c.byte_offset, c.raw_length, c.checksum, compressor.compress(bytes(c.data)))
        for c in chunks
    ]
    older.encoding.encoded_bytes = sum(len(c.data) for c in older_chunks)
    bases = {calibrated.basis.digest: calibrated.basis}
    assert same_tensors(decode_chunks(manifest, chunks, bases=bases), decode_chunks(older, older_chunks, bases=bases))


def _fork(layer):
    from kvmesh.caches.kinds import fork

    return fork(layer)


def test_without_its_basis_a_coded_cache_does_not_decode_and_nothing_is_kept(wire, tmp_path):
    from kvmesh.codec.decode import CacheDecoder
    from kvmesh.store import CacheStore

    manifest, chunks = wire
    with pytest.raises(IntegrityError, match="no basis"):
        decode_chunks(manifest, chunks)
    store = CacheStore(tmp_path / "store")
    with pytest.raises(IntegrityError, match="does not decode"):
        store.add(manifest, CacheDecoder(manifest).feed_iter(chunks))
    assert store.entries() == []


def test_another_basis_is_refused_before_any_byte(tiny, wire, calibrated):
    manifest, _ = wire
    model, tokenizer = tiny
    other = fit_model_basis(model, tokenizer, {"other": "a b c d e f g " * 200}, tokens_per_text=200).basis
    # Other bytes offered under the named id are refused by their sha256; decoded with, they fail.
    with pytest.raises(BasisError, match="do not match their id"):
        parse_basis(other.to_bytes(), calibrated.basis.digest)
    with pytest.raises(IntegrityError, match="does not decode"):
        decode_chunks(manifest, wire[1], bases={calibrated.basis.digest: other})
    tampered = pb.CacheManifest()
    tampered.CopyFrom(manifest)
    tampered.layers[0].transform.rotary.base += 1.0
    rejection = basis_problem(tampered, calibrated.basis)
    assert rejection.reason == pb.REJECT_REASON_ARTIFACT and "rotary" in rejection.message
    tampered.CopyFrom(manifest)
    tampered.layers[1].transform.basis_layer = 7
    assert "basis layer 7" in basis_problem(tampered, calibrated.basis).message


def _tail(m: pb.CacheManifest, rows: int, *, schema: int = 3, step: float = 0.01, components: int = 8) -> None:
    """A tail stated for layer 0."""
    m.schema_version = schema
    t = m.layers[0].transform
    t.tail, t.key_tail_step, t.value_tail_step = rows, step, step
    t.key_tail_components = t.value_tail_components = components


@pytest.mark.parametrize(
    "damage, reason, words",
    [
        (lambda m: m.ClearField("artifacts"), pb.REJECT_REASON_MALFORMED, "name bases"),
        (lambda m: setattr(m.artifacts[0], "sha256", "zz" * 32), pb.REJECT_REASON_ARTIFACT, "artefact"),
        (lambda m: setattr(m.artifacts[0], "nbytes", 1 << 40), pb.REJECT_REASON_ARTIFACT, "at most"),
        (lambda m: setattr(m.layers[0].transform, "value_step", 0.0), pb.REJECT_REASON_MALFORMED, "steps"),
        (lambda m: setattr(m.layers[0].transform, "key_components", 10**6), pb.REJECT_REASON_MALFORMED, "components"),
        (lambda m: setattr(m.layers[0].transform, "kv_heads", 7), pb.REJECT_REASON_MALFORMED, "7x"),
        (lambda m: m.layers[0].transform.rotary.freqs.append(1.0), pb.REJECT_REASON_MALFORMED, "rotary"),
        (lambda m: setattr(m.layers[0], "n_kept", 301), pb.REJECT_REASON_MALFORMED, "301 kept of offset 300"),
        (lambda m: setattr(m.layers[0].tensors[0], "name", "keys"), pb.REJECT_REASON_MALFORMED, "uint8 `coded`"),
        (lambda m: _tail(m, 10, schema=2), pb.REJECT_REASON_MALFORMED, "a tail of 10 rows in a schema 2 manifest"),
        (lambda m: _tail(m, 10, step=0.0), pb.REJECT_REASON_MALFORMED, "transform steps 0.0/"),
        (lambda m: _tail(m, 10, components=10**6), pb.REJECT_REASON_MALFORMED, "components 1000000/"),
        (lambda m: _tail(m, 300), pb.REJECT_REASON_MALFORMED, "1 sink, 300 tail and 0 recent rows of 300"),
    ],
)
def test_a_manifest_that_lies_about_its_coding_is_refused(wire, damage, reason, words):
    manifest = pb.CacheManifest()
    manifest.CopyFrom(wire[0])
    damage(manifest)
    rejection = validate_manifest(manifest)
    assert rejection is not None and rejection.reason == reason and words in rejection.message


def test_a_quality_floor_counts_the_codec_as_lossy(wire, tiny_fp, prompt_ids):
    manifest, _ = wire
    rejection = check_manifest(manifest, ReceiverProfile(tiny_fp, max_kl=0.01))
    assert rejection.reason == pb.REJECT_REASON_QUALITY and "full + transform" in rejection.message
    measured = pb.CacheManifest()
    measured.CopyFrom(manifest)
    measured.quality.CopyFrom(pb.Quality(metric="tail_kl", value=0.001, tokens=32))
    assert quality_problem(measured, 0.01) is None


def test_quantized_layers_travel_as_before(tiny, calibrated, prompt_ids, tiny_fp):
    """Quantized layers are left as the press made them: no basis is named."""
    model, _ = tiny
    press = make_press("quantize", {"kv_bits": 8})
    pressed = prefill(model, prompt_ids, press).cache
    cache = transform_code(pressed, TransformCoding(calibrated.basis, step=0.02))
    assert all(type(layer) is SparseQuantizedKVCache for layer in cache)
    manifest, _ = encode_cache(cache, tiny_fp, prompt_ids, press)
    assert not manifest.artifacts


@pytest.mark.parametrize(
    "method, config",
    [
        ("kvzip", {"ratio": 0.5}),
        ("snapkv", {"ratio": 0.5, "window": 16}),
        ("streaming_llm", {"budget": 96, "sinks": 0}),
    ],
)
def test_an_evicting_press_then_the_codec_compose(tiny, calibrated, prompt_ids, tiny_fp, method, config):
    """The press's kept positions travel in each layer's blob (RoPE comes off each key at its own
    position), the manifest says how many it kept of the prefix, and the receiver gets the press's
    sparse cache back, transform coded: its predictions those of the pressed cache. Positions that
    are one run (StreamingLLM without sinks keeps the last 96) travel as where the run starts."""
    model, _ = tiny
    press = make_press(method, config)
    pressed = prefill(model, prompt_ids, press).cache
    cache = transform_code(pressed, TransformCoding(calibrated.basis, step=0.02))
    assert all(isinstance(layer, CodedLayer) for layer in cache)
    assert any(layer.n_kept < 300 for layer in cache) and all(layer.offset == 300 for layer in cache)
    for layer, source in zip(cache, pressed, strict=True):
        kept = np.asarray(source.kept_positions())
        assert np.array_equal(blob_positions(layer.blob).reshape(kept.shape), kept)
    manifest, chunks = encode_cache(cache, tiny_fp, prompt_ids, press)
    assert validate_manifest(manifest) is None and "evicted" in uncuttable_reason(manifest)
    assert [layer.n_kept for layer in manifest.layers] == [layer.n_kept for layer in pressed]
    assert [(row["kept"], row["of"]) for row in layer_report(manifest)] == [(c.n_kept, 300) for c in pressed]
    got = decode_chunks(manifest, chunks, bases={calibrated.basis.digest: calibrated.basis})
    probe = mx.array(prompt_ids[-8:])[None]
    want = model(probe, cache=[_fork(c) for c in pressed])[0]
    have = model(probe, cache=[_fork(c) for c in got])[0]
    for part, source in zip(got, pressed, strict=True):
        assert type(part) is SparseKVCache and (part.n_kept, part.offset) == (source.n_kept, 300)
    lp_w, lp_h = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (want, have))
    assert (mx.exp(lp_w) * (lp_w - lp_h)).sum(-1).mean().item() < 0.01


@pytest.mark.parametrize(("recent", "tail"), [(0, 0), (200, 0), (0, 64), (100, 64)])
@pytest.mark.parametrize("num_tokens", [128, 256])
def test_a_shorter_prefix_of_a_coded_cache_decodes_as_that_prefix_of_the_whole(
    coded, calibrated, tiny_fp, prompt_ids, recent, tail, num_tokens
):
    """Cut from the stored chunks (kvmesh.codec.cut), the prefix decodes to the first rows of the
    whole cache's decoding (array-equal where BLAS rounds rows alike whatever their count:
    `rounded_alike`); with 200 raw recent rows a cut at 128 or 256 reaches into
    them (the coded rows end at 100). With a tail of 64 finer rows (236-299, or 136-199 before 100
    raw ones), a cut at 256 keeps part or all of it and one at 128 none."""
    full, _ = coded
    cache = transform_code(
        full, TransformCoding(calibrated.basis, step=0.12, recent=recent, tail=tail, tail_factor=0.25)
    )
    manifest, chunks = encode_cache(cache, tiny_fp, prompt_ids)
    assert manifest.schema_version == (3 if tail else 2)
    assert all(layer.transform.tail == tail for layer in manifest.layers)
    assert all((f", last {tail} rows k " in row["codec"]) == bool(tail) for row in layer_report(manifest))
    assert all(row["codec"].endswith(", 1 sink raw") for row in layer_report(manifest))
    four = pb.CacheManifest()
    four.CopyFrom(manifest)
    four.layers[0].transform.sinks = 4
    assert layer_codec(four.layers[0]).endswith(", 4 sinks raw")
    manifest.quality.CopyFrom(pb.Quality(metric="tail_kl", value=0.001, tokens=32))  # as a producer measures it
    records = [c.frame() for c in chunks]
    bases = {calibrated.basis.digest: calibrated.basis}
    whole = decode_chunks(manifest, map(parse_frame, records), bases=bases)
    cut, stream = cut_prefix(manifest, lambda: iter(records), num_tokens)
    assert validate_manifest(cut) is None and cut.prefix.num_tokens == num_tokens
    kept_tail = max(0, min(num_tokens, 300 - recent) - (300 - recent - tail))
    assert all(layer.transform.tail == kept_tail for layer in cut.layers)
    # The whole's loss was measured at its end: a shorter prefix does not claim it. One that keeps no
    # tail rows is written in schema 2 (a kvmesh before the tail reads it).
    assert not cut.HasField("quality") and cut.schema_version == (3 if kept_tail else 2)
    assert cut.encoding.encoded_bytes < manifest.encoding.encoded_bytes
    got = decode_chunks(cut, map(parse_frame, stream), bases=bases)
    for part, layer in zip(got, whole, strict=True):
        assert type(part) is SparseKVCache and part.offset == num_tokens
        for mine, theirs in zip(part.keys_and_values(), layer.keys_and_values(), strict=True):
            assert mine.shape[2] == num_tokens and rounded_alike(mine, theirs[:, :, :num_tokens])


def test_a_coded_entry_serves_a_shorter_prefix_from_the_store(wire, coded, calibrated, prompt_ids, tmp_path):
    from kvmesh.reuse.find import load_prefix
    from kvmesh.store import CacheStore

    manifest, chunks = wire
    store = CacheStore(tmp_path / "store")
    ArtifactStore(store.root / "artifacts").put(calibrated.basis.to_bytes(), calibrated.basis.digest)
    store.add(manifest, chunks)
    (entry,) = store.entries()
    assert entry.cuttable
    match = store.lookup(entry.model_id, prompt_ids[:280] + [7] * 40)
    assert match is not None and (match.entry.cache_id, match.tokens) == (manifest.cache_id, 256)
    assert store.exact_only(entry.model_id, prompt_ids[:280] + [7] * 40) is None
    got = load_prefix(store, manifest.cache_id, 256)
    for part, layer in zip(got, decoded(coded[1]), strict=True):
        for mine, theirs in zip(part.keys_and_values(), layer.keys_and_values(), strict=True):
            assert rounded_alike(mine, theirs[:, :, :256])


def blob_positions(blob: bytes) -> np.ndarray:
    """The positions a layer's blob says its rows hold: listed, or a run from `start`."""
    header, body = read_header(blob)
    positions = header["positions"]
    if "start" in positions:
        _, heads, rows, _ = header["shape"]
        return np.broadcast_to(np.arange(positions["start"], positions["start"] + rows), (heads, rows))
    at, length = header["segments"][positions["seg"][0]]
    return np.frombuffer(zstandard.ZstdDecompressor().decompress(body[at : at + length]), "<i4")


def test_layer_blobs_decode_alone(coded, calibrated):
    _, cache = coded
    keys, values = decode_layer(cache[1].blob, calibrated.basis)
    assert keys.shape == values.shape and keys.shape[2] == 300 and keys.dtype == mx.float32  # the cache's


def test_the_artifact_store_checks_what_it_keeps(tmp_path, calibrated):
    store = ArtifactStore(tmp_path / "artifacts")
    data, digest = calibrated.basis.to_bytes(), calibrated.basis.digest
    assert store.get(digest) is None and store.model_basis("m1") is None
    with pytest.raises(IntegrityError, match="do not match"):
        store.put(data[:-1], digest)
    store.put(data, digest)
    assert store.get(digest) == data
    store.set_model_basis("m1", digest)
    assert store.model_basis("m1") == digest
    damaged = bytearray(data)
    damaged[100] ^= 1
    store.path(digest).write_bytes(bytes(damaged))
    with pytest.raises(IntegrityError, match="damaged"):
        store.get(digest)
    assert not store.has(digest) and store.model_basis("m1") is None
    with pytest.raises(StoreError, match="not an artefact id"):
        store.get("../../etc/passwd")


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-qwen3.5"])
def test_in_mixed_models_only_full_attention_layers_are_coded(preset, tmp_path):
    """Sliding windows and recurrent state travel as before beside coded full-attention layers, and
    come back as mlx-lm's classes."""
    import mlx_lm
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from kvmesh.model.fingerprint import fingerprint
    from kvmesh.model.testmodels import make_test_model

    model_dir = make_test_model(tmp_path / preset, preset)
    model, tokenizer = mlx_lm.load(str(model_dir))
    basis = fit_model_basis(model, tokenizer, tokens_per_text=200).basis
    kinds = [type(c) for c in make_prompt_cache(model)]
    assert basis.info["layers"] == [i for i, kind in enumerate(kinds) if kind is KVCache]
    ids = tokenizer.encode("The river runs to the sea and the sea runs to the sky. " * 12)[:150]
    full = prefill(model, ids, make_press("full")).cache
    cache = transform_code(full, TransformCoding(basis, step=0.1))
    assert [isinstance(c, CodedLayer) for c in cache] == [kind is KVCache for kind in kinds]
    manifest, chunks = encode_cache(cache, fingerprint(model_dir), ids)
    assert manifest.encoding.codec == pb.CODEC_ZSTD  # (for the windows and the state beside the coded layers)
    got = decode_chunks(manifest, list(chunks), bases={basis.digest: basis})
    assert [type(c) for c in got] == [SparseKVCache if kind is KVCache else kind for kind in kinds]
    logits = model(mx.array(ids[-4:])[None], cache=[_fork(c) for c in got])
    assert bool(mx.isfinite(logits).all())


@pytest.mark.parametrize("preset", ["tiny-falcon-h1", "tiny-llama4"])
def test_a_model_without_codable_layers_says_so(preset, tmp_path):
    import mlx_lm

    from kvmesh.codec.calibration import NothingToCode
    from kvmesh.model.testmodels import make_test_model

    model, tokenizer = mlx_lm.load(str(make_test_model(tmp_path / preset, preset)))
    with pytest.raises(NothingToCode, match="nothing to code"):
        fit_model_basis(model, tokenizer, tokens_per_text=100)


def test_a_receiver_may_ask_for_coded_layers_quantized(tiny, wire, calibrated, prompt_ids):
    from kvmesh.codec.decode import CacheDecoder

    model, _ = tiny
    manifest, chunks = wire
    decoder = CacheDecoder(manifest, {calibrated.basis.digest: calibrated.basis}, quantize_bits=8)
    decoder.feed_all(chunks)
    cache = decoder.finish()
    assert all(type(c) is SparseQuantizedKVCache and c.bits == 8 and c.offset == 300 for c in cache)
    plain = decode_chunks(manifest, chunks, bases={calibrated.basis.digest: calibrated.basis})
    probe = mx.array(prompt_ids[-8:])[None]
    a, b = (model(probe, cache=[_fork(c) for c in x])[0] for x in (plain, cache))
    lp_a, lp_b = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (a, b))
    assert (mx.exp(lp_a) * (lp_a - lp_b)).sum(-1).mean().item() < 0.01


def rebuilt(blob: bytes, change=None, segment: int | None = None, data: bytes = b"") -> bytes:
    """A layer blob with its header changed (`change(header)`) and/or one segment's bytes replaced,
    as a sender that lies or errs would send it."""
    import json
    import struct

    from kvmesh.codec.layer_blob import MAGIC, read_header

    header, body = read_header(blob)
    segments = [bytes(body[at : at + n]) for at, n in header["segments"]]
    if segment is not None:
        segments[segment] = data
    offsets, at = [], 0
    for seg in segments:
        offsets.append([at, len(seg)])
        at += len(seg)
    header["segments"] = offsets
    if change:
        change(header)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + b"".join(segments)


def test_a_blob_that_disagrees_with_its_manifest_is_refused_before_any_allocation(coded, wire, calibrated):
    import zstandard

    from kvmesh.codec.coded import decode_coded
    from kvmesh.codec.layer_blob import TransformCodecError, read_header

    _, cache = coded
    manifest, _ = wire
    spec, blob = manifest.layers[0], cache[0].blob
    bases = {calibrated.basis.digest: calibrated.basis}

    def longer(header):
        header["shape"][2] = 10**9  # a billion tokens, from a few kilobytes

    with pytest.raises(TransformCodecError, match=r"disagrees with its manifest: shape \[1, 2, 1000000000"):
        decode_coded(spec, rebuilt(blob, longer), bases, mx.float32)

    def steps(header):
        header["v"]["step"] *= 2

    with pytest.raises(TransformCodecError, match="value_step"):
        decode_coded(spec, rebuilt(blob, steps), bases, mx.float32)
    # A segment that would inflate far past what its group can hold (a zstd bomb) is never inflated.
    header, _ = read_header(blob)
    plane = header["v"]["groups"][0][2][0]
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with pytest.raises(TransformCodecError, match="declares 67,108,864 bytes"):
        decode_coded(spec, rebuilt(blob, segment=plane, data=bomb), bases, mx.float32)


def test_a_basis_of_the_right_digest_but_malformed_is_refused_in_one_line(calibrated):
    import hashlib

    from kvmesh.codec.basis_file import FORMAT, read_safetensors, safetensors_bytes

    tensors, _, meta = read_safetensors(calibrated.basis.to_bytes())
    for broken_meta, broken_tensors, words in (
        ({"format": FORMAT}, tensors, "basis lacks rotaries"),
        ({**meta, "rotaries": "[{}]"}, tensors, "basis lacks dims"),
        ({**meta, "info": "not json"}, tensors, "unreadable basis metadata"),
        (meta, {**tensors, "layers.0.k.rms": tensors["layers.0.k.rms"][:3]}, "basis tensors layers.0.k."),
    ):
        data = safetensors_bytes(broken_tensors, broken_meta)
        with pytest.raises(BasisError, match=words):
            parse_basis(data, hashlib.sha256(data).hexdigest())


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts the process's threads in /proc")
def test_decoding_coded_caches_again_and_again_leaves_no_thread_behind(wire, calibrated):
    """MLX keeps a worker thread for every thread that evaluates on it: coded layers decode on the
    process's layer threads, so a daemon's hundredth coded fetch leaves as many threads as its
    first (a pool per fetch left one behind each)."""
    manifest, chunks = wire
    bases = {calibrated.basis.digest: calibrated.basis}
    decode_chunks(manifest, iter(chunks), bases=bases)
    before = len(os.listdir("/proc/self/task"))
    for _ in range(8):
        decode_chunks(manifest, iter(chunks), bases=bases)
    assert len(os.listdir("/proc/self/task")) <= before


def test_a_coded_layer_starts_to_decode_as_soon_as_its_chunk_is_in(wire, calibrated):
    """Each coded layer is handed to the layer threads before the next chunk is asked for: over a
    link, a layer decodes while the next arrives, not from when it has come."""
    from kvmesh.codec.decode import CacheDecoder

    manifest, chunks = wire
    decoder = CacheDecoder(manifest, {calibrated.basis.digest: calibrated.basis})
    started_before: list[int] = []  # coded layers handed out when each chunk was asked for

    def arriving():
        for chunk in chunks:
            started_before.append(len(decoder._decoding) + len(decoder.coded))
            yield chunk

    decoder.feed_all(arriving())
    assert len(started_before) == len(chunks) > 2
    assert started_before == list(range(len(chunks)))  # (one chunk per coded layer here)
    assert len(decoder.finish()) == len(manifest.layers)
