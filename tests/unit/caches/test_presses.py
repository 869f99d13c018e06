"""Each compression method keeps what it says it keeps, and composes with quantization."""

import json

import mlx.core as mx
import numpy as np
import pytest

from kvmesh.caches.attention import reconstruction_scores, record_queries
from kvmesh.caches.prefill import prefill, run_prompt
from kvmesh.caches.presses import PRESSES, avg_pool, make_press
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.errors import PressConfigError
from support.references import same_arrays


@pytest.fixture(scope="module")
def dense_run(tiny, prompt_ids):
    """The dense cache of the prompt, with the last 16 tokens' queries observed."""
    return run_prompt(tiny[0], prompt_ids, observe_last=16)


def kept_positions(dense_layer, sparse_layer) -> list[set[int]]:
    """Which original positions each head of a sparse layer holds, found by matching key rows."""
    dense = np.array(dense_layer.keys[0, :, : dense_layer.offset])
    sparse = np.array(sparse_layer.keys[0, :, : sparse_layer.n_kept])
    return [{int(np.flatnonzero((dense[h] == row).all(axis=1))[0]) for row in sparse[h]} for h in range(dense.shape[0])]


def test_every_method_is_registered():
    assert set(PRESSES) == {"full", "quantize", "streaming_llm", "knorm", "snapkv", "kvzip"}


@pytest.mark.parametrize("method", ["streaming_llm", "knorm", "snapkv"])
@pytest.mark.parametrize("sizing, kept", [({"budget": 64}, 64), ({"ratio": 0.75}, 75)])
def test_budget_and_ratio(dense_run, method, sizing, kept):
    dense, _, observed = dense_run
    config = {**sizing, **({"window": 16} if method == "snapkv" else {})}
    press = make_press(method, config)
    sparse = press.apply(dense, observed)
    assert len(dense[0].keys[0, 0, : dense[0].offset]) == 300
    assert [(c.n_kept, c.offset) for c in sparse] == [(kept, 300)] * len(dense)


def test_streaming_llm_keeps_sinks_and_recent_window(dense_run):
    dense, _, _ = dense_run
    sparse = make_press("streaming_llm", {"budget": 40, "sinks": 4}).apply(dense)
    expected = set(range(4)) | set(range(300 - 36, 300))
    for d, s in zip(dense, sparse):
        assert kept_positions(d, s) == [expected] * 2


def test_knorm_keeps_lowest_norm_keys_per_head(dense_run):
    dense, _, _ = dense_run
    sparse = make_press("knorm", {"budget": 50}).apply(dense)
    for d, s in zip(dense, sparse):
        norms = np.linalg.norm(np.array(d.keys[0, :, :300]), axis=-1)
        for h, kept in enumerate(kept_positions(d, s)):
            evicted = set(range(300)) - kept
            # NumPy's norm may differ from MLX's in the last bit: allow one part in a million.
            assert max(norms[h, sorted(kept)]) <= min(norms[h, sorted(evicted)]) * (1 + 1e-6)


