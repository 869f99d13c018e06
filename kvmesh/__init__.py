"""kvmesh: share LLM KV caches between Apple-silicon Macs on one network.

The library's face, everything a Python user needs in one namespace::

    import kvmesh

    fp = kvmesh.fingerprint("path/to/model")                 # what exactly the model is
    cached = kvmesh.prefill(model, tokens, kvmesh.make_press("snapkv", {"ratio": 0.5}))
    store = kvmesh.CacheStore()                              # the local store
    store.add(*kvmesh.encode_cache(cached.cache, fp, tokens, press))
    with kvmesh.PeerClient("192.168.1.20:7077") as peer:     # a peer's caches
        fetched = kvmesh.fetch_cache(peer, cache_id, kvmesh.ReceiverProfile(fp, prompt=tokens), store=store)
    result = kvmesh.generate(model, fp, prompt, store, peers=[...])  # the mesh's longest prefix

Names are imported on first use, so `import kvmesh` (and the `kvmesh` command) loads no MLX until
something that handles arrays is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmesh.versions import PROTOCOL_VERSION, SCHEMA_VERSION, __version__

# name -> the module that defines it
_EXPORTS = {
    "ModelFingerprint": "kvmesh.model.fingerprint",
    "fingerprint": "kvmesh.model.fingerprint",
    "make_test_model": "kvmesh.model.testmodels",
    "Press": "kvmesh.caches.presses",
    "make_press": "kvmesh.caches.presses",
    "Prefilled": "kvmesh.caches.prefill",
    "prefill": "kvmesh.caches.prefill",
    "generate_from_cache": "kvmesh.caches.prefill",
    "EncodeOptions": "kvmesh.codec.encode",
    "encode_cache": "kvmesh.codec.encode",
    "decode_chunks": "kvmesh.codec.decode",
    "ReceiverProfile": "kvmesh.codec.compat",
    "check_manifest": "kvmesh.codec.compat",
    "layer_report": "kvmesh.codec.manifest",
    "CacheStore": "kvmesh.store.cache_store",
    "PeerClient": "kvmesh.net.client",
    "start_server": "kvmesh.net.server",
    "CachedPrefix": "kvmesh.reuse.records",
    "Fetched": "kvmesh.reuse.fetch",
    "fetch_cache": "kvmesh.reuse.fetch",
    "generate": "kvmesh.reuse.generate",
    "find_prefix": "kvmesh.reuse.find",
    "load_prefix": "kvmesh.reuse.find",
    "Generation": "kvmesh.reuse.records",
    "KvmeshError": "kvmesh.errors",
    "CacheRejected": "kvmesh.errors",
    "Rejection": "kvmesh.errors",
    "PeerError": "kvmesh.errors",
    "IntegrityError": "kvmesh.errors",
    "StoreError": "kvmesh.errors",
    "NotFoundError": "kvmesh.errors",
    "UnsupportedCacheError": "kvmesh.errors",
}

__all__ = [
    "PROTOCOL_VERSION",
    "SCHEMA_VERSION",
    "CacheRejected",
    "CacheStore",
    "CachedPrefix",
    "EncodeOptions",
    "Fetched",
    "Generation",
    "IntegrityError",
    "KvmeshError",
    "ModelFingerprint",
    "NotFoundError",
    "PeerClient",
    "PeerError",
    "Prefilled",
    "Press",
    "ReceiverProfile",
    "Rejection",
    "StoreError",
    "UnsupportedCacheError",
    "__version__",
    "check_manifest",
    "decode_chunks",
    "encode_cache",
    "fetch_cache",
    "find_prefix",
    "fingerprint",
    "generate",
    "generate_from_cache",
    "layer_report",
    "load_prefix",
    "make_press",
    "make_test_model",
    "prefill",
    "start_server",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from kvmesh.caches.prefill import Prefilled, generate_from_cache, prefill
    from kvmesh.caches.presses import Press, make_press
    from kvmesh.codec.compat import ReceiverProfile, check_manifest
    from kvmesh.codec.decode import decode_chunks
    from kvmesh.codec.encode import EncodeOptions, encode_cache
    from kvmesh.codec.manifest import layer_report
    from kvmesh.errors import (
        CacheRejected,
        IntegrityError,
        KvmeshError,
        NotFoundError,
        PeerError,
        Rejection,
        StoreError,
        UnsupportedCacheError,
    )
    from kvmesh.model.fingerprint import ModelFingerprint, fingerprint
    from kvmesh.model.testmodels import make_test_model
    from kvmesh.net.client import PeerClient
    from kvmesh.net.server import start_server
    from kvmesh.reuse.fetch import Fetched, fetch_cache
    from kvmesh.reuse.find import find_prefix, load_prefix
    from kvmesh.reuse.generate import generate
    from kvmesh.reuse.records import CachedPrefix, Generation
    from kvmesh.store.cache_store import CacheStore
