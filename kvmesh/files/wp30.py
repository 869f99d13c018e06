"""`wp30-cache-2` files (the single-file format kvmesh grew from) in and out of the store.

The layout: one safetensors file, maybe gzip- or zstd-compressed
as a whole, with a JSON manifest and per-layer list in its metadata and arrays `L{i}.k`/`L{i}.v`
(or `L{i}.k0..k2`/`L{i}.v0..v2` when quantized). The file holds only a hash of its prompt's
tokens, so importing (and exporting) needs the prompt.

Every check the format's own loader made is made here before anything is stored: the schema,
the geometry, the prefix's token hash, and each layer's shapes, dtypes and counts against the
arrays really present. Its model-identity hashes were computed by that project's model inspector,
which kvmesh cannot repeat: one equal to kvmesh's hash of the same thing is verified, any other is
reported as not checked (`Wp30Import.unchecked`), never silently passed.

Dtypes are spelled as the format's writer spelled them, `str(array.dtype)`, which MLX renders with
its module prefix: `"mlx.core.float32"`, and `"mlx.core.uint32"` for packed quantized data (a
quantized layer's `dtypes` lists its (packed, scales, biases) triple). Imports read those and bare
names (`"float32"`, which kvmesh's exports once wrote, with all six arrays' dtypes); exports write
the format's own spelling, which its loader compares with `str(array.dtype)`.
"""

import gzip
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import zstandard

from kvmesh.caches.defaults import QUANT_BITS, QUANT_GROUP_SIZES
from kvmesh.caches.presses import Press, make_press, press_shown_by
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.arrays import mlx_dtype_name
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.errors import KvmeshError, PressConfigError
from kvmesh.model.fingerprint import ModelFingerprint, dtype_name
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import stored_bases
from kvmesh.v1 import cache_pb2 as pb

SCHEMA = "wp30-cache-2"
Sparse = SparseKVCache | SparseQuantizedKVCache
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
COMPRESSIONS = ("none", "gzip", "zstd")
QUANTIZED_CLASSES = ("QuantizedKVCache", "SparseQuantizedKVCache")
DENSE_CLASSES = ("KVCache", "SparseKVCache")
# `str(mx.float32)` is "mlx.core.float32": the format's dtype strings carry MLX's module prefix.
DTYPE_PREFIX = "mlx.core."
# What the format says of positions and masks, written on export.
POSITIONS = "keys are stored post-RoPE at their original positions; logical_offset is the count of tokens processed"
MASK_SEMANTICS = "retained positions are fully visible to new tokens; new tokens are causal among themselves"
# Model-identity fields of the manifest, and the kvmesh fingerprint field each is compared with.
IDENTITY = {
    "config_hash": "config_sha256",
    "weight_files_sha256": "weights_sha256",
    "tokenizer_hash": "tokenizer_sha256",
    "chat_template_hash": "chat_template_sha256",
}


class Wp30Error(KvmeshError):
    """A wp30 file that cannot be imported, with the field at fault."""

    def __init__(self, path: Path | str, message: str):
        super().__init__(f"{path}: {message}")


@dataclass
class Wp30Import:
    """What importing a wp30 file stored, and which of its identity checks kvmesh could not make."""

    manifest: pb.CacheManifest
    verified: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)


def token_hash(tokens: Sequence[int]) -> str:
    """The format's prefix hash: sha256 of the token ids as decimal text joined by commas."""
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()


