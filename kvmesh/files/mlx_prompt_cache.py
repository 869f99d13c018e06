"""mlx-lm prompt-cache files in and out of the store.

Caches made by `mlx_lm.cache_prompt` enter the mesh with `import_prompt_cache`; a cache from the
mesh becomes a file for `mlx_lm.generate --prompt-cache-file` with `export_prompt_cache`.
mlx-lm's files do not record the prompt's tokens, so importing one needs them.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from kvmesh.caches.kinds import cached_tokens, check_supported, snapshot
from kvmesh.caches.presses import press_shown_by
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.codec.manifest import leaf_layers
from kvmesh.errors import KvmeshError, PromptMismatch
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import stored_bases
from kvmesh.v1 import cache_pb2 as pb


def import_prompt_cache(
    store: CacheStore,
    path: Path | str,
    model: ModelFingerprint,
    tokens: Sequence[int],
    *,
    options: EncodeOptions | None = None,
) -> pb.CacheManifest:
    """Store an mlx-lm prompt-cache file made by `model` from `tokens`."""
    try:
        cache = load_prompt_cache(str(path))
    except Exception as e:  # mlx raises plain RuntimeError/ValueError for unreadable files
        raise KvmeshError(f"{path}: not an mlx-lm prompt cache: {e}") from e
    if len(cache) != model.num_layers:
        raise KvmeshError(f"{path}: {len(cache)} layers, the model has {model.num_layers}")
    check_supported(cache)
    if cached_tokens(cache) != len(tokens):
        held = cached_tokens(cache)
        raise PromptMismatch(f"{path}: the cache holds {held} tokens, the prompt has {len(tokens)}", held, len(tokens))
    layers = [snapshot(c) for c in cache]  # full attention made sparse, the other kinds as they are
    return store.add(*encode_cache(layers, model, tokens, press_shown_by(layers), options=options or EncodeOptions()))


def export_prompt_cache(store: CacheStore, cache_id: str, path: Path | str, model_path: str) -> Path:
    """Write an entry as an mlx-lm prompt-cache file for the model at `model_path` (or hub id).

    Every layer becomes one of mlx-lm's own classes (KVCache, QuantizedKVCache, RotatingKVCache,
    ArraysCache), so `mlx_lm.generate --prompt-cache-file` uses the file as is. A cache with evicted
    positions has no such form (mlx-lm's KVCache cannot hold them) and is refused, naming what does
    use it.
    """
    manifest = store.manifest(cache_id)
    full_attention = (pb.CACHE_KIND_SPARSE_KV, pb.CACHE_KIND_SPARSE_QUANTIZED_KV)
    if any(layer.kind in full_attention and layer.n_kept != layer.offset for _, layer in leaf_layers(manifest.layers)):
        raise KvmeshError(
            f"cache {cache_id} evicted tokens ({manifest.compression.method}), which mlx-lm's own caches cannot "
            "hold: use it with `kvmesh generate` or `kvmesh serve`, keep it as a file with `kvmesh cache export`, "
            "or export a cache made without eviction (--method full or quantize)"
        )
    bases = stored_bases(store.root, manifest)
    cache = [_as_mlx_lm(c) for c in decode_chunks(manifest, store.chunks(cache_id), bases=bases)]
    metadata = {
        "model": model_path,
        "tokenizer_config": json.dumps({}),
        "kvmesh_cache_id": manifest.cache_id,
        "kvmesh_model_id": manifest.model.model_id,
    }
    save_prompt_cache(str(path), cache, metadata)
    return Path(path)


def _as_mlx_lm(layer):
    if isinstance(layer, CacheList):
        return CacheList(*(_as_mlx_lm(part) for part in layer.caches))
    if not isinstance(layer, (SparseKVCache, SparseQuantizedKVCache)):
        return layer  # the other kinds are mlx-lm's own classes already
    dense = QuantizedKVCache(layer.group_size, layer.bits) if isinstance(layer, SparseQuantizedKVCache) else KVCache()
    dense.keys, dense.values = layer.keys_and_values()
    dense.offset = layer.offset
    return dense
