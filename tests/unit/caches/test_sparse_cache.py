"""Sparse caches must behave exactly like mlx-lm's own caches, on the real tiny models."""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

from kvmesh.caches.attention import wrap_attention
from kvmesh.caches.prefill import Prefilled, generate_from_cache, greedy, prefill, run_prompt
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import (
    SparseKVCache,
    SparseQuantizedKVCache,
    sparse_from_dense,
    stored_nbytes,
)
from kvmesh.errors import UnsupportedCacheError
from support.references import assert_same_generation, greedy_steps

STEPS = 6


def generate_from_prefill(model, prefilled: Prefilled, *, max_tokens: int):
    """Continue a prompt that `prefill` processed entirely, its first token from the prefill's logits:
    yields (token, logprobs)."""
    logprobs = prefilled.logits - mx.logsumexp(prefilled.logits, keepdims=True)
    first = greedy(logprobs).item()
    yield first, logprobs
    yield from generate_from_cache(model, prefilled.cache, [first], max_tokens=max_tokens - 1)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_nothing_evicted_equals_mlx_lm(tiny_in, prompt_ids, dtype):
    model = tiny_in(dtype)
    want = greedy_steps(model, prompt_ids, STEPS)
    # A cache of the prefix, continued with only the suffix tokens...
    cached = prefill(model, prompt_ids[:-7])
    assert all(type(c) is SparseKVCache for c in cached.cache)
    assert_same_generation(list(generate_from_cache(model, cached.cache, prompt_ids[-7:], max_tokens=STEPS)), want)
    # ...and the whole prompt prefilled, continued from the prefill's logits.
    whole = prefill(model, prompt_ids)
    assert_same_generation(list(generate_from_prefill(model, whole, max_tokens=STEPS)), want)


