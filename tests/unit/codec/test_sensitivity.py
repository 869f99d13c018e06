"""Per-layer quantization steps: each tensor's factor comes from the KL its coding was measured to
add, travels in the basis, and sets the step in its layer's blob (so receivers need nothing new)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from kvmesh.caches.prefill import prefill, run_prompt
from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.basis_file import read_basis, steps_problem
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.layer_blob import read_header
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.sensitivity import FACTOR_SPREAD, step_factors, tensor_sensitivities
from kvmesh.codec.transform import encode_layers, layers_of_cache
from kvmesh.compression import compress, model_basis
from kvmesh.store.artifacts import artifact_store


@pytest.fixture(scope="module")
def basis(tiny):
    model, tokenizer = tiny
    return fit_model_basis(model, tokenizer, tokens_per_text=200).basis


@pytest.fixture(scope="module")
def layers(tiny, prompt_ids):
    cache, _, _ = run_prompt(tiny[0], prompt_ids)
    return layers_of_cache(cache)


def unfitted(basis: Basis, **info) -> Basis:
    """`basis` as a kvmesh before per-layer steps fitted it (and with `info` besides)."""
    plain = basis.without_step_factors()
    return replace(plain, info={**plain.info, **info}, _bytes=None, _digest=None)


def test_every_tensor_gets_a_factor_and_its_blob_carries_the_step_it_makes(basis, layers):
    steps = basis.info["steps"]
    assert set(steps) == {"k", "v"} and all(len(f) == len(basis) for f in steps.values())
    assert np.exp(np.log(steps["v"]).mean()) == pytest.approx(1.0, rel=0.01)
    everything = np.array(steps["k"] + steps["v"])
    assert everything.max() / everything.min() <= FACTOR_SPREAD**2 * 1.01
    for j, blob in enumerate(encode_layers(layers, basis, step=0.1).blobs):
        header, _ = read_header(blob)
        assert header["k"]["step"] == pytest.approx(0.1 * steps["k"][j])
        assert header["v"]["step"] == pytest.approx(0.1 * steps["v"][j])


def test_a_basis_fitted_without_factors_codes_keys_at_key_factor(basis, layers):
    plain = unfitted(basis)
    header, _ = read_header(encode_layers(layers, plain, step=0.1, key_factor=3.0).blobs[0])
    assert header["k"]["step"] == pytest.approx(0.3) and header["v"]["step"] == pytest.approx(0.1)


def test_the_factors_travel_with_the_basis_and_a_wrong_one_is_refused(basis):
    back = Basis.from_bytes(basis.to_bytes(), basis.digest)
    assert back.info["steps"] == basis.info["steps"]
    n = len(basis)
    assert steps_problem(None, n) is None and steps_problem(basis.info["steps"], n) is None
    for wrong, words in [
        ({"k": [1.0] * n}, "not one list for keys and one for values"),
        ({"k": [True] * n, "v": [1.0] * n}, "hold a number outside"),
        ({"k": [1e9] * n, "v": [1.0] * n}, "hold a number outside"),
        ({"k": [1.0] * n, "v": [1.0] * (n + 1)}, f"not one per layer of {n}"),
        ({"k": [1.0] * n, "v": ["1"] * n}, "hold a number outside"),
        ({"k": [0.0] * n, "v": [1.0] * n}, "hold a number outside"),
    ]:
        assert words in steps_problem(wrong, n)
        info = {**basis.info, "steps": wrong}
        bad = replace(basis, info=info, _bytes=None, _digest=None)
        with pytest.raises(BasisError, match="step factors"):
            Basis.from_bytes(bad.to_bytes(), bad.digest)
        with pytest.raises(BasisError, match="step factors"):  # as the store and a server check it, MLX-free
            read_basis(bad.to_bytes())
    assert json.loads(json.dumps(basis.info))["steps"] == basis.info["steps"]


def test_a_tensor_measured_more_sensitive_gets_a_finer_step(basis):
    n = len(basis)
    even = {"k": np.full(n, 1e-3), "v": np.full(n, 1e-3)}
    sharp = {"k": even["k"].copy(), "v": even["v"].copy()}
    sharp["v"][0] *= 4  # 4x the KL at the same step: half the step, where its bits are alike
    base, after = step_factors(basis, even), step_factors(basis, sharp)
    relative = [after["v"][j] / base["v"][j] for j in range(n)]
    assert relative[0] == pytest.approx(min(relative)) and relative[0] / relative[1] == pytest.approx(0.5, rel=0.02)
    # A KL the model could not compute counts as the most sensitive measured, not as a broken factor.
    sharp["v"][:2] = np.nan, 8e-3
    measured = {"k": even["k"], "v": np.r_[8e-3, 8e-3, even["v"][2:]]}
    assert step_factors(basis, sharp) == step_factors(basis, measured)


def test_coding_a_tensor_coarser_adds_more_kl(tiny, basis, prompt_ids):
    model, tokenizer = tiny
    cache, _, _ = run_prompt(model, prompt_ids[:200])
    layers = basis.covered()
    fine = tensor_sensitivities(model, cache, layers, basis, prompt_ids[200:232], step=0.1)
    coarse = tensor_sensitivities(model, cache, layers, basis, prompt_ids[200:232], step=0.4)
    # (A random-weight model barely minds: a tensor's KL alone may sit at float32's noise.)
    for kind in "kv":
        assert coarse[kind].sum() > 4 * fine[kind].sum() > 0, (kind, fine, coarse)


def unweighted(basis: Basis, **info) -> Basis:
    """`basis` as a kvmesh before the attention's weights fitted it (its factors kept)."""
    plain = {k: v for k, v in basis.info.items() if k != "weighted"}
    return replace(basis, info={**plain, **info}, _bytes=None, _digest=None)


