"""Every use kvmesh makes of the private parts of mlx-lm's `LRUPromptCache`, each checked by
tests/unit/serve/test_serve_compat.py.

The server's memory tier (kvmesh.serve.engine.prompt_cache.MemoryTier) is mlx-lm's prompt cache, which
lacks three things in public: how many tokens of a prompt an entry serves without copying it (its
trie's search), an entry read by its key (the trie's get) and an entry made the most recently used
(its LRU order). They live here alone, so that an mlx-lm release that moves one fails the test that
names it, not a lookup that serves the wrong prefix.
"""

from typing import Any

from mlx_lm.models.cache import LRUPromptCache, PromptTrieResult

__all__ = ["PromptTrieResult", "entry", "search", "touch"]


def search(cache: LRUPromptCache, model: Any, tokens: list[int]) -> PromptTrieResult:
    """The keys of `model`'s entries nearest `tokens`: the exact one, the longest shorter one, the
    shortest longer one, and how many tokens the longer one shares (`PromptTrieResult`)."""
    return cache._trie.search(model, tokens)


def entry(cache: LRUPromptCache, model: Any, key: list[int]) -> Any:
    """The entry of `model` under `key` (its `prompt_cache` and `cache_type`); KeyError when none."""
    return cache._trie.get(model, key)


def touch(cache: LRUPromptCache, model: Any, key: list[int], cache_type: str) -> None:
    """Make the entry of `model` under `key` the most recently used: the last its kind evicts."""
    cache._lru.remove(model, key)
    cache._lru.push(model, key, cache_type)
