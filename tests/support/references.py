"""References and comparisons: what mlx-lm generates from a whole prompt (a full prefill, which every
cached path must equal), continuations of a cache, and bit-for-bit comparisons of what they give."""

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.sample_utils import make_sampler

from kvmesh.caches.prefill import generate_from_cache
from kvmesh.codec.arrays import layer_tensors

# Full prefills: mlx-lm's plain path, the whole prompt into a fresh cache


def greedy_steps(model, prompt, n: int, **options) -> list[tuple[int, mx.array]]:
    """(token, logprobs) of n greedy steps of mlx-lm's generate_step from `prompt` (a fresh cache
    unless `prompt_cache=` is among the options, which go to generate_step)."""
    return [(int(t), lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=n, **options)]


def greedy_tokens(model, prompt, n: int) -> list[int]:
    """The n tokens mlx-lm generates greedily from the whole prompt: the reference continuation."""
    return [t for t, _ in greedy_steps(model, prompt, n)]


def mlx_lm_tokens(model, tokenizer, prompt, n: int) -> list[int]:
    """The tokens mlx-lm's stream_generate gives for `prompt` (up to n: it stops at an end of turn)."""
    return [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), n)]


def mlx_lm_text(model_and_tokenizer, messages=None, prompt=None, max_tokens=8, temperature=0.0, seed=None) -> str:
    """What mlx-lm itself generates for the same chat (`messages`) or text `prompt` and sampling settings."""
    model, tokenizer = model_and_tokenizer
    tokens = (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True) if messages else tokenizer.encode(prompt)
    )
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    return "".join(r.text for r in stream_generate(model, tokenizer, mx.array(tokens), max_tokens, sampler=sampler))


# Continuations of a cache (each changes the cache in place: pass a copy to keep it)


def steps_after(model, cache, suffix, n: int) -> list[tuple[int, mx.array]]:
    """(token, logprobs) of n greedy steps continuing `cache` with `suffix`."""
    return list(generate_from_cache(model, cache, suffix, max_tokens=n))


def tokens_after(model, cache, suffix, n: int) -> list[int]:
    """The n greedy tokens continuing `cache` with `suffix`."""
    return [t for t, _ in generate_from_cache(model, cache, suffix, max_tokens=n)]


def logprobs_after(model, cache, suffix, n: int) -> list[mx.array]:
    """The log-probabilities of n greedy steps continuing `cache` with `suffix`."""
    return [lp for _, lp in generate_from_cache(model, cache, suffix, max_tokens=n)]


# Bit for bit


def same_arrays(a, b) -> bool:
    """As many arrays in each, pairwise equal bit for bit."""
    return len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def same_tensors(a, b) -> bool:
    """Every tensor of every layer of two caches equal bit for bit."""
    return len(a) == len(b) and all(same_arrays(layer_tensors(x), layer_tensors(y)) for x, y in zip(a, b))


def rounded_alike(a, b, ulps: int = 16) -> bool:
    """Two arrays of decoded numbers of one shape and dtype equal, or apart by at most `ulps` units
    in the last place of their dtype at their largest magnitude: what a prefix's rows may be from
    the whole's where BLAS rounds each row by how many rows it multiplies at once (OpenBLAS
    0.3.30-0.3.31 on an AMD EPYC CPU: kvmesh.codec.prediction.rowwise_product; the codec's tests
    needed 8 there). A wrong row, or one off by a position, is apart by its own size."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = (np.asarray(t.astype(mx.float32)) for t in (a, b))
    largest = max(float(np.abs(x).max(initial=0.0)), float(np.abs(y).max(initial=0.0)))
    return float(np.abs(x - y).max(initial=0.0)) <= ulps * float(mx.finfo(a.dtype).eps) * largest


def assert_same_caches(a, b) -> None:
    """Two caches of the same classes, positions, dtypes and tensors, bit for bit."""
    assert [type(x) for x in a] == [type(y) for y in b]
    assert [(x.offset, x.n_kept) for x in a] == [(y.offset, y.n_kept) for y in b]
    for x, y in zip(a, b):
        for s, t in zip(layer_tensors(x), layer_tensors(y)):
            assert s.dtype == t.dtype and mx.array_equal(s, t).item()


def assert_same_generation(got, want) -> None:
    """Identical tokens and bit-identical log-probabilities at every step, of (token, logprobs) lists."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert mx.array_equal(a, b).item()