def read_wp30(path: Path | str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata of a wp30 file, whole-file gzip or zstd undone first."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if not magic.startswith(GZIP_MAGIC) and magic != ZSTD_MAGIC:
                return _load(path, path)
            f.seek(0)
            with tempfile.NamedTemporaryFile(suffix=".safetensors") as plain:
                if magic.startswith(GZIP_MAGIC):
                    with gzip.open(f) as unzipped:
                        shutil.copyfileobj(unzipped, plain)
                else:
                    zstandard.ZstdDecompressor().copy_stream(f, plain)
                plain.flush()
                return _load(Path(plain.name), path)
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise Wp30Error(path, f"cannot read: {e}") from e


def _load(path: Path, shown: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    try:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    except Exception as e:  # mlx raises plain RuntimeError/ValueError for files it cannot parse
        raise Wp30Error(shown, f"not a safetensors file: {e}") from e
    if not isinstance(arrays, dict) or not isinstance(metadata, dict):
        raise Wp30Error(shown, "not a safetensors file")
    return arrays, metadata


def import_wp30(
    store: CacheStore,
    path: Path | str,
    model: ModelFingerprint,
    tokens: Sequence[int],
    options: EncodeOptions | None = None,
) -> Wp30Import:
    """Check a wp30 file made by `model` from the prompt `tokens`, and store it."""
    arrays, metadata = read_wp30(path)

    def refuse(message: str) -> Wp30Error:
        return Wp30Error(path, message)

    try:
        manifest = json.loads(metadata["wp30_manifest"])
        layers_meta = json.loads(metadata["wp30_layers"])
    except KeyError as e:
        raise refuse(f"not a wp30 cache: no {e.args[0]} metadata") from None
    except ValueError as e:
        raise refuse(f"wp30 metadata is not JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(layers_meta, list):
        raise refuse("wp30_manifest must be a JSON object and wp30_layers a list")
    if manifest.get("schema_version") != SCHEMA:
        raise refuse(f"schema_version {manifest.get('schema_version')!r}: kvmesh reads {SCHEMA!r} only")

    result = Wp30Import(pb.CacheManifest())
    for theirs, ours in IDENTITY.items():
        value, expected = manifest.get(theirs), getattr(model, ours)
        (result.verified if value and value == expected else result.unchecked).append(theirs)
    revision = manifest.get("model_revision") or ""
    if revision and model.revision and revision != model.revision:
        raise refuse(f"model_revision {revision}, this model is revision {model.revision}")
    (result.verified if revision and revision == model.revision else result.unchecked).append("model_revision")

    geometry = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
    for key, expected in geometry.items():
        if manifest.get(key) != expected:
            raise refuse(f"{key} {manifest.get(key)!r}, this model has {expected}")
    count = manifest.get("prefix_token_count")
    if count != len(tokens):
        raise refuse(f"prefix_token_count {count!r}, the prompt given has {len(tokens)} tokens")
    if manifest.get("prefix_token_hash") != token_hash(tokens):
        raise refuse(
            "prefix_token_hash does not match the prompt given: import with the prompt the cache was made from"
        )
    manifest_layers = manifest.get("layers")
    if not isinstance(manifest_layers, list) or not len(manifest_layers) == len(layers_meta) == model.num_layers:
        raise refuse(f"manifest layers and wp30_layers must each list the model's {model.num_layers} layers")

    cache = [
        _layer(refuse, i, meta, described, arrays, model, len(tokens))
        for i, (meta, described) in enumerate(zip(layers_meta, manifest_layers, strict=True))
    ]
    if unused := set(arrays) - {name for i in range(len(cache)) for name in _array_names(i, cache[i])}:
        raise refuse(f"arrays no layer describes: {', '.join(sorted(unused))}")
    press = _press(manifest, cache)
    result.manifest = store.add(*encode_cache(cache, model, tokens, press, options=options or EncodeOptions()))
    return result


def _bare_dtype(spelled: Any) -> Any:
    """A manifest's dtype string, `"mlx.core.float32"` (the format's own spelling) or `"float32"`, as
    the bare name kvmesh compares; anything else is returned as it is, to be refused."""
    if isinstance(spelled, str) and spelled.startswith(DTYPE_PREFIX):
        return spelled[len(DTYPE_PREFIX) :]
    return spelled


def _spelled_dtype(dtype: mx.Dtype) -> str:
    """A dtype as the format writes it, `str(array.dtype)`: `mlx.core.float32`."""
    return DTYPE_PREFIX + mlx_dtype_name(dtype)


def _array_names(i: int, layer: SparseKVCache | SparseQuantizedKVCache) -> list[str]:
    if isinstance(layer, SparseQuantizedKVCache):
        return [f"L{i}.{role}{part}" for role in "kv" for part in range(3)]
    return [f"L{i}.k", f"L{i}.v"]


def _layer(refuse, i: int, meta: Any, described: Any, arrays: dict, model: ModelFingerprint, num_tokens: int):
    """Layer i rebuilt from its wp30_layers entry, checked against the manifest's and the arrays."""
    if not isinstance(meta, dict) or not isinstance(described, dict):
        raise refuse(f"layer {i}: entries must be JSON objects")
    cls = meta.get("cls")
    if cls not in DENSE_CLASSES + QUANTIZED_CLASSES or described.get("cls") != cls:
        raise refuse(f"layer {i}: class {cls!r} (manifest {described.get('cls')!r}); expected one of the same pair")
    offset, n_kept = meta.get("offset"), meta.get("n_kept")
    if offset != num_tokens or described.get("logical_offset") != offset:
        raise refuse(
            f"layer {i}: offset {offset!r} / logical_offset {described.get('logical_offset')!r}, "
            f"the prefix has {num_tokens} tokens"
        )
    if not isinstance(n_kept, int) or not 0 < n_kept <= offset or described.get("stored_positions") != n_kept:
        raise refuse(f"layer {i}: n_kept {n_kept!r} / stored_positions {described.get('stored_positions')!r}")
    quantized = cls in QUANTIZED_CLASSES
    names = _array_names(i, SparseQuantizedKVCache() if quantized else SparseKVCache())
    if missing := [name for name in names if name not in arrays]:
        raise refuse(f"layer {i}: missing arrays {', '.join(missing)}")
    got = [arrays[name] for name in names]
    shapes = [list(a.shape) for a in got]
    dtypes = [mlx_dtype_name(a.dtype) for a in got]
    if quantized:
        bits, group_size = meta.get("bits"), meta.get("group_size")
        if (described.get("bits"), described.get("group_size")) != (bits, group_size):
            raise refuse(f"layer {i}: bits/group_size differ between wp30_layers and the manifest")
        if bits not in QUANT_BITS or group_size not in QUANT_GROUP_SIZES or model.head_dim % group_size:
            raise refuse(f"layer {i}: quantization bits={bits!r} group_size={group_size!r}")
        widths = [model.head_dim * bits // 32, model.head_dim // group_size, model.head_dim // group_size] * 2
        expected_dtypes = ["uint32", model.dtype, model.dtype] * 2
        if described.get("k_shapes") != shapes[:3] or described.get("v_shapes") != shapes[3:]:
            raise refuse(f"layer {i}: k_shapes/v_shapes do not match the arrays {shapes}")
        # The format lists the dtypes of one (packed, scales, biases) triple; kvmesh once wrote all six.
        theirs = described.get("dtypes")
        if not isinstance(theirs, list) or [_bare_dtype(d) for d in theirs] not in (dtypes, dtypes[:3]):
            raise refuse(f"layer {i}: dtypes {theirs!r} do not match the arrays {dtypes[:3]}")
    else:
        widths = [model.head_dim] * 2
        expected_dtypes = [model.dtype] * 2
        if [described.get("k_shape"), described.get("v_shape")] != shapes:
            raise refuse(f"layer {i}: k_shape/v_shape do not match the arrays {shapes}")
        if _bare_dtype(described.get("dtype")) != dtypes[0]:
            raise refuse(f"layer {i}: dtype {described.get('dtype')!r}, the arrays are {dtypes[0]}")
    expected_shapes = [[1, model.num_kv_heads, n_kept, w] for w in widths]
    if shapes != expected_shapes or dtypes != expected_dtypes:
        raise refuse(f"layer {i}: arrays {shapes} {dtypes}, expected {expected_shapes} {expected_dtypes}")
    if quantized:
        keys, values = tuple(got[:3]), tuple(got[3:])
        return SparseQuantizedKVCache.from_arrays(keys, values, offset, cast(int, group_size), cast(int, bits))
    return SparseKVCache.from_arrays(got[0], got[1], offset)


def _press(manifest: dict, cache: list[Sparse]) -> Press:
    """The press the file says made it, or, for a method kvmesh does not know, what its layers show."""
    config = manifest.get("compression_config") or {}
    try:
        return make_press(str(manifest.get("method_id") or "full"), config if isinstance(config, dict) else {})
    except PressConfigError as e:
        if any(c.n_kept != c.offset for c in cache):
            raise KvmeshError(f"cannot record how this cache was made: {e}") from None
        return press_shown_by(cache)


def export_wp30(
    store: CacheStore,
    cache_id: str,
    path: Path | str,
    tokens: Sequence[int],
    model: ModelFingerprint,
    compression: str = "none",
) -> Path:
    """Write a stored cache of the prompt `tokens` as a wp30 file (compressed whole, if asked)."""
    from kvmesh.codec.prefix import prefix_sha256

    if compression not in COMPRESSIONS:
        raise KvmeshError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
    manifest = store.manifest(cache_id)
    n = manifest.prefix.num_tokens
    if len(tokens) != n or prefix_sha256(tokens, manifest.prefix.block_size) != manifest.prefix.sha256:
        raise KvmeshError(f"cache {cache_id} is not the cache of that prompt ({n} tokens)")
    full_attention = {pb.CACHE_KIND_SPARSE_KV, pb.CACHE_KIND_SPARSE_QUANTIZED_KV}
    if kinds := {layer.kind for layer in manifest.layers} - full_attention:
        raise KvmeshError(
            f"cache {cache_id} has {', '.join(sorted(pb.CacheKind.Name(k) for k in kinds))} layers, which the wp30 "
            "format cannot hold (it has full-attention layers only): use `kvmesh cache export` or `export-mlx`"
        )
    bases = stored_bases(store.root, manifest)
    cache = [
        layer for layer in decode_chunks(manifest, store.chunks(cache_id), bases=bases) if isinstance(layer, Sparse)
    ]
    arrays: dict[str, mx.array] = {}
    layers, described = [], []
    for i, layer in enumerate(cache):
        keys, values = layer.keys_and_values()
        entry: dict[str, Any] = {"cls": type(layer).__name__, "offset": layer.offset, "n_kept": layer.n_kept}
        about: dict[str, Any] = {"layer": i, "cls": entry["cls"]}
        if isinstance(layer, SparseQuantizedKVCache):
            for role, parts in (("k", keys), ("v", values)):
                arrays.update({f"L{i}.{role}{j}": part for j, part in enumerate(parts)})
            entry.update(group_size=layer.group_size, bits=layer.bits)
            about.update(
                k_shapes=[list(a.shape) for a in keys],
                v_shapes=[list(a.shape) for a in values],
                dtypes=[_spelled_dtype(a.dtype) for a in keys],
                bits=layer.bits,
                group_size=layer.group_size,
            )
        else:
            arrays[f"L{i}.k"], arrays[f"L{i}.v"] = keys, values
            about.update(k_shape=list(keys.shape), v_shape=list(values.shape), dtype=_spelled_dtype(keys.dtype))
        about.update(stored_positions=layer.n_kept, logical_offset=layer.offset)
        layers.append(entry)
        described.append(about)
    fp = manifest.model
    wp30 = {
        "schema_version": SCHEMA,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_repo_id": fp.repo_id,
        "model_revision": fp.revision,
        "config_hash": fp.config_sha256.hex(),
        "weight_files_sha256": fp.weights_sha256.hex(),
        "tokenizer_hash": fp.tokenizer_sha256.hex(),
        "chat_template_hash": fp.chat_template_sha256.hex(),
        "prefix_token_hash": token_hash(tokens),
        "prefix_token_count": n,
        "num_layers": manifest.num_layers,
        "num_kv_heads": manifest.num_kv_heads,
        "head_dim": manifest.head_dim,
        "rope_theta": model.rope_theta,
        "rope_scaling": json.loads(model.rope_scaling_json) if model.rope_scaling_json else None,
        "sliding_window": model.sliding_window or None,
        "positions": POSITIONS,
        "causal_mask_semantics": MASK_SEMANTICS,
        "mlx_version": fp.mlx_version,
        "mlx_lm_version": fp.mlx_lm_version,
        "document_id": cache_id,
        "method_id": manifest.compression.method,
        "compression_config": _config_dict(manifest.compression.config),
        "layers": described,
        # Not the format's: kvmesh's own record of the model's dtype, spelled as the format spells dtypes.
        "dtype": DTYPE_PREFIX + dtype_name(manifest.dtype),
    }
    metadata = {"wp30_manifest": json.dumps(wp30, separators=(",", ":")), "wp30_layers": json.dumps(layers)}
    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        plain = Path(tmp) / "cache.safetensors"
        mx.save_safetensors(str(plain), arrays, metadata)
        written = Path(tmp) / "out"
        if compression == "gzip":
            with open(plain, "rb") as src, gzip.open(written, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
        elif compression == "zstd":
            with open(plain, "rb") as src, open(written, "wb") as dst:
                zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
        else:
            written = plain
        written.replace(path)
    return path


def _config_dict(config: pb.PressConfig) -> dict:
    """The press's settings as the numbers `make_press` takes back."""
    return {f.name: value for f, value in config.ListFields()}
