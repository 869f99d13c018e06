"""Each reject reason, produced by changing exactly one thing from an accepted cache."""

import json
import shutil

import mlx.core as mx
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.codec.compat import ReceiverProfile, check_manifest
from kvmesh.codec.encode import build_manifest
from kvmesh.codec.prefix import PrefixKey
from kvmesh.model.fingerprint import fingerprint
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.versions import SCHEMA_VERSION


@pytest.fixture(scope="module")
def accepted(tiny, tiny_fp, prompt_ids):
    """A manifest of the prompt's first 200 tokens, and a profile that accepts it."""
    press = make_press("snapkv", {"ratio": 0.5, "window": 16})
    cache = prefill(tiny[0], prompt_ids[:200], press).cache
    manifest = build_manifest(cache, tiny_fp, PrefixKey.of(prompt_ids[:200]), press)
    return manifest, ReceiverProfile(model=tiny_fp, prompt=prompt_ids)


@pytest.fixture
def manifest(accepted):
    copy = pb.CacheManifest()
    copy.CopyFrom(accepted[0])
    return copy


@pytest.fixture
def profile(accepted):
    return accepted[1]


def edited_model(tiny_dir, tmp_path, edit) -> ReceiverProfile:
    """The fingerprint of a copy of the tiny model with one file edited by `edit(dir)`."""
    model_dir = shutil.copytree(tiny_dir, tmp_path / "edited")
    edit(model_dir)
    return fingerprint(model_dir)


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def reason(manifest, profile) -> str:
    rejection = check_manifest(manifest, profile)
    assert rejection is not None, "expected a rejection"
    return rejection.reason_name


def test_accepted_as_is(manifest, profile):
    assert check_manifest(manifest, profile) is None


def test_schema(manifest, profile):
    assert manifest.schema_version == 2, "a manifest without transform tails is written in schema 2"
    manifest.schema_version = SCHEMA_VERSION
    assert check_manifest(manifest, profile) is None
    for other in (1, SCHEMA_VERSION + 1):
        manifest.schema_version = other
        assert reason(manifest, profile) == "schema"
        assert f"manifest schema {other}, this kvmesh reads 2, 3, 4" in str(check_manifest(manifest, profile))


def test_model_config(manifest, profile, tiny_dir, tmp_path):
    other = edited_model(tiny_dir, tmp_path, lambda d: edit_json(d / "config.json", lambda c: c.update(rope_theta=1e4)))
    assert reason(manifest, ReceiverProfile(model=other)) == "model_config"


def test_weights(manifest, profile, tiny_dir, preset_dir, tmp_path):
    seed1 = preset_dir("tiny", seed=1)
    other = edited_model(tiny_dir, tmp_path, lambda d: shutil.copy(seed1 / "model.safetensors", d))
    rejection = check_manifest(manifest, ReceiverProfile(model=other))
    assert rejection.reason_name == "weights"
    assert str(rejection).startswith("weights: the cache was made with other weights (")
    # Accepted only when the receiver explicitly takes caches of other weights.
    assert check_manifest(manifest, ReceiverProfile(model=other, accept_other_weights=True)) is None


def test_tokenizer(manifest, tiny_dir, tmp_path):
    def edit(d):
        edit_json(d / "tokenizer.json", lambda t: t["added_tokens"][0].update(content="<|nothing|>"))

    assert reason(manifest, ReceiverProfile(model=edited_model(tiny_dir, tmp_path, edit))) == "tokenizer"


def test_chat_template(manifest, tiny_dir, tmp_path):
    def edit(d):
        edit_json(d / "tokenizer_config.json", lambda t: t.update(chat_template="{{ messages }}"))

    other = edited_model(tiny_dir, tmp_path, edit)
    assert reason(manifest, ReceiverProfile(model=other)) == "chat_template"
    assert check_manifest(manifest, ReceiverProfile(model=other, accept_other_chat_template=True)) is None


