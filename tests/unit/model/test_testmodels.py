import filecmp
import json

import mlx_lm
import pytest

from kvmesh.errors import KvmeshError, ModelDirError
from kvmesh.model.testmodels import PRESETS, make_test_model


def test_build_is_deterministic(tiny_dir, tmp_path):
    again = make_test_model(tmp_path / "again", "tiny")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tiny_dir, again, names, shallow=False)
    assert mismatch == [] and errors == []


def test_another_seed_gives_other_weights(tiny_dir, preset_dir):
    other = preset_dir("tiny", seed=1)
    assert not filecmp.cmp(tiny_dir / "model.safetensors", other / "model.safetensors", shallow=False)
    assert filecmp.cmp(tiny_dir / "tokenizer.json", other / "tokenizer.json", shallow=False)


def test_tiny_loads_offline_and_generates(tiny, tiny_dir):
    model, tokenizer = tiny
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert len(model.layers) == PRESETS["tiny"].num_hidden_layers

    ids = tokenizer.encode("The kettle on the stove")
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 3
    assert tokenizer.decode(ids[1:]) == "The kettle on the stove"
    text = mlx_lm.generate(model, tokenizer, "The kettle on the stove", max_tokens=12)
    assert len(tokenizer.encode(text)) > 1


def test_chat_template(tiny):
    _, tokenizer = tiny
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_second_family_loads_and_generates(qwen3):
    model, tokenizer = qwen3
    assert model.model_type == "qwen3"
    assert mlx_lm.generate(model, tokenizer, "Rivers run to the sea", max_tokens=5)


def test_unknown_preset(tmp_path):
    with pytest.raises(KvmeshError, match="unknown preset 'huge'"):
        make_test_model(tmp_path / "m", "huge")


def test_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ModelDirError, match="not an empty directory"):
        make_test_model(tmp_path, "tiny")
    assert (tmp_path / "keep.txt").read_text() == "mine"
