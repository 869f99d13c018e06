"""mlx-lm prompt-cache files in and out of the store.

Caches made by `mlx_lm.cache_prompt` enter the mesh with `import_prompt_cache`; a cache from the
mesh becomes a file for `mlx_lm.generate --prompt-cache-file` with `export_prompt_cache`.
mlx-lm's files do not record the prompt's tokens, so importing one needs them.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from kvmesh.caches.presses import Press, QuantizePress
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache, sparse_from_dense
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.errors import KvmeshError
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb


def cache_prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """The tokens `mlx_lm.cache_prompt` feeds for `prompt` (its own rule, repeated here)."""
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=False, continue_final_message=True
        )
    return tokenizer.encode(prompt)


def import_prompt_cache(
    store: CacheStore,
    path: Path | str,
    model: ModelFingerprint,
    tokens: Sequence[int],
    options: EncodeOptions | None = None,
) -> pb.CacheManifest:
    """Store an mlx-lm prompt-cache file made by `model` from `tokens`."""
    try:
        cache = load_prompt_cache(str(path))
    except Exception as e:  # mlx raises plain RuntimeError/ValueError for unreadable files
        raise KvmeshError(f"{path}: not an mlx-lm prompt cache: {e}") from e
    if len(cache) != model.num_layers:
        raise KvmeshError(f"{path}: {len(cache)} layers, the model has {model.num_layers}")
    sparse = [c if isinstance(c, (SparseKVCache, SparseQuantizedKVCache)) else sparse_from_dense(c) for c in cache]
    if sparse[0].offset != len(tokens):
        raise KvmeshError(f"{path}: the cache holds {sparse[0].offset} tokens, the prompt has {len(tokens)}")
    first = sparse[0]
    press = Press()
    if isinstance(first, SparseQuantizedKVCache):
        press = QuantizePress(kv_bits=first.bits, kv_group_size=first.group_size)
    return store.add(*encode_cache(sparse, model, tokens, press, options or EncodeOptions()))


def export_prompt_cache(store: CacheStore, cache_id: str, path: Path | str, model_path: str) -> Path:
    """Write an entry as an mlx-lm prompt-cache file for the model at `model_path` (or hub id).

    A cache that evicted nothing becomes mlx-lm's own KVCache/QuantizedKVCache, usable by
    `mlx_lm.generate --prompt-cache-file` as is. An evicted cache keeps kvmesh's sparse classes:
    a process reads it after `import kvmesh.caches.sparse`.
    """
    manifest = store.manifest(cache_id)
    cache = decode_chunks(manifest, store.chunks(cache_id))
    if all(c.n_kept == c.offset for c in cache):
        cache = [_as_mlx_lm(c) for c in cache]
    metadata = {
        "model": model_path,
        "tokenizer_config": json.dumps({}),
        "kvmesh_cache_id": manifest.cache_id,
        "kvmesh_model_id": manifest.model.model_id,
    }
    save_prompt_cache(str(path), cache, metadata)
    return Path(path)


def _as_mlx_lm(layer):
    quantized = isinstance(layer, SparseQuantizedKVCache)
    dense = QuantizedKVCache(layer.group_size, layer.bits) if quantized else KVCache()
    dense.keys, dense.values = layer.keys_and_values()
    dense.offset = layer.offset
    return dense
