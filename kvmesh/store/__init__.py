"""The local store of caches: entry files and their SQLite index. Needs no MLX.

Its names load on first use, so `kvmesh.store.budget` (a settings default) costs no store import.
"""

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["CacheStore", "PrefixMatch", "StoredEntry"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvmesh.store' has no attribute {name!r}")
    return getattr(importlib.import_module("kvmesh.store.cache_store"), name)


if TYPE_CHECKING:
    from kvmesh.store.cache_store import CacheStore, PrefixMatch, StoredEntry
