"""mlx-lm's private names that kvmesh.compat.mlx_lm uses, each checked for what kvmesh assumes of it:
an mlx-lm release that renames one, moves its signature or changes what it means fails here, by
name, instead of in a cache that generates wrongly."""

import importlib.machinery
import importlib.util
import inspect

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

from kvmesh.compat import mlx_lm as compat
from kvmesh.model.presets import PRESETS
from kvmesh.model.testmodels import preset_config


def test_base_cache_is_the_base_of_mlx_lms_caches_and_rebuilds_from_state():
    """Sparse caches subclass it: mlx-lm's caches must still share it, and its `from_state` (what
    load_prompt_cache calls) must still build without __init__ and set `state`."""
    assert compat.BaseCache is mlx_cache._BaseCache
    for cls in (KVCache, RotatingKVCache, mlx_cache.QuantizedKVCache, mlx_cache.ArraysCache):
        assert issubclass(cls, compat.BaseCache), cls

    class Probe(compat.BaseCache):
        def __init__(self):
            raise AssertionError("from_state must not call __init__")

        @property
        def state(self):
            return self.held

        @state.setter
        def state(self, v):
            self.held = v

    assert Probe.from_state(["a"]).state == ["a"]
    assert {"is_trimmable", "size", "empty", "nbytes"} <= set(dir(compat.BaseCache))


def test_an_unknown_name_of_the_compat_module_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        compat.Missing  # noqa: B018


def test_model_classes_are_the_ones_mlx_lm_loads_for_a_config():
    assert list(inspect.signature(mlx_lm.utils._get_classes).parameters) == ["config"]
    for name in ("tiny", "tiny-gemma3"):
        config = preset_config(PRESETS[name])
        model_class, args_class = compat.model_classes(config)
        model = model_class(args_class.from_dict(config))
        assert model_class.__module__ == f"mlx_lm.models.{config['model_type']}"
        assert len(model.layers) == config["num_hidden_layers"]


def window_prefilled(window: int, keep: int, tokens: int, step: int) -> RotatingKVCache:
    """A sliding-window layer fed `tokens` positions, `step` at a time, as a prefill does."""
    layer = RotatingKVCache(max_size=window, keep=keep)
    mx.random.seed(1)
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        layer.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return layer


@pytest.mark.parametrize(("tokens", "step"), [(20, 20), (50, 7), (50, 1), (33, 33)])
def test_a_window_rebuilt_at_its_write_index_continues_as_the_original(tokens, step):
    """temporal_order and set_write_index (RotatingKVCache._temporal_order and ._idx): a window
    rebuilt from its temporal-order positions, its write index at their end, must answer the next
    token, one at a time and several at once, exactly as the layer it was taken from."""
    from kvmesh.caches.kinds import window_snapshot

    assert list(inspect.signature(RotatingKVCache._temporal_order).parameters) == ["self", "v"]
    for n in (1, 5):
        original = window_prefilled(32, 4, tokens, step)
        rebuilt = window_snapshot(original)
        assert rebuilt._idx == rebuilt.keys.shape[2] == min(tokens, 32)
        for _ in range(3):
            k, v = mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8))
            want, got = original.update_and_fetch(k, v), rebuilt.update_and_fetch(k, v)
            for a, b in zip(want, got):
                assert mx.array_equal(compat.temporal_order(original, a), compat.temporal_order(rebuilt, b))
            assert original.offset == rebuilt.offset


def test_load_prompt_cache_rebuilds_a_registered_class(tmp_path):
    """register_cache_class: load_prompt_cache must still resolve a file's class names in its
    module's globals."""

    class CompatProbeCache(KVCache):
        pass

    compat.register_cache_class(CompatProbeCache)
    try:
        layer = CompatProbeCache()
        layer.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
        save_prompt_cache(str(tmp_path / "c.safetensors"), [layer])
        (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
        assert type(loaded) is CompatProbeCache and loaded.offset == 3
    finally:
        delattr(mlx_cache, CompatProbeCache.__name__)


def test_mlx_lm_utils_still_sets_the_descriptor_limit_as_it_is_imported():
    """tolerate_mlx_lm_descriptor_limit wraps the import of mlx_lm.utils: it must still be the module
    that sets the limit, at import, and be found by the path finder as a source file (the whole
    path, a low hard limit and a model loaded under it, is tests/unit/store/test_store_environment.py's)."""
    package = importlib.util.find_spec("mlx_lm")
    assert package is not None
    spec = importlib.machinery.PathFinder.find_spec(compat.MLX_LM_UTILS, package.submodule_search_locations)
    assert spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    source = spec.loader.get_source(compat.MLX_LM_UTILS)
    module_level = [line for line in source.splitlines() if line.startswith("resource.setrlimit(")]
    assert module_level == ["resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 4096))"]
    assert compat.MLX_LM_HARD_LIMIT == 4096


def test_rope_frequencies_are_those_llama3_rope_rotates_with():
    """rope_frequencies (Llama3RoPE._freqs): the codec re-applies a scaled RoPE with exactly them."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    rope = Llama3RoPE(16, scaling_config={"factor": 8.0, "original_max_position_embeddings": 64})
    freqs = compat.rope_frequencies(rope)
    assert freqs is not None and freqs.shape == (8,)
    x = mx.random.normal((1, 2, 5, 16))
    rotated = mx.fast.rope(x, 16, traditional=False, base=None, scale=1.0, offset=3, freqs=freqs)
    assert mx.array_equal(rope(x, offset=3), rotated)
    assert compat.rope_frequencies(nn.RoPE(16, base=10000)) is None  # a plain RoPE rotates by its base


def test_hf_tokenizer_is_the_one_mlx_lms_wrapper_encodes_with(tiny):
    """hf_tokenizer (TokenizerWrapper._tokenizer): llguidance reads its vocabulary."""
    _, tokenizer = tiny
    inner = compat.hf_tokenizer(tokenizer)
    assert inner is not tokenizer and inner.encode("rivers bend") == tokenizer.encode("rivers bend")
    assert len(inner.get_vocab()) == len(tokenizer.get_vocab())