def unpredicting(basis: Basis, **info) -> Basis:
    """`basis` as a kvmesh before cross-layer prediction fitted it."""
    plain = basis.without_predictors()
    return replace(plain, info={**plain.info, **info}, _bytes=None, _digest=None)


@pytest.mark.parametrize(
    "older, predates, step_of",
    [
        (unfitted, "per-layer steps and small's predictors", "one_step"),
        (unweighted, "attention weights", "factors_step"),
        (unpredicting, "small's predictors", "step"),
    ],
    ids=["without-factors", "without-weights", "without-predictors"],
)
def test_a_stored_basis_from_before_is_fitted_again_unless_fitted_on_the_users_texts(
    basis, tiny_loaded, prompt_ids, tmp_path, caplog, older, predates, step_of
):
    """--compress on a store whose basis predates step factors, the attention's weights or `small`'s
    predictors: one fitted on the default texts is fitted again (the levels are measured on current
    bases); one fitted on the user's texts is kept, said, and coded at the step the level met its bar
    with on such bases."""
    model_id = tiny_loaded.fingerprint.model_id
    assert basis.weighted and basis.has_step_factors
    for store, old, refitted in [
        (tmp_path / "a", older(basis), True),
        (tmp_path / "b", older(basis, texts=["my-notes.md"]), False),
    ]:
        artifacts = artifact_store(store)
        artifacts.put(old.to_bytes(), old.digest)
        artifacts.set_model_basis(model_id, old.digest)
        got, calibrated = model_basis(store, tiny_loaded, tokens_per_text=64)
        current = got.weighted and got.has_step_factors and got.predicted_step is not None
        assert (calibrated is not None) is refitted and current is refitted
        assert artifacts.model_basis(model_id) == (got.digest if refitted else old.digest)
        level = LEVELS["default"]
        coded = compress(tiny_loaded.model, prefill(tiny_loaded.model, prompt_ids).cache, prompt_ids, "default", got)
        steps = {layer.spec.value_step / got.step_factor(layer.spec.basis_layer, "v", 2.0) for layer in coded.cache}
        assert steps and all(s == pytest.approx(level.step if refitted else getattr(level, step_of)) for s in steps)
    assert f"predates {predates}, so --compress codes larger caches at the same quality" in caplog.text
