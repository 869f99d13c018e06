"""The loss a producer measures and ships with a lossy cache, and the defaults chosen by measurement."""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest

from kvmesh.caches.prefill import prefill, run_prompt
from kvmesh.caches.presses import make_press
from kvmesh.caches.quality import QUALITY_TOKENS
from kvmesh.codec.coded import parse_basis
from kvmesh.codec.levels import LEVELS
from kvmesh.errors import KvmeshError
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store
from support.processes import cli


def test_tail_kl_is_the_kl_of_re_reading_the_prompts_tail(tiny, prompt_ids):
    model = tiny[0]
    press = make_press("knorm", {"ratio": 0.8, "kv_bits": 4})
    pressed = prefill(model, prompt_ids, press)
    dense, _, _ = run_prompt(model, prompt_ids)

    def logprobs(cache):  # independently: NumPy, float64
        probe = mx.array(prompt_ids[-QUALITY_TOKENS:])[None]
        logits = np.array(model(probe, cache=copy.deepcopy(cache))[0], np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    full, compressed = logprobs(dense), logprobs(pressed.cache)
    want = (np.exp(full) * (full - compressed)).sum(-1).mean()
    assert pressed.tail_kl == pytest.approx(want, rel=1e-3, abs=1e-6) and want > 0
    assert prefill(model, prompt_ids).tail_kl is None  # lossless: nothing to measure


@pytest.mark.slow
def test_prefill_compress_uses_the_measured_level_and_ships_its_loss(tiny_dir, tmp_path):
    store = tmp_path / "store"
    out = json.loads(
        cli("prefill", tiny_dir, "--prompt", "one two three " * 30, "--compress", "--store", store, "--json").stdout
    )
    assert out["tail_kl"] is not None and out["compression"] == "full + transform"
    manifest = CacheStore(store).manifest(out["cache_id"])
    # Each layer's steps: the level's, times the factors the model's basis (kept beside the store) fitted.
    (needed,) = manifest.artifacts
    basis = parse_basis(artifact_store(store).get(needed.sha256), needed.sha256)
    for layer in manifest.layers:
        t = layer.transform
        assert t.value_step == pytest.approx(LEVELS["default"].step * basis.info["steps"]["v"][t.basis_layer])
        assert t.key_step == pytest.approx(LEVELS["default"].step * basis.info["steps"]["k"][t.basis_layer])
        # The level's tail: its last rows at a finer step, which the manifest states (schema 3).
        assert t.tail == LEVELS["default"].tail and t.key_tail_step == pytest.approx(
            t.key_step * LEVELS["default"].tail_factor
        )
    assert manifest.schema_version == 3
    shown = cli("cache", "--store", store, "show", out["cache_id"]).stdout
    assert f"last {LEVELS['default'].tail} rows" in shown
    assert "full + transform" in shown and "quality      tail_kl" in shown and "needs        transform-basis" in shown
    small = json.loads(
        cli(
            "prefill", tiny_dir, "--prompt", "four five " * 30, "--compress", "small", "--store", store, "--json"
        ).stdout
    )
    assert small["stored_bytes"] < out["stored_bytes"] * 1.2  # a coarser step, about as long a prompt
    both = cli("prefill", tiny_dir, "--prompt", "x", "--compress", "--method", "snapkv", check=False)
    assert both.returncode == 1 and "--compress chooses the codec itself" in both.stderr
    wrong = cli("prefill", tiny_dir, "--prompt", "x", "--compress", "tiny", check=False)
    assert wrong.returncode == 2 and "invalid choice: 'tiny'" in wrong.stderr


def test_the_server_keeps_compressed_caches_with_their_loss(tiny, tiny_fp, prompt_ids, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    from kvmesh.codec.calibration import fit_model_basis

    model = tiny[0]
    store = CacheStore(tmp_path / "store")
    served = MeshPromptCache(tiny_fp, store, min_store_tokens=1)
    served.compress_with(make_press("quantize", {"kv_bits": 8}), model)
    cache = make_prompt_cache(model)
    model(mx.array(prompt_ids)[None], cache=cache)
    served.persist(served.insert(prompt_ids, cache), cache)
    (entry,) = store.entries()
    manifest = store.manifest(entry.cache_id)
    assert manifest.compression.method == "quantize" and manifest.layers[0].bits == 8
    assert manifest.quality.metric == "tail_kl" and manifest.quality.value >= 0
    with pytest.raises(KvmeshError, match="kvzip needs the prompt's own passes"):
        served.compress_with(make_press("kvzip", {"ratio": 0.5}), model)
    # `kvmesh serve --compress`: transform coded at the level, with the model's basis, loss measured.
    basis = fit_model_basis(model, tiny[1], tokens_per_text=300).basis
    coded = MeshPromptCache(tiny_fp, CacheStore(tmp_path / "coded"), min_store_tokens=1)
    coded.compress_with(make_press("full"), model, level="small", basis=basis)
    coded.persist(coded.insert(prompt_ids, cache), cache)
    (entry,) = coded.store.entries()
    manifest = coded.store.manifest(entry.cache_id)
    assert [a.sha256 for a in manifest.artifacts] == [basis.digest]
    step = basis.step_at(LEVELS["small"])  # (the predicted step: the basis has predictors)
    assert manifest.layers[0].transform.value_step == pytest.approx(step * basis.info["steps"]["v"][0])
    assert [layer.transform.predicted for layer in manifest.layers] == [False] + [True] * (len(manifest.layers) - 1)
    assert manifest.quality.metric == "tail_kl" and manifest.quality.value > 0


def test_the_local_store_is_held_to_the_quality_floor(tiny, tiny_fp, prompt_ids, tmp_path):
    from kvmesh.codec.encode import encode_cache
    from kvmesh.reuse.find import find_prefix

    press = make_press("knorm", {"ratio": 0.9, "kv_bits": 4})
    pressed = prefill(tiny[0], prompt_ids[:256], press)
    store = CacheStore(tmp_path / "store")
    store.add(*encode_cache(pressed.cache, tiny_fp, prompt_ids[:256], press, tail_kl=pressed.tail_kl))
    refused = find_prefix(tiny_fp, prompt_ids, store, max_kl=pressed.tail_kl / 2)
    assert refused.cache is None and refused.where == "none"
    assert len(refused.skipped) == 1 and "quality" in refused.skipped[0]
    taken = find_prefix(tiny_fp, prompt_ids, store, max_kl=pressed.tail_kl * 2)
    assert taken.cache is not None and (taken.where, taken.tokens) == ("local store", 256)


def test_a_cut_of_a_coded_cache_claims_no_loss_and_a_floor_prefills_instead(tiny, tiny_fp, prompt_ids, tmp_path):
    """The loss measured on a transform-coded cache is its whole's (its finer tail is at its end): a
    shorter prefix cut from it claims none, so a receiver with a quality floor refuses the cut (and
    takes the whole), one without takes either."""
    from kvmesh.codec.calibration import fit_model_basis
    from kvmesh.codec.coded import code_at_level
    from kvmesh.codec.encode import encode_cache
    from kvmesh.reuse.find import find_prefix

    model, tokenizer = tiny
    basis = fit_model_basis(model, tokenizer, tokens_per_text=300).basis
    full = prefill(model, prompt_ids[:300]).cache
    store = CacheStore(tmp_path / "store")
    artifact_store(store.root).put(basis.to_bytes(), basis.digest)
    store.add(*encode_cache(code_at_level(full, basis, "default"), tiny_fp, prompt_ids[:300], tail_kl=0.001))
    whole = find_prefix(tiny_fp, prompt_ids[:300] + [5], store, max_kl=0.01)
    assert whole.cache is not None and whole.tokens == 300
    other = prompt_ids[:260] + [5] * 50  # shares the first 256 tokens (whole blocks) only
    refused = find_prefix(tiny_fp, other, store, max_kl=0.01)
    assert refused.cache is None and "did not measure" in refused.skipped[0]
    taken = find_prefix(tiny_fp, other, store)
    assert taken.cache is not None and taken.tokens == 256
