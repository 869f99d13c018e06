"""The local store of caches: entry files and their SQLite index. Needs no MLX."""

from kvmesh.store.cache_store import CacheStore, PrefixMatch, StoredEntry

__all__ = ["CacheStore", "PrefixMatch", "StoredEntry"]
