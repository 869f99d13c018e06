"""Every use kvmesh makes of mlx-lm's private names, each checked by tests/unit/model/test_compat_names.py.

mlx-lm's public API lacks what kvmesh needs in seven places: a base class for caches of its own, the
model classes of a config (to build a model from random weights), a sliding-window layer's write
index and temporal order (to share and rebuild one), the class names `load_prompt_cache` resolves,
the frequencies of a RoPE that scales them (to remove and re-apply it in the transform codec), the
Hugging Face tokenizer inside its wrapper (for grammars), and a way through the descriptor limit
mlx_lm.utils sets as it is imported. They live here alone,
so that an mlx-lm release that moves one fails the test that names it, not a cache that generates
wrongly.

Importing this module imports no mlx-lm (`tolerate_mlx_lm_descriptor_limit` must run before the
first import of it): `BaseCache` is looked up when it is first named.
"""

import importlib.abc
import importlib.machinery
import logging
import resource
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache
    from mlx_lm.models.cache import _BaseCache as BaseCache

__all__ = [
    "BaseCache",
    "hf_tokenizer",
    "model_classes",
    "register_cache_class",
    "rope_frequencies",
    "set_write_index",
    "temporal_order",
    "tolerate_mlx_lm_descriptor_limit",
]

log = logging.getLogger(__name__)
# mlx_lm.utils, as it is imported, sets the descriptor limit to (2048, 4096) "for large models with
# lots of files"; under a lower hard limit that raises ValueError, unless the process may raise it.
MLX_LM_UTILS = "mlx_lm.utils"
MLX_LM_HARD_LIMIT = 4096


def __getattr__(name: str) -> Any:
    """`BaseCache`: mlx-lm's `_BaseCache`, the base of every cache class its code checks for and its
    `load_prompt_cache` rebuilds (`from_state`), imported only when a module first names it."""
    if name == "BaseCache":
        from mlx_lm.models.cache import _BaseCache

        return _BaseCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_classes(config: dict) -> tuple[Any, Any]:
    """(Model, ModelArgs) of an mlx-lm architecture for a config.json's contents, as `mlx_lm.load`
    picks them (its remappings included), without loading any weights."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def temporal_order(layer: "RotatingKVCache", v: "mx.array") -> "mx.array":
    """A sliding-window layer's buffer `v` (its keys or values) in temporal order: mlx-lm's own
    reordering, as its next multi-token update does it."""
    return layer._temporal_order(v)


def set_write_index(layer: "RotatingKVCache", index: int) -> None:
    """Set where a sliding-window layer writes its next position: after a rebuild from temporal-order
    positions, the end of them, so that mlx-lm wraps or grows the buffer as after a prefill."""
    layer._idx = index


def rope_frequencies(rope: Any) -> "mx.array | None":
    """The frequencies an mlx-lm RoPE module that scales them itself rotates with (`Llama3RoPE`'s
    `_freqs`, which its call hands to `mx.fast.rope` as `freqs`); None for one that rotates by `base`."""
    return getattr(rope, "_freqs", None)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (llguidance reads its vocabulary)."""
    return tokenizer._tokenizer


def register_cache_class(cls: type) -> None:
    """Make `load_prompt_cache` rebuild a cache class of kvmesh's own: it resolves the class names a
    file stores in the globals of mlx-lm's cache module."""
    from mlx_lm.models import cache

    setattr(cache, cls.__name__, cls)


def tolerate_mlx_lm_descriptor_limit() -> None:
    """Let mlx-lm load under a hard descriptor limit below 4,096 (a service's, `ulimit -Hn 1024`).

    mlx_lm.utils raises the limit to (2048, 4096) on import, and without the privilege to raise a
    hard limit that fails: every model command ended in "unexpected ValueError". Call this before
    mlx-lm is first imported (any `mlx_lm` import loads mlx_lm.utils): where the hard limit is that
    low, that one import keeps within it (the soft limit goes as high as the hard one allows).
    Loads nothing itself; elsewhere, and once mlx-lm is loaded, it does nothing.
    """
    if MLX_LM_UTILS in sys.modules or any(isinstance(f, _WithinDescriptorLimit) for f in sys.meta_path):
        return
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= MLX_LM_HARD_LIMIT:
        return
    sys.meta_path.insert(0, _WithinDescriptorLimit())


class _WithinDescriptorLimit(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds mlx_lm.utils as the other finders do, and runs it with its descriptor-limit call
    kept within the hard limit; gone from sys.meta_path after that one import."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MLX_LM_UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner  # the module looks loaded as any other
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        with descriptor_limit_within_hard_limit():
            self.inner.exec_module(module)


@contextmanager
def descriptor_limit_within_hard_limit() -> Iterator[None]:
    """While it lasts, a request for more descriptors than the hard limit allows gets that limit."""
    setrlimit = resource.setrlimit

    def within(which: int, limits: tuple[int, int]) -> None:
        try:
            setrlimit(which, limits)
        except ValueError:
            if which != resource.RLIMIT_NOFILE:
                raise
            hard = resource.getrlimit(which)[1]
            log.debug("mlx-lm asked for %s descriptors; the hard limit is %s", limits, hard)
            setrlimit(which, (min(limits[0], hard), hard))

    resource.setrlimit = within
    try:
        yield
    finally:
        resource.setrlimit = setrlimit