def snapkv_reference(queries, keys, scale, window, kernel, budget):
    """SnapKV scoring written independently, in NumPy, one kv head at a time."""
    q, k = np.array(queries[0], np.float64), np.array(keys[0], np.float64)
    n_heads, w, _ = q.shape
    n_kv, n, _ = k.shape
    rep = n_heads // n_kv
    kept = []
    for h in range(n_kv):
        logits = np.einsum("gwd,nd->gwn", q[h * rep : (h + 1) * rep], k[h]) * scale
        for i in range(w):
            logits[:, i, n - w + i + 1 :] = -np.inf
        attn = np.exp(logits - logits.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        score = attn[..., : n - w].mean(axis=(0, 1))
        pooled = np.convolve(np.pad(score, kernel // 2), np.ones(kernel) / kernel, mode="valid")
        top = np.argsort(-pooled, kind="stable")[: budget - w]
        kept.append(set(top.tolist()) | set(range(n - w, n)))
    return kept


def test_snapkv_matches_an_independent_reference(dense_run):
    dense, _, observed = dense_run
    sparse = make_press("snapkv", {"budget": 60, "window": 16, "kernel": 5}).apply(dense, observed)
    for layer, (d, s) in enumerate(zip(dense, sparse)):
        queries, scale = observed[layer]
        want = snapkv_reference(queries, d.keys[..., :300, :], scale, 16, 5, 60)
        got = kept_positions(d, s)
        for h in range(len(want)):
            # float32 vs float64 scoring may swap near-ties at the cut-off; allow one or two.
            assert set(range(284, 300)) <= got[h]
            assert len(got[h] ^ want[h]) <= 4, (layer, h, sorted(got[h] ^ want[h]))


def test_snapkv_with_a_budget_inside_the_window_keeps_the_most_recent(dense_run):
    dense, _, observed = dense_run
    sparse = make_press("snapkv", {"budget": 10, "window": 16}).apply(dense, observed)
    assert kept_positions(dense[0], sparse[0]) == [set(range(290, 300))] * 2


def test_avg_pool_matches_numpy():
    x = np.random.default_rng(0).random((3, 20)).astype(np.float32)
    want = np.stack([np.convolve(np.pad(r, 2), np.ones(5) / 5, mode="valid") for r in x])
    np.testing.assert_allclose(np.array(avg_pool(mx.array(x), 5)), want, rtol=1e-5, atol=1e-6)


def max_attention(queries, keys, scale, first):
    """Per kv head, the most attention any of `queries` (at positions first, first+1, ...) gives each
    key, in NumPy float64: (kv_heads, keys)."""
    q, k = np.array(queries[0], np.float64), np.array(keys[0], np.float64)
    rep, m, n = q.shape[0] // k.shape[0], q.shape[1], k.shape[1]
    per_head = []
    for h in range(k.shape[0]):
        logits = np.einsum("gid,jd->gij", q[h * rep : (h + 1) * rep], k[h]) * scale
        logits[:, np.arange(n)[None, :] > first + np.arange(m)[:, None]] = -np.inf
        attn = np.exp(logits - logits.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        per_head.append(attn.max(axis=(0, 1)))
    return np.stack(per_head)


def kvzip_reference(model, tokens, ratio, window=32):
    """KVzip's selection written independently: the prompt's last queries and a second pass, both
    recorded with the queries they make, attention in NumPy (float64) one kv head at a time, budgets
    over all layers, top per head."""
    n = len(tokens)
    cache, _, observed = run_prompt(model, tokens, observe_last=window)
    with record_queries(model, cache) as seen:
        model(mx.array(tokens)[None], cache=cache)
    scores = []
    for layer, c in enumerate(cache):
        tail = max_attention(observed[layer][0], c.keys[..., :n, :], observed[layer][1], n - window)
        again = max_attention(seen[layer][0], c.keys[..., : 2 * n, :], seen[layer][1], n)[:, :n]
        scores.append(np.maximum(tail, again))
    every = np.sort(np.concatenate([s.ravel() for s in scores]))
    per_layer = n - int(n * ratio)
    threshold = every[every.size - per_layer * sum(s.shape[0] for s in scores)]
    kept = []
    for s in scores:
        count = min(n, max(1, round((s >= threshold).sum() / s.shape[0])))
        kept.append([set(np.argsort(-s[h], kind="stable")[:count].tolist()) for h in range(s.shape[0])])
    return kept


def test_kvzip_matches_an_independent_reference(tiny, prompt_ids):
    model = tiny[0]
    pressed = prefill(model, prompt_ids, make_press("kvzip", {"ratio": 0.5})).cache
    dense, _, _ = run_prompt(model, prompt_ids)
    want = kvzip_reference(model, prompt_ids, 0.5)
    # Budgets differ across layers (the point), and average what was asked.
    counts = [c.n_kept for c in pressed]
    assert len(set(counts)) > 1 and abs(sum(counts) / len(counts) - 150) <= 1
    for layer, (d, s) in enumerate(zip(dense, pressed)):
        got = kept_positions(d, s)
        # float32 vs float64 may move the cut-off by one position or swap near-ties.
        assert abs(len(got[0]) - len(want[layer][0])) <= 1
        for h in range(len(got)):
            assert len(got[h] ^ want[layer][h]) <= 4, (layer, h, sorted(got[h] ^ want[layer][h]))


def test_kvzip_leaves_the_dense_cache_as_it_was(tiny, prompt_ids):
    model = tiny[0]
    dense, _, _ = run_prompt(model, prompt_ids)
    before = [mx.array(c.keys[..., : c.offset, :]) for c in dense]
    scores = reconstruction_scores(model, dense, prompt_ids)
    assert [c.offset for c in dense] == [300] * len(dense)
    assert all(mx.array_equal(b, c.keys[..., :300, :]).item() for b, c in zip(before, dense))
    assert [s.shape for s in scores.values()] == [(2, 300)] * len(dense)
    # With a budget, every layer keeps that many; with 8 bits, quantized as every method is.
    both = make_press("kvzip", {"budget": 64, "kv_bits": 8}).apply(dense, scores)
    assert [(type(c), c.n_kept) for c in both] == [(SparseQuantizedKVCache, 64)] * len(dense)


@pytest.mark.parametrize("bits", [4, 8])
def test_eviction_composes_with_quantization(tiny, prompt_ids, bits):
    evicted = prefill(tiny[0], prompt_ids, make_press("streaming_llm", {"budget": 64}))
    both = prefill(tiny[0], prompt_ids, make_press("streaming_llm", {"budget": 64, "kv_bits": bits}))
    assert all(type(c) is SparseQuantizedKVCache and c.bits == bits for c in both.cache)
    assert [(c.n_kept, c.offset) for c in both.cache] == [(c.n_kept, c.offset) for c in evicted.cache]
    # Quantizing the kept positions gives what quantizing them in the evicted cache gives.
    for e, b in zip(evicted.cache, both.cache):
        q = e.to_quantized(group_size=64, bits=bits)
        assert same_arrays(q.keys, b.keys)


def test_byte_sizes_before_and_after(tiny, prompt_ids):
    # tiny: 4 layers x (keys + values) x 2 kv heads x 64 dims x 4 bytes (float32) per position
    per_token = 4 * 2 * 2 * 64 * 4
    full = prefill(tiny[0], prompt_ids)
    assert full.dense_nbytes == full.nbytes == 300 * per_token
    evicted = prefill(tiny[0], prompt_ids, make_press("knorm", {"ratio": 0.5}))
    assert evicted.dense_nbytes == 300 * per_token and evicted.nbytes == 150 * per_token
    # 8-bit at group 64: 64 values -> 16 uint32 words (64 bytes) + a float32 scale and bias (8 bytes)
    quantized = prefill(tiny[0], prompt_ids, make_press("quantize", {"kv_bits": 8}))
    assert quantized.nbytes == 300 * 4 * 2 * 2 * (64 + 8)


def test_full_keeps_everything(dense_run):
    dense, _, _ = dense_run
    sparse = make_press("full").apply(dense)
    assert all(type(c) is SparseKVCache and c.n_kept == c.offset == 300 for c in sparse)


def test_config_is_json_and_rebuilds_the_same_press():
    press = make_press("snapkv", {"ratio": 0.5, "window": 8, "kv_bits": 4})
    config = json.loads(json.dumps(press.config()))
    assert config == {"ratio": 0.5, "budget": None, "kv_bits": 4, "kv_group_size": 64, "window": 8, "kernel": 5}
    assert make_press(press.method, config) == press


@pytest.mark.parametrize(
    "method, config, message",
    [
        ("h2o", {}, "unknown compression method 'h2o'; known: full, quantize"),
        ("snapkv", {"windw": 8}, "snapkv: unknown option(s) windw; allowed: budget, kernel"),
        ("knorm", {"ratio": 1.0}, "knorm: ratio must be in [0, 1), got 1.0"),
        ("knorm", {"ratio": "half"}, "knorm: ratio must be a number, got 'half'"),
        ("streaming_llm", {"budget": 0}, "streaming_llm: budget must be at least 1"),
        ("streaming_llm", {"sinks": -1}, "streaming_llm: sinks must be >= 0"),
        ("snapkv", {"kernel": 4}, "snapkv: kernel must be an odd number"),
        ("full", {"kv_bits": 7}, "full: kv_bits must be one of (2, 3, 4, 5, 6, 8)"),
        ("full", {"kv_group_size": 48}, "full: kv_group_size must be one of (32, 64, 128)"),
        ("quantize", {"kv_bits": None}, "quantize: kv_bits is required"),
        ("quantize", {"ratio": 0.5}, "quantize evicts nothing"),
    ],
)
def test_bad_config_is_a_clear_error(method, config, message):
    with pytest.raises(PressConfigError) as e:
        make_press(method, config)
    assert str(e.value).startswith(message)
