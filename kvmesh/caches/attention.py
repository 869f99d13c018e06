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

import mlx.core as mx
import mlx.nn as nn

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