def test_geometry(manifest, tiny_dir, tmp_path):
    other = edited_model(
        tiny_dir, tmp_path, lambda d: edit_json(d / "config.json", lambda c: c.update(num_hidden_layers=8))
    )
    rejection = check_manifest(manifest, ReceiverProfile(model=other))
    assert rejection.reason_name == "geometry"
    assert rejection.message == "layers 4 in the cache, 8 in this model"


def test_geometry_dtype(manifest, tiny_dir, tmp_path):
    def to_fp16(d):
        weights = mx.load(str(d / "model.safetensors"))
        mx.save_safetensors(str(d / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()})

    rejection = check_manifest(manifest, ReceiverProfile(model=edited_model(tiny_dir, tmp_path, to_fp16)))
    assert (rejection.reason_name, rejection.message) == (
        "geometry",
        "dtype float32 in the cache, float16 in this model",
    )


def test_prefix(manifest, profile, prompt_ids):
    other_prompt = list(prompt_ids)
    other_prompt[150] += 1
    rejection = check_manifest(manifest, ReceiverProfile(model=profile.model, prompt=other_prompt))
    assert (rejection.reason_name, rejection.message) == (
        "prefix",
        "the cache's 200-token prefix is not a prefix of this prompt",
    )


def test_prompt_shorter_than_the_prefix(manifest, profile, prompt_ids):
    assert reason(manifest, ReceiverProfile(model=profile.model, prompt=prompt_ids[:199])) == "prefix"


def test_codec(manifest, profile):
    assert reason(manifest, ReceiverProfile(model=profile.model, codecs=frozenset({"none"}))) == "codec"


def test_dtype(manifest, profile):
    manifest.dtype = 99  # a dtype of a newer schema
    rejection = check_manifest(manifest, profile)
    assert (rejection.reason_name, rejection.message) == ("dtype", "unsupported cache dtype unknown(99)")


def test_cache_class(manifest, profile):
    manifest.layers[2].kind = 42  # a cache kind of a newer schema
    rejection = check_manifest(manifest, profile)
    assert (rejection.reason_name, rejection.message) == ("cache_class", "layer 2: unsupported cache kind unknown(42)")


def test_size_limit(manifest, profile):
    limited = ReceiverProfile(model=profile.model, max_bytes=manifest.encoding.raw_bytes - 1)
    assert reason(manifest, limited) == "size_limit"


@pytest.mark.parametrize(
    "lie",
    [
        lambda m: setattr(m, "num_layers", 10**9),
        lambda m: m.layers[0].tensors[0].shape.__setitem__(0, 10**12),
        lambda m: setattr(m.layers[0].tensors[1], "nbytes", 1),
        lambda m: setattr(m.layers[1], "n_kept", 10**6),
        lambda m: setattr(m.encoding, "raw_bytes", 1 << 50),
        lambda m: setattr(m.encoding, "chunk_count", 3),
        lambda m: setattr(m.encoding, "chunk_size", 0),
        lambda m: setattr(m.prefix, "block_size", 0),
        lambda m: m.layers[3].tensors.pop(),
        lambda m: setattr(m.prefix, "sha256", b"short"),
        lambda m: setattr(m.encoding, "payload_digest", b"short"),
    ],
    ids=[
        "layers",
        "shape",
        "nbytes",
        "n_kept",
        "raw_bytes",
        "chunk_count",
        "chunk_size",
        "block_size",
        "tensors",
        "prefix_hash",
        "digest",
    ],
)
def test_a_manifest_that_lies_about_itself_is_malformed(manifest, profile, lie):
    lie(manifest)
    assert reason(manifest, profile) == "malformed"


def test_a_validated_manifest_is_held_to_the_profile_without_its_checks_run_again(manifest, profile):
    """A sender's own manifest (validated when its store read it) is checked against the receiver's
    profile only: its consistency is not checked again on each open."""
    manifest.encoding.chunk_count = 3  # (what only validation finds)
    assert reason(manifest, profile) == "malformed"
    assert check_manifest(manifest, profile, validated=True) is None
    limited = ReceiverProfile(model=profile.model, max_bytes=manifest.encoding.raw_bytes - 1)
    assert check_manifest(manifest, limited, validated=True).reason == pb.REJECT_REASON_SIZE_LIMIT
