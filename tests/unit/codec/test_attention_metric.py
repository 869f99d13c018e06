"""The weights a basis's PCA is fitted in (kvmesh.codec.attention_metric): keys weighed by the queries
that read them, values by the o_proj columns that carry them out; a weighed PCA spends its error
where those weights are small, and a basis fitted so says so and still reads back as a basis."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvmesh.codec.attention_metric import key_weights, recording_queries, value_weights
from kvmesh.codec.basis import Basis, fit_tensor_basis
from kvmesh.codec.basis_file import WEIGHT_FLOOR, component_norms
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.rotary import Rotary, model_layers


@pytest.mark.parametrize("traditional", [True, False])
def test_a_key_feature_weighs_what_the_queries_of_its_head_carry_there_pair_by_pair(traditional):
    # 4 query heads of 4 on 2 KV heads: query heads 0 and 1 read KV head 0, 2 and 3 read KV head 1.
    squares = np.arange(1, 17, dtype=np.float64)
    got = key_weights(squares, 4, 2, Rotary(dims=4, traditional=traditional))
    summed = squares.reshape(2, 2, 4).sum(axis=1)  # [[6, 8, 10, 12], [22, 24, 26, 28]]
    pairs = [(0, 1), (2, 3)] if traditional else [(0, 2), (1, 3)]
    want = summed.copy()
    for a, b in pairs:
        want[:, a] = want[:, b] = (summed[:, a] + summed[:, b]) / 2
    np.testing.assert_allclose(got, want.reshape(-1) / want.mean())
    # Features no query reads (KV head 0's) keep the floor's share.
    silent = key_weights(np.r_[np.zeros(8), np.ones(8)], 4, 2, Rotary(dims=4, traditional=traditional))
    assert silent.min() == WEIGHT_FLOOR and silent.max() > 1


def test_a_value_feature_weighs_the_length_of_the_o_proj_columns_that_carry_it():
    linear = nn.Linear(8, 6, bias=False)  # 4 query heads of 2 features out to 6; 2 KV heads
    w = np.asarray(linear.weight, dtype=np.float64)
    lengths = (w**2).sum(axis=0).reshape(2, 2, 2).sum(axis=1).reshape(-1)
    np.testing.assert_allclose(value_weights(linear, 4, 2), lengths / lengths.mean(), rtol=1e-5)
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(64, 32, bias=False), group_size=32, bits=8)
    back = mx.dequantize(quantized.weight, quantized.scales, quantized.biases, 32, 8)
    lengths = (np.asarray(back, dtype=np.float64) ** 2).sum(axis=0).reshape(2, 2, 16).sum(axis=1).reshape(-1)
    np.testing.assert_allclose(value_weights(quantized, 4, 2), lengths / lengths.mean(), rtol=1e-4)
    assert value_weights(nn.Identity(), 4, 2) is None


def test_the_queries_recorded_are_those_q_proj_gives_and_q_proj_is_put_back(tiny, prompt_ids):
    model, _ = tiny
    every = model_layers(model)
    own = every[0].self_attn.q_proj
    tokens = mx.array(prompt_ids[:40])[None]
    with recording_queries(every, [0]) as recorded:
        model(tokens)
    assert every[0].self_attn.q_proj is own and recorded[0].count == 40
    # Layer 0's queries, made by hand: its input is the normed embedding.
    x = every[0].input_layernorm(model.model.embed_tokens(tokens))
    want = np.asarray(mx.square(own(x)).reshape(-1, own.weight.shape[0]).mean(axis=0))
    np.testing.assert_allclose(recorded[0].total() / recorded[0].count, want, rtol=1e-4)
    with pytest.raises(RuntimeError), recording_queries(every, [0]):
        raise RuntimeError("a prefill that fails")
    assert every[0].self_attn.q_proj is own


def test_a_weighed_pca_reconstructs_exactly_and_errs_least_where_the_weights_are_large():
    rng = np.random.default_rng(3)
    f = 16
    rows = rng.standard_normal((4000, f)) @ rng.standard_normal((f, f)) + rng.standard_normal(f)
    weights = np.exp(rng.uniform(-3, 3, f))
    weights /= weights.mean()
    plain = fit_tensor_basis(rows, dtype=np.float32)
    weighed = fit_tensor_basis(rows, dtype=np.float32, weights=weights)
    np.testing.assert_allclose(weighed.reconstruct(weighed.project(rows)), rows, atol=1e-3)
    even = fit_tensor_basis(rows, dtype=np.float32, weights=np.ones(f))
    np.testing.assert_allclose(even.components, plain.components)

    def weighed_error(tb, n: int) -> float:
        error = rows - tb.reconstruct(tb.project(rows)[:, :n])
        return float((error**2 * weights).sum(axis=1).mean())

    for n in (2, 6, 10):
        assert weighed_error(weighed, n) < 0.9 * weighed_error(plain, n)
    norms = np.linalg.norm(weighed.components, axis=1)
    low, high = component_norms(f)
    assert low <= norms.min() < 0.99 and 1.01 < norms.max() <= high


def test_a_model_s_basis_is_fitted_weighed_and_reads_back(tiny):
    model, tokenizer = tiny
    basis = fit_model_basis(model, tokenizer, tokens_per_text=64).basis
    back = Basis.from_bytes(basis.to_bytes(), basis.digest)
    assert basis.weighted and back.weighted
    unweighed = fit_model_basis(model, tokenizer, tokens_per_text=64, weigh=False).basis
    assert not unweighed.weighted
    norms = np.linalg.norm(basis.keys[0].components.astype(np.float32), axis=1)
    assert norms.max() > 1.05  # its components were scaled back from the weighed space


def test_a_model_that_norms_its_queries_after_q_proj_weighs_its_values_alone(preset_model):
    """qwen3's q_norm comes between q_proj and the scores: what q_proj gives is not the queries, so
    its keys are fitted as before (unit rows), its values in o_proj's weights."""
    model, tokenizer = preset_model("tiny-qwen3")
    basis = fit_model_basis(model, tokenizer, tokens_per_text=64).basis
    assert basis.weighted
    for keys, values in zip(basis.keys, basis.values, strict=True):
        # (float16 rounding moves a unit row's norm by ~2^-11; a random o_proj's columns differ little.)
        np.testing.assert_allclose(np.linalg.norm(keys.components.astype(np.float32), axis=1), 1.0, atol=2**-9)
        assert np.abs(np.linalg.norm(values.components.astype(np.float32), axis=1) - 1).max() > 2**-8
