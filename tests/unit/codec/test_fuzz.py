"""Fuzzing what peers send: manifests and chunks. Runs briefly here; scripts/fuzz.py runs it longer.

What may happen to hostile input: a typed rejection (check_manifest) or an IntegrityError (chunks).
What must never happen: any other exception, an allocation the manifest did not justify, or a
decode that "succeeds" with bytes other than the original.
"""

import functools
import os
import random
from dataclasses import replace

import mlx.core as mx
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.caches.presses import Press, make_press
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.arrays import layer_tensors
from kvmesh.codec.compat import ReceiverProfile, check_manifest, validate_manifest
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.codec.manifest import chunk_plan
from kvmesh.errors import IntegrityError, Rejection
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.v1 import cache_pb2 as pb

EXAMPLES = int(os.environ.get("KVMESH_FUZZ_EXAMPLES", "150"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

FP = ModelFingerprint(
    model_id="f" * 16,
    model_type="llama",
    config_sha256="1" * 64,
    weights_sha256="2" * 64,
    tokenizer_sha256="3" * 64,
    chat_template_sha256="4" * 64,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="float16",
    rope_theta=1e4,
    rope_scaling_json="",
    sliding_window=0,
    repo_id="",
    revision="",
    mlx_version="0",
    mlx_lm_version="0",
)
PROFILE = ReceiverProfile(FP, max_bytes=64 << 20)
EDGE = [0, 1, 2, 3, 63, 64, 127, 128, 4096, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]
U64 = st.one_of(st.sampled_from(EDGE), st.integers(0, 2**64 - 1))
U32 = st.one_of(st.sampled_from([v for v in EDGE if v < 2**32]), st.integers(0, 2**32 - 1))


@functools.cache
def sample(kind: str, codec: str):
    """(cache, manifest, chunks) of a small two-layer cache; kind is dense, sparse or quantized."""
    mx.random.seed(0)
    n = 200
    cache = [
        SparseKVCache.from_arrays(
            mx.random.normal((1, 2, n, 64)).astype(mx.float16), mx.random.normal((1, 2, n, 64)).astype(mx.float16), 300
        )
        for _ in range(2)
    ]
    press = Press()
    if kind == "quantized":
        press = make_press("quantize", {"kv_bits": 4})
        cache = [c.to_quantized(64, 4) for c in cache]
    manifest, chunks = encode_cache(
        cache, FP, list(range(300)), press, options=EncodeOptions(codec=codec, chunk_size=8192)
    )
    return cache, manifest, list(chunks)


def copy_of(message):
    new = type(message)()
    new.CopyFrom(message)
    return new


# Flips keep protobuf's framing (most flipped manifests parse); the others mostly test the parser.
BYTE_EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flip"] * 6 + ["insert", "delete", "truncate"]), st.integers(0, 10**6), st.integers(1, 255)
    ),
    min_size=1,
    max_size=4,
)


def edit_bytes(data: bytes, edits) -> bytes:
    """A serialized manifest with bytes flipped, inserted, deleted or cut off: most of it still parses."""
    out = bytearray(data)
    for edit, at, value in edits:
        at %= len(out) + 1
        if edit == "flip" and at < len(out):
            out[at] ^= value
        elif edit == "insert":
            out[at:at] = bytes([value])
        elif edit == "delete":
            del out[at : at + value % 4 + 1]
        elif edit == "truncate":
            del out[at:]
    return bytes(out)


def outcome(data: bytes) -> Rejection | str | None:
    """What a receiver makes of these bytes as a manifest: unparseable, a typed rejection, or accept."""
    try:
        manifest = pb.CacheManifest.FromString(data)
    except DecodeError:
        return "unparseable"
    rejection = check_manifest(manifest, PROFILE)
    if rejection is None:
        # Accepted: then the manifest is consistent, and what it makes a receiver allocate is bounded.
        assert validate_manifest(manifest) is None
        assert manifest.encoding.raw_bytes <= PROFILE.max_bytes
    else:
        assert rejection.reason != pb.REJECT_REASON_UNSPECIFIED and rejection.message
    return rejection


@fuzz
@given(kind=st.sampled_from(["dense", "quantized"]), edits=BYTE_EDITS)
def test_edited_manifest_bytes_are_refused_with_a_reason_or_consistent(kind, edits):
    outcome(edit_bytes(sample(kind, "zstd")[1].SerializeToString(), edits))


def test_edited_manifest_bytes_reach_the_validator():
    """Flipped bytes must exercise the checks, not just the parser: most flipped manifests parse and
    get past the schema check into the consistency and model checks (the old any-bytes test had 0 of 2,000)."""
    rng = random.Random(0)
    data = sample("dense", "zstd")[1].SerializeToString()
    results = []
    for _ in range(300):
        edits = [("flip", rng.randrange(10**6), rng.randrange(1, 256)) for _ in range(rng.randint(1, 3))]
        results.append(outcome(edit_bytes(data, edits)))
    parsed = [r for r in results if r != "unparseable"]
    past_schema = [r for r in parsed if not (isinstance(r, Rejection) and r.reason == pb.REJECT_REASON_SCHEMA)]
    assert len(past_schema) > 100, f"only {len(past_schema)} of 300 edited manifests reached the validator"
    assert {r.reason_name for r in past_schema if isinstance(r, Rejection)} >= {"malformed", "weights"}