def test_nothing_evicted_equals_mlx_lm_on_qwen3(qwen3, prompt_ids):
    model = qwen3[0]
    prompt = [t % 500 for t in prompt_ids]
    cached = prefill(model, prompt[:-4])
    assert_same_generation(
        list(generate_from_cache(model, cached.cache, prompt[-4:], max_tokens=STEPS)),
        greedy_steps(model, prompt, STEPS),
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_equals_mlx_lm_quantized(tiny, prompt_ids, bits):
    model = tiny[0]
    prefix, suffix = prompt_ids[:-5], prompt_ids[-5:]
    dense, _, _ = run_prompt(model, prefix)
    mlx_quantized = [c.to_quantized(group_size=64, bits=bits) for c in dense]
    want = greedy_steps(model, suffix, STEPS, prompt_cache=mlx_quantized)

    cached = prefill(model, prefix, make_press("quantize", {"kv_bits": bits}))
    assert all(type(c) is SparseQuantizedKVCache and c.bits == bits for c in cached.cache)
    assert_same_generation(list(generate_from_cache(model, cached.cache, suffix, max_tokens=STEPS)), want)


def test_kv_bits_during_generation(tiny, prompt_ids):
    """mlx-lm's own `kv_bits` switch quantizes sparse caches through their to_quantized()."""
    model = tiny[0]
    prefix, suffix = prompt_ids[:-5], prompt_ids[-5:]
    dense, _, _ = run_prompt(model, prefix)
    want = greedy_steps(model, suffix, STEPS, prompt_cache=dense, kv_bits=4, quantized_kv_start=0)
    cache = prefill(model, prefix).cache
    got = greedy_steps(model, suffix, STEPS, prompt_cache=cache, kv_bits=4, quantized_kv_start=0)
    assert_same_generation(got, want)
    assert all(type(c) is SparseQuantizedKVCache and c.bits == 4 for c in cache)


def masked_dense_generation(model, dense, keep, suffix):
    """Generate from the dense cache with exactly the evicted keys hidden, per layer and head."""
    n_old = dense[0].offset

    def wrapper(original, layer, queries, keys, values, cache, scale, mask, **kwargs):
        stored = keys[0] if isinstance(keys, (tuple, list)) else keys
        n_heads, L = queries.shape[1], queries.shape[2]
        n_kv, K = stored.shape[1], stored.shape[2]
        old = mx.ones((n_kv, n_old), dtype=mx.bool_)
        if keep[layer] is not None:
            idx = mx.broadcast_to(keep[layer], (n_kv, keep[layer].shape[-1]))
            old = mx.put_along_axis(mx.zeros_like(old), idx, mx.array(True), axis=-1)
        # Positions appended after the prefix are causal: query i sits at K - L + i.
        new = mx.arange(n_old, K)[None] <= mx.arange(K - L, K)[:, None]
        full = mx.concatenate(
            [mx.broadcast_to(old[:, None], (n_kv, L, n_old)), mx.broadcast_to(new, (n_kv, L, K - n_old))],
            axis=-1,
        )
        # The float path wants a mask per query head, the quantized path one per kv head.
        if not hasattr(cache, "bits"):
            full = mx.repeat(full, n_heads // n_kv, axis=0)
        return original(queries, keys, values, cache=cache, scale=scale, mask=full[None], **kwargs)

    with wrap_attention(model, dense, wrapper):
        return list(generate_from_cache(model, dense, suffix, max_tokens=STEPS))


@pytest.mark.parametrize(
    "method, config",
    [
        ("streaming_llm", {"budget": 80, "sinks": 4}),
        ("knorm", {"ratio": 0.5}),
        ("snapkv", {"ratio": 0.6, "window": 16}),
        ("snapkv", {"ratio": 0.5, "window": 16, "kv_bits": 8}),
    ],
    ids=["streaming_llm", "knorm", "snapkv", "snapkv-8bit"],
)
def test_evicted_equals_dense_with_evicted_keys_masked(tiny, prompt_ids, method, config):
    model = tiny[0]
    press = make_press(method, config)
    prefix, suffix = prompt_ids[:-6], prompt_ids[-6:]
    dense, _, observed = run_prompt(model, prefix, observe_last=press.needs_queries)
    keep = [press.select(c.keys[..., : c.offset, :], observed and observed[i]) for i, c in enumerate(dense)]
    sparse = press.apply(dense, observed)
    assert all(c.n_kept < c.offset == len(prefix) for c in sparse)

    if press.kv_bits:
        dense = [c.to_quantized(group_size=press.kv_group_size, bits=press.kv_bits) for c in dense]
    want = masked_dense_generation(model, copy.deepcopy(dense), keep, suffix)
    assert_same_generation(list(generate_from_cache(model, sparse, suffix, max_tokens=STEPS)), want)


@pytest.mark.parametrize("config", [{"budget": 100}, {"budget": 100, "kv_bits": 4}], ids=["float", "4bit"])
def test_save_and_load_prompt_cache_continue_identically(tiny, prompt_ids, tmp_path, config):
    model = tiny[0]
    cached = prefill(model, prompt_ids[:-3], make_press("streaming_llm", config))
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cached.cache, {"note": "kvmesh"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "kvmesh"}
    assert [type(c) for c in loaded] == [type(c) for c in cached.cache]
    assert [(c.offset, c.n_kept) for c in loaded] == [(c.offset, c.n_kept) for c in cached.cache]
    want = list(generate_from_cache(model, cached.cache, prompt_ids[-3:], max_tokens=STEPS))
    assert_same_generation(list(generate_from_cache(model, loaded, prompt_ids[-3:], max_tokens=STEPS)), want)


def test_trim_takes_back_only_what_was_appended_after_eviction(tiny, prompt_ids):
    model = tiny[0]
    cache = prefill(model, prompt_ids[:200], make_press("streaming_llm", {"budget": 50})).cache
    assert [c.trim(4) for c in cache] == [0] * len(cache)
    before = [(c.offset, c.n_kept) for c in cache]
    model(mx.array(prompt_ids[200:203])[None], cache=cache)
    assert [c.trim(5) for c in cache] == [3] * len(cache)
    assert [(c.offset, c.n_kept) for c in cache] == before
    # What was trimmed is gone: continuing equals continuing a cache that never saw those tokens.
    fresh = prefill(model, prompt_ids[:200], make_press("streaming_llm", {"budget": 50})).cache
    suffix = prompt_ids[210:214]
    assert_same_generation(
        list(generate_from_cache(model, cache, suffix, max_tokens=3)),
        list(generate_from_cache(model, fresh, suffix, max_tokens=3)),
    )


def test_masks_count_stored_positions_not_the_offset():
    cache = SparseKVCache.from_arrays(mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)), offset=40)
    assert cache.make_mask(3, return_array=True).shape == (3, 8)
    assert cache.make_mask(3) == "causal"
    assert cache.make_mask(1) is None
    assert (cache.size(), cache.offset) == (5, 40)
    with pytest.raises(UnsupportedCacheError, match="sliding-window"):
        cache.make_mask(3, window_size=4)


