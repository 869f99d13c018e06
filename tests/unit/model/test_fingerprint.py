import json
import os
import shutil

import pytest

from kvmesh.errors import ModelDirError
from kvmesh.model.fingerprint import FileHashCache, ModelFingerprint, fingerprint
from kvmesh.model.testmodels import make_test_model
from support.processes import cli


@pytest.fixture
def model_dir(tiny_dir, tmp_path):
    """A private copy of the tiny model that a test may change."""
    return shutil.copytree(tiny_dir, tmp_path / "model")


def changed(before: ModelFingerprint, after: ModelFingerprint) -> set[str]:
    return {k for k, v in before.to_dict().items() if after.to_dict()[k] != v}


def test_geometry_and_identity(tiny_dir):
    fp = fingerprint(tiny_dir)
    assert (fp.model_type, fp.num_layers, fp.num_attention_heads, fp.num_kv_heads, fp.head_dim) == (
        "llama",
        4,
        4,
        2,
        64,
    )
    assert fp.dtype == "float32"
    assert fp.rope_theta == 500000.0 and fp.sliding_window == 0 and fp.rope_scaling_json == ""
    assert len(fp.model_id) == 16 and fp.chat_template_sha256
    assert fp.mlx_version and fp.mlx_lm_version


def test_stable_across_rebuilds_and_renames(tiny_dir, tmp_path):
    rebuilt = make_test_model(tmp_path / "elsewhere" / "renamed", "tiny")
    assert fingerprint(rebuilt) == fingerprint(tiny_dir)


def test_proto_round_trip(tiny_dir):
    fp = fingerprint(tiny_dir)
    assert ModelFingerprint.from_proto(fp.to_proto()) == fp


def test_config_change(model_dir):
    before = fingerprint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_theta"] = 10000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    assert changed(before, fingerprint(model_dir)) == {"model_id", "config_sha256", "rope_theta"}


def test_config_formatting_does_not_matter(model_dir):
    before = fingerprint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    reordered = dict(reversed(list(config.items())))
    (model_dir / "config.json").write_text(json.dumps(reordered, indent=7))
    assert fingerprint(model_dir) == before


def test_weights_change(model_dir, preset_dir):
    before = fingerprint(model_dir)
    other = preset_dir("tiny", seed=1)
    shutil.copy(other / "model.safetensors", model_dir / "model.safetensors")
    assert changed(before, fingerprint(model_dir)) == {"model_id", "weights_sha256"}


def test_tokenizer_change(model_dir):
    before = fingerprint(model_dir)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    first = next(k for k in tok["model"]["vocab"] if len(k) > 1 and not k.startswith("<|"))
    tok["model"]["vocab"]["zz" + first] = tok["model"]["vocab"].pop(first)
    (model_dir / "tokenizer.json").write_text(json.dumps(tok))
    assert changed(before, fingerprint(model_dir)) == {"model_id", "tokenizer_sha256"}


def test_chat_template_change(model_dir):
    before = fingerprint(model_dir)
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = tok_config["chat_template"].replace("assistant", "bot")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert changed(before, fingerprint(model_dir)) == {"model_id", "chat_template_sha256"}


def test_chat_template_file_takes_precedence(model_dir):
    before = fingerprint(model_dir)
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert changed(before, fingerprint(model_dir)) == {"model_id", "chat_template_sha256"}


def test_repo_id_from_hub_cache_layout(tiny_dir, tmp_path):
    snapshot = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / ("ab12" * 10)
    shutil.copytree(tiny_dir, snapshot)
    fp = fingerprint(snapshot)
    assert (fp.repo_id, fp.revision) == ("acme/tiny-llama", "ab12" * 10)
    assert fp.model_id == fingerprint(tiny_dir).model_id


def test_weight_hashes_are_remembered(model_dir, tmp_path):
    """A second fingerprint does not re-read weights: it trusts (path, size, mtime) like make does."""
    cache = FileHashCache(tmp_path / "hashes.sqlite3")
    before = fingerprint(model_dir, hash_cache=cache)
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(model_dir, hash_cache=cache).weights_sha256 == before.weights_sha256
    # Touching the file (a new mtime) makes it hashed again, and the change is seen.
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fingerprint(model_dir, hash_cache=cache).weights_sha256 != before.weights_sha256


def test_missing_directory(tmp_path):
    with pytest.raises(ModelDirError, match="no such directory") as e:
        fingerprint(tmp_path / "nope")
    assert e.value.path == tmp_path / "nope"


def test_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelDirError, match="config.json is missing"):
        fingerprint(tmp_path)


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError, match="no tokenizer: expected one of tokenizer.json"):
        fingerprint(model_dir)


def test_missing_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match=r"no weight files"):
        fingerprint(model_dir)


def test_unreadable_weight_file(model_dir):
    """A dangling symlink, as a half-downloaded Hugging Face cache leaves behind."""
    weights = model_dir / "model.safetensors"
    weights.unlink()
    weights.symlink_to(model_dir / "blobs" / "gone")
    with pytest.raises(ModelDirError, match="cannot read") as e:
        fingerprint(model_dir)
    assert "model.safetensors" in str(e.value)


def test_broken_config(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="config.json: is not valid JSON"):
        fingerprint(model_dir)


@pytest.mark.slow
def test_cli_info(tiny_dir):
    out = cli("model", "info", tiny_dir, "--json").stdout
    assert json.loads(out) == fingerprint(tiny_dir).to_dict()


@pytest.mark.slow
def test_cli_error_names_path_and_exits_non_zero(model_dir):
    (model_dir / "tokenizer.json").unlink()
    result = cli("model", "info", model_dir, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"kvmesh: error: {model_dir}: no tokenizer: expected one of tokenizer.json, tokenizer.model, vocab.json"
    )
