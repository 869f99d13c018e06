"""See inside a model's attention without changing the model.

mlx-lm model files call the shared `scaled_dot_product_attention` from their own module namespace,
passing the layer's cache. Swapping that one name for the duration of a forward pass lets kvmesh
read each layer's post-RoPE queries (SnapKV scores tokens with them) or add a mask (tests compare
a sparse cache against a dense one with the evicted keys hidden), for every model family that uses
the shared function, with no second prefill and no copy of model code.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from kvmesh.caches.kinds import fork
from kvmesh.errors import UnsupportedCacheError

# fn(original_sdpa, layer_index, queries, keys, values, cache, scale, mask, **kwargs) -> output
AttentionWrapper = Callable[..., mx.array]


@contextmanager
def wrap_attention(model: nn.Module, cache: list, wrapper: AttentionWrapper) -> Iterator[None]:
    """Route every attention call of `model` through `wrapper` while the context is open.

    The layer is identified by the cache object the model passes along, so `cache` must be the
    list given to the forward pass.
    """
    # A model file may take its attention class from another (qwen3_5 uses qwen3_next's).
    modules = {sys.modules[type(m).__module__] for _, m in model.named_modules()}
    name = "scaled_dot_product_attention"
    patched = {m: getattr(m, name) for m in modules if hasattr(m, name)}
    if not patched:
        raise UnsupportedCacheError(
            f"{type(model).__module__} does not use mlx-lm's shared attention function; "
            "attention-based compression methods cannot observe it"
        )
    # A composite layer (mlx-lm's CacheList) passes one of its parts to attention.
    layer_of = {id(part): i for i, c in enumerate(cache) for part in (c, *getattr(c, "caches", ()))}

    def routing(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
        def routed(queries, keys, values, cache, scale, mask, **kwargs):
            return wrapper(original, layer_of[id(cache)], queries, keys, values, cache, scale, mask, **kwargs)

        return routed

    for module, original in patched.items():
        setattr(module, name, routing(original))
    try:
        yield
    finally:
        for module, original in patched.items():
            setattr(module, name, original)


@contextmanager
def record_queries(model: nn.Module, cache: list) -> Iterator[dict]:
    """Collect {layer: (queries, scale)} of the forward passes run inside the context."""
    seen: dict[int, tuple[mx.array, float]] = {}

    def wrapper(original, layer, queries, keys, values, cache, scale, mask, **kwargs):
        # The quantized attention path scales queries in place: keep our own copy.
        seen[layer] = (mx.array(queries), scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    with wrap_attention(model, cache, wrapper):
        yield seen


def reconstruction_scores(
    model: nn.Module, cache: list, tokens: list[int], *, step_size: int = 512, observed: dict | None = None
) -> dict:
    """{layer: (kv_heads, n) scores} of the n cached positions of each full-attention layer: the most
    attention any query of a second, teacher-forced pass over the same tokens (the model repeating
    its context) gives each position, over the query heads sharing a kv head (KVzip's scoring).
    `observed` ({layer: (queries, scale)} of the prompt's last tokens, from `run_prompt`) adds the
    most attention those queries gave.

    The pass runs on copies of the layers, so `cache` is left as it was.
    """
    n = len(tokens)
    work = [fork(c) for c in cache]
    scores: dict[int, mx.array] = {}
    for layer, (queries, scale) in (observed or {}).items():
        if type(cache[layer]) is KVCache:
            keys = cast(mx.array, cache[layer].keys)[..., :n, :]
            scores[layer] = window_attention(queries, keys, scale).max(axis=1)

    def wrapper(original, layer, queries, keys, values, cache, scale, mask, **kwargs):
        if type(cache) is KVCache:
            weights = window_attention(queries, keys, scale)[..., :n].max(axis=1)
            scores[layer] = weights if layer not in scores else mx.maximum(scores[layer], weights)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    with wrap_attention(model, work, wrapper):
        for start in range(0, n, step_size):
            model(mx.array(tokens[start : start + step_size])[None], cache=work)
            mx.eval(list(scores.values()))
    return scores


def window_attention(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """Softmax attention (fp32) of the last w queries onto all n keys: (n_kv, n_heads/n_kv * w, n)."""
    _, n_heads, w, d = queries.shape
    n_kv, n = keys.shape[1], keys.shape[2]
    q = queries[0].astype(mx.float32).reshape(n_kv, (n_heads // n_kv) * w, d)
    logits = (q * scale) @ keys[0].astype(mx.float32).transpose(0, 2, 1)
    # Query i of the window sits at position n - w + i and must not see later positions.
    pos = mx.tile(mx.arange(n - w, n), n_heads // n_kv)
    logits = mx.where(mx.arange(n)[None] <= pos[:, None], logits, -mx.inf)
    return mx.softmax(logits, axis=-1)
