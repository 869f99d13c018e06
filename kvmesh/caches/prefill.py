"""Prefill a prompt with a local mlx-lm model into a (pressed) cache, and continue from such caches.

The last prompt token needs care. mlx-lm generation always feeds at least one token, and after
eviction the cache cannot be trimmed back to re-feed the last prompt token. So `prefill` processes
the whole prompt and keeps the logits of its last position (`Prefilled.logits`): the first token
after the prompt is sampled from those, and generation continues from the cache with that token. A
consumer that holds a cache of a prefix feeds only its suffix instead (`generate_from_cache`).
"""

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from kvmesh.caches.attention import reconstruction_scores, record_queries
from kvmesh.caches.kinds import check_supported
from kvmesh.caches.presses import Press
from kvmesh.caches.quality import tail_kl
from kvmesh.caches.sparse import stored_nbytes
from kvmesh.progress import Progress


@dataclass
class Prefilled:
    cache: list
    # (vocab,) logits after the last prompt token: the first generated token comes from these.
    logits: mx.array
    num_tokens: int
    # Bytes of the dense cache before the press, and of `cache` after it.
    dense_nbytes: int
    nbytes: int
    # What a lossy press cost, measured on the prompt's own tail (kvmesh.caches.quality); None: lossless.
    tail_kl: float | None = None


def run_prompt(
    model: nn.Module,
    tokens,
    *,
    observe_last: int = 0,
    step_size: int = 512,
    progress: Progress | None = None,
) -> tuple[list, mx.array, dict | None]:
    """Run `tokens` through `model` into a fresh dense cache.

    Returns the cache, the logits after the last token, and, when `observe_last` > 0, the queries
    of the last `observe_last` tokens per layer (what attention-based presses score with).
    """
    tokens = mx.array(tokens)
    n = tokens.size
    if n == 0:
        raise ValueError("cannot prefill an empty prompt")
    cache = make_prompt_cache(model)
    check_supported(cache)
    progress = progress or (lambda done, total: None)

    # The last chunk holds the observed tokens (and at least one, for the logits).
    head = n - max(1, min(observe_last, n))
    for start in range(0, head, step_size):
        model(tokens[start : min(start + step_size, head)][None], cache=cache)
        mx.eval([c.state for c in cache])
        progress(min(start + step_size, head), n)
    with record_queries(model, cache) if observe_last else nullcontext() as observed:
        logits = model(tokens[head:][None], cache=cache)[0, -1]
        mx.eval(logits, [c.state for c in cache])
    progress(n, n)
    return cache, logits, observed


def prefill(
    model: nn.Module,
    tokens,
    press: Press | None = None,
    *,
    step_size: int = 512,
    progress: Progress | None = None,
) -> Prefilled:
    """Run `tokens` through `model` into a fresh cache, then compress it with `press`."""
    press = press or Press()
    cache, logits, observed = run_prompt(
        model, tokens, observe_last=press.needs_queries, step_size=step_size, progress=progress
    )
    if press.needs_reconstruction:
        observed = reconstruction_scores(model, cache, list(tokens), step_size=step_size, observed=observed)
    pressed = press.apply(cache, observed)
    return Prefilled(
        cache=pressed,
        logits=logits,
        num_tokens=len(tokens),
        dense_nbytes=sum(stored_nbytes(c) for c in cache),
        nbytes=sum(stored_nbytes(c) for c in pressed),
        tail_kl=tail_kl(model, cache, pressed, list(tokens)) if press.lossy else None,
    )


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def generate_from_cache(
    model: nn.Module, cache: list, suffix, *, max_tokens: int, sampler=greedy, progress: Progress | None = None
) -> Iterator[tuple[int, mx.array]]:
    """Continue a prompt whose prefix is in `cache` by feeding only `suffix`: yields (token, logprobs).
    `progress(done, total)` follows the prefill of `suffix` (mlx-lm's prompt_progress_callback)."""
    suffix = mx.array(suffix)
    if suffix.size == 0:
        raise ValueError(
            "the prompt adds no token to the cached prefix: generation needs at least one new "
            "token to feed (use the prefill's logits, or a cache of a shorter prefix)"
        )
    steps = generate_step(
        suffix, model, prompt_cache=cache, max_tokens=max_tokens, sampler=sampler, prompt_progress_callback=progress
    )
    for token, logprobs in steps:
        yield int(token), logprobs


# A calibration times prefills of these lengths: two, so that attention's growing share shows.
CALIBRATION_LENGTHS = (128, 512)


def time_prefills(model: nn.Module, lengths: Sequence[int] = CALIBRATION_LENGTHS) -> list[tuple[int, float]]:
    """(tokens, seconds) of a fresh prefill of each length of arbitrary tokens, on this machine.

    A short pass runs first: mlx-lm loads weights lazily, so the first forward pass also reads them.
    """
    run_prompt(model, [1] * 8)
    timed = []
    for n in lengths:
        start = time.perf_counter()
        run_prompt(model, [1 + i % 97 for i in range(n)])
        timed.append((n, time.perf_counter() - start))
    return timed