def test_new_tokens_are_written_after_the_kept_ones():
    cache = SparseKVCache.from_arrays(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)), offset=40)
    keys, values = cache.update_and_fetch(mx.full((1, 2, 2, 8), 7.0), mx.full((1, 2, 2, 8), 7.0))
    assert keys.shape == (1, 2, 7, 8) and (cache.offset, cache.n_kept) == (42, 7)
    assert mx.array_equal(keys[:, :, 5:], mx.full((1, 2, 2, 8), 7.0)).item()
    assert mx.array_equal(keys[:, :, :5], mx.ones((1, 2, 5, 8))).item()


def test_to_quantized_keeps_both_counters():
    cache = SparseKVCache.from_arrays(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)), offset=40)
    quantized = cache.to_quantized(group_size=64, bits=8)
    assert (quantized.offset, quantized.n_kept, quantized.bits) == (40, 5, 8)
    assert quantized.keys[0].shape[2] == 5
    assert stored_nbytes(quantized) < stored_nbytes(cache)


def test_more_stored_than_processed_is_refused():
    with pytest.raises(ValueError, match="cannot exceed the logical offset"):
        SparseKVCache.from_arrays(mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)), offset=4)


def test_per_head_indices_must_match_heads():
    dense = KVCache()
    dense.update_and_fetch(mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)))
    with pytest.raises(ValueError, match="per-head indices for 3 heads"):
        sparse_from_dense(dense, mx.zeros((3, 2), dtype=mx.int32))


def test_rotating_cache_is_refused():
    with pytest.raises(UnsupportedCacheError, match="RotatingKVCache"):
        sparse_from_dense(RotatingKVCache(max_size=16))


def test_mlx_lm_stream_generate_and_generate_take_sparse_caches(tiny, prompt_ids):
    import mlx_lm

    model, tokenizer = tiny
    prefix, suffix = prompt_ids[:-4], prompt_ids[-4:]
    dense, _, _ = run_prompt(model, prefix)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, suffix, max_tokens=6, prompt_cache=dense)]
    sparse = prefill(model, prefix).cache
    got = [r.token for r in mlx_lm.stream_generate(model, tokenizer, suffix, max_tokens=6, prompt_cache=sparse)]
    assert got == want and len(got) == 6
    evicted = prefill(model, prefix, make_press("snapkv", {"ratio": 0.5, "window": 16})).cache
    before = [(c.offset, c.n_kept) for c in evicted]
    text = mlx_lm.generate(model, tokenizer, suffix, max_tokens=6, prompt_cache=evicted)
    assert text
    # Every new token was stored after the kept ones, and counted in the logical offset too.
    grown = {(c.offset - o, c.n_kept - k) for c, (o, k) in zip(evicted, before)}
    assert len(grown) == 1 and (grew := grown.pop())[0] == grew[1] >= len(suffix) + 5