MUTABLE_INTS = {
    "num_layers": lambda m: m,
    "num_kv_heads": lambda m: m,
    "head_dim": lambda m: m,
    "encoding.chunk_size": lambda m: m.encoding,
    "encoding.chunk_count": lambda m: m.encoding,
    "encoding.raw_bytes": lambda m: m.encoding,
    "encoding.codec": lambda m: m.encoding,
    "prefix.num_tokens": lambda m: m.prefix,
    "prefix.block_size": lambda m: m.prefix,
    "layers.n_kept": lambda m: m.layers[0],
    "layers.offset": lambda m: m.layers[-1],
    "layers.bits": lambda m: m.layers[0],
    "layers.group_size": lambda m: m.layers[-1],
    "tensors.nbytes": lambda m: m.layers[0].tensors[-1] if m.layers[0].tensors else None,
}


@fuzz
@given(
    kind=st.sampled_from(["dense", "quantized"]),
    edits=st.lists(
        st.one_of(
            st.tuples(st.just("int"), st.sampled_from(sorted(MUTABLE_INTS)), U64),
            st.tuples(st.just("shape"), st.integers(0, 2), U64),
            st.tuples(
                st.just("enum"),
                st.sampled_from(["dtype", "kind", "tensor_dtype"]),
                st.one_of(st.integers(0, 6), st.integers(-(2**31), 2**31 - 1)),
            ),
            st.tuples(st.just("name"), st.just("tensor"), st.sampled_from(["", "keys", "keys.packed", "x" * 300])),
            st.tuples(st.just("drop"), st.sampled_from(["layer", "tensor", "block"]), st.just(0)),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_manifests_are_checked_without_surprises(kind, edits):
    _, manifest, _ = sample(kind, "zstd")
    m = copy_of(manifest)
    for edit, what, value in edits:
        if edit == "int":
            target, name = MUTABLE_INTS[what](m), what.rsplit(".", 1)[-1]
            if target is None:
                continue
            limit = (
                2**32 - 1
                if name
                in (
                    "num_layers",
                    "num_kv_heads",
                    "head_dim",
                    "chunk_size",
                    "chunk_count",
                    "block_size",
                    "bits",
                    "group_size",
                )
                else 2**64 - 1
            )
            setattr(target, name, value % (limit + 1) if name != "codec" else value % 4)
        elif edit == "shape" and m.layers[0].tensors:
            m.layers[0].tensors[0].shape[what] = value
        elif edit == "enum":
            if what == "dtype":
                m.dtype = value
            elif what == "kind":
                m.layers[-1].kind = value
            elif m.layers[0].tensors:
                m.layers[0].tensors[0].dtype = value
        elif edit == "name" and m.layers[0].tensors:
            m.layers[0].tensors[0].name = value
        elif what == "layer" and len(m.layers) > 1:
            del m.layers[-1]
        elif what == "tensor" and m.layers[0].tensors:
            del m.layers[0].tensors[-1]
        elif what == "block" and m.prefix.block_hashes:
            del m.prefix.block_hashes[-1]
    rejection = check_manifest(m, PROFILE)
    if rejection is None:
        # Accepted: then the manifest is consistent, and what it makes a receiver allocate is bounded.
        assert validate_manifest(m) is None
        assert m.encoding.raw_bytes <= PROFILE.max_bytes
        assert len(chunk_plan(m)) == m.encoding.chunk_count


CHUNK_EDITS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 20000), st.just(0)),
    st.tuples(st.sampled_from(["index", "tensor", "byte_offset", "raw_length", "checksum"]), U64, st.just(0)),
    st.tuples(st.sampled_from(["drop", "duplicate", "swap"]), st.just(0), st.just(0)),
)


@fuzz
@given(
    kind=st.sampled_from(["dense", "sparse", "quantized"]),
    codec=st.sampled_from(["none", "zstd"]),
    position=st.integers(0, 10**6),
    edits=st.lists(CHUNK_EDITS, min_size=1, max_size=3),
)
def test_mutated_chunks_fail_cleanly_or_decode_exactly(kind, codec, position, edits):
    cache, manifest, chunks = sample("quantized" if kind == "quantized" else "dense", codec)
    chunks = [replace(c) for c in chunks]
    i = position % len(chunks)
    for edit, a, b in edits:
        chunk = chunks[i % len(chunks)]
        if edit == "flip" and chunk.data:
            data = bytearray(chunk.data)
            data[a % len(data)] ^= b
            chunk.data = bytes(data)
        elif edit == "truncate":
            chunk.data = chunk.data[: a % (len(chunk.data) + 1)]
        elif edit == "extend":
            chunk.data = chunk.data + bytes(a)
        elif edit in ("index", "tensor", "raw_length"):
            setattr(chunk, edit, a % 2**32)
        elif edit in ("byte_offset", "checksum"):
            setattr(chunk, edit, a)
        elif edit == "drop" and len(chunks) > 1:
            del chunks[i % len(chunks)]
        elif edit == "duplicate":
            chunks.insert(i % len(chunks), replace(chunk))
        elif edit == "swap" and len(chunks) > 1:
            j = (i + 1) % len(chunks)
            chunks[i % len(chunks)], chunks[j] = chunks[j], chunks[i % len(chunks)]
    try:
        decoded = decode_chunks(manifest, chunks, threads=2 if position % 2 else 1)
    except IntegrityError:
        return
    for original, got in zip(cache, decoded):
        for x, y in zip(layer_tensors(original), layer_tensors(got)):
            assert mx.array_equal(x, y).item(), "a damaged stream decoded to other bytes"
