"""wp30-cache-2 files: written here by an independent writer that follows the published layout
(shared/docs/wp30-format.md), never by kvmesh's own exporter, then imported; and kvmesh's
exports read back."""

import copy
import gzip
import hashlib
import json

import mlx.core as mx
import pytest
import zstandard

from helpers import cli, put
from kvmesh.caches.prefill import generate_from_cache, prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseQuantizedKVCache
from kvmesh.codec.arrays import layer_tensors
from kvmesh.codec.decode import decode_chunks
from kvmesh.errors import KvmeshError
from kvmesh.files.wp30 import Wp30Error, export_wp30, import_wp30
from kvmesh.store import CacheStore

KINDS = {
    "dense": ("full", {}),
    "quantized": ("quantize", {"kv_bits": 8, "kv_group_size": 32}),
    "sparse": ("snapkv", {"ratio": 0.5, "window": 16}),
}


def write_wp30(path, cache, tokens, fp, method, config, compression="none", edit=None):
    """A wp30 file as that project wrote it: its own names, its own hashes, its own layout."""
    arrays, layers, described = {}, [], []
    for i, layer in enumerate(cache):
        keys, values = layer.keys_and_values()
        entry = {"cls": type(layer).__name__, "offset": layer.offset, "n_kept": layer.n_kept}
        about = {"layer": i, "cls": entry["cls"], "stored_positions": layer.n_kept, "logical_offset": layer.offset}
        if isinstance(layer, SparseQuantizedKVCache):
            for role, parts in (("k", keys), ("v", values)):
                for j, part in enumerate(parts):
                    arrays[f"L{i}.{role}{j}"] = part
            entry.update(group_size=layer.group_size, bits=layer.bits)
            about.update(
                k_shapes=[list(a.shape) for a in keys],
                v_shapes=[list(a.shape) for a in values],
                dtypes=[str(a.dtype).split(".")[-1] for a in (*keys, *values)],
                bits=layer.bits,
                group_size=layer.group_size,
            )
        else:
            arrays[f"L{i}.k"], arrays[f"L{i}.v"] = keys, values
            about.update(k_shape=list(keys.shape), v_shape=list(values.shape), dtype="float32")
        layers.append(entry)
        described.append(about)
    manifest = {
        "schema_version": "wp30-cache-2",
        "created_utc": "2025-06-01T12:00:00Z",
        "model_repo_id": "local/tiny",
        "model_revision": "",
        "config_hash": hashlib.sha256(b"their own inspector").hexdigest(),
        "weight_files_sha256": hashlib.sha256(b"their weights").hexdigest(),
        "tokenizer_hash": fp.tokenizer_sha256,
        "chat_template_hash": hashlib.sha256(b"template").hexdigest(),
        "prefix_token_hash": hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest(),
        "prefix_token_count": len(tokens),
        "num_layers": fp.num_layers,
        "num_kv_heads": fp.num_kv_heads,
        "head_dim": fp.head_dim,
        "rope_theta": fp.rope_theta,
        "rope_scaling": None,
        "sliding_window": None,
        "positions": "post-RoPE",
        "causal_mask_semantics": "retained visible",
        "mlx_version": "0.0",
        "mlx_lm_version": "0.0",
        "document_id": "doc-1",
        "method_id": method,
        "compression_config": config,
        "layers": described,
        "writer_extra": {"anything": True},
    }
    if edit:
        edit(manifest, layers, arrays)
    metadata = {"wp30_manifest": json.dumps(manifest), "wp30_layers": json.dumps(layers)}
    plain = path.with_suffix(".plain.safetensors")
    mx.save_safetensors(str(plain), arrays, metadata)
    data = plain.read_bytes()
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def originals(tiny, prompt_ids):
    tokens = prompt_ids[:200]
    return tokens, {kind: prefill(tiny[0], tokens, make_press(*press)).cache for kind, press in KINDS.items()}


def continuation(model, cache, suffix):
    """Logprobs of 5 greedy steps after `suffix`; the cache is changed in place."""
    return [lp for _, lp in generate_from_cache(model, cache, suffix, 5)]


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_independently_written_file_imports_and_generates_identically(
    tiny, tiny_fp, originals, prompt_ids, tmp_path, kind, compression
):
    tokens, caches = originals
    method, config = KINDS[kind]
    path = write_wp30(tmp_path / "c.wp30", caches[kind], tokens, tiny_fp, method, config, compression)
    store = CacheStore(tmp_path / "store")
    imported = import_wp30(store, path, tiny_fp, tokens)

    assert imported.manifest.compression.method == method
    assert imported.verified == ["tokenizer_hash"]  # the one hash computed as kvmesh does
    assert imported.unchecked == ["config_hash", "weight_files_sha256", "chat_template_hash", "model_revision"]
    got = decode_chunks(store.manifest(imported.manifest.cache_id), store.chunks(imported.manifest.cache_id))
    for a, b in zip(got, caches[kind]):
        assert all(mx.array_equal(x, y).item() for x, y in zip(layer_tensors(a), layer_tensors(b)))
    suffix = prompt_ids[200:210]
    ours, theirs = continuation(tiny[0], got, suffix), continuation(tiny[0], copy.deepcopy(caches[kind]), suffix)
    assert all(mx.array_equal(x, y).item() for x, y in zip(ours, theirs))


def _set(key, value):
    def edit(manifest, layers, arrays):
        manifest[key] = value

    return edit


def _layer(key, value, where="layers"):
    def edit(manifest, layers, arrays):
        (layers if where == "layers" else manifest["layers"])[1][key] = value

    return edit


def _drop_array(manifest, layers, arrays):
    del arrays["L2.v"]


def _extra_array(manifest, layers, arrays):
    arrays["L9.k"] = mx.zeros((1,))


def _fewer_kept(manifest, layers, arrays):
    arrays["L1.k"] = arrays["L1.k"][..., :-1, :]


WRONG = {
    "schema": (_set("schema_version", "wp30-cache-1"), "schema_version 'wp30-cache-1'"),
    "layers": (_set("num_layers", 5), "num_layers 5, this model has 4"),
    "kv heads": (_set("num_kv_heads", 8), "num_kv_heads 8"),
    "head dim": (_set("head_dim", 128), "head_dim 128"),
    "token count": (_set("prefix_token_count", 199), "prefix_token_count 199"),
    "token hash": (_set("prefix_token_hash", "0" * 64), "prefix_token_hash does not match"),
    "class": (_layer("cls", "RotatingKVCache"), "layer 1: class 'RotatingKVCache'"),
    "class pair": (_layer("cls", "KVCache", "manifest"), "layer 1: class 'SparseKVCache' .manifest 'KVCache'"),
    "offset": (_layer("offset", 150), "layer 1: offset 150"),
    "n_kept": (_layer("n_kept", 250), "layer 1: n_kept 250"),
    "stored": (_layer("stored_positions", 3, "manifest"), "layer 1: n_kept 200 / stored_positions 3"),
    "shape": (_layer("k_shape", [1, 2, 7, 64], "manifest"), "layer 1: k_shape/v_shape do not match"),
    "dtype": (_layer("dtype", "float16", "manifest"), "layer 1: dtype 'float16'"),
    "missing array": (_drop_array, "layer 2: missing arrays L2.v"),
    "extra array": (_extra_array, "arrays no layer describes: L9.k"),
    "array rows": (_fewer_kept, "layer 1: k_shape/v_shape do not match"),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_each_wrong_field_is_refused_with_its_reason(tiny_fp, originals, tmp_path, wrong):
    tokens, caches = originals
    edit, message = WRONG[wrong]
    path = write_wp30(tmp_path / "c.wp30", caches["dense"], tokens, tiny_fp, "full", {}, edit=edit)
    store = CacheStore(tmp_path / "store")
    with pytest.raises(Wp30Error, match=message):
        import_wp30(store, path, tiny_fp, tokens)
    assert store.entries() == []


def test_quantization_fields_are_checked(tiny_fp, originals, tmp_path):
    tokens, caches = originals
    path = write_wp30(tmp_path / "c.wp30", caches["quantized"], tokens, tiny_fp, "quantize", {}, edit=_layer("bits", 4))
    with pytest.raises(Wp30Error, match="layer 1: bits/group_size differ"):
        import_wp30(CacheStore(tmp_path / "store"), path, tiny_fp, tokens)


def test_a_file_that_is_not_wp30_is_refused(tiny_fp, tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(gzip.compress(b"hello"))
    with pytest.raises(Wp30Error, match="not a safetensors file"):
        import_wp30(CacheStore(tmp_path / "store"), junk, tiny_fp, [1, 2])
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"a": mx.zeros((2,))}, {"x": "y"})
    with pytest.raises(Wp30Error, match="not a wp30 cache: no wp30_manifest"):
        import_wp30(CacheStore(tmp_path / "store"), plain, tiny_fp, [1, 2])


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_an_exported_file_reads_back(tiny, tiny_fp, originals, tmp_path, compression):
    tokens, caches = originals
    press = make_press(*KINDS["sparse"])
    store = CacheStore(tmp_path / "store")
    manifest = put(store, caches["sparse"], tiny_fp, tokens, press)
    path = export_wp30(store, manifest.cache_id, tmp_path / "out.wp30", tokens, tiny_fp, compression)
    magic = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}.get(compression, b"")
    assert path.read_bytes().startswith(magic)

    other = CacheStore(tmp_path / "other")
    imported = import_wp30(other, path, tiny_fp, tokens)
    assert imported.manifest.cache_id == manifest.cache_id  # same content, same id
    assert imported.unchecked == ["model_revision"]  # kvmesh's own hashes are verified


def test_export_refuses_what_the_format_cannot_hold(tiny_fp, originals, tmp_path):
    tokens, caches = originals
    store = CacheStore(tmp_path / "store")
    manifest = put(store, caches["dense"], tiny_fp, tokens)
    with pytest.raises(KvmeshError, match="is not the cache of that prompt"):
        export_wp30(store, manifest.cache_id, tmp_path / "out.wp30", tokens[:-1], tiny_fp)


@pytest.mark.slow
def test_the_cli_imports_and_exports(tiny, tiny_dir, tiny_fp, tmp_path):
    prompt = "The kettle on the stove began to sing just as the rain started."
    tokens = tiny[1].encode(prompt)
    store = tmp_path / "store"
    made = put(CacheStore(store), prefill(tiny[0], tokens).cache, tiny_fp, tokens)
    out = tmp_path / "out.wp30"
    exported = cli(
        "cache",
        "--store",
        store,
        "export-wp30",
        made.cache_id,
        out,
        tiny_dir,
        "--prompt",
        prompt,
        "--compression",
        "zstd",
    )
    assert "wp30-cache-2, compression zstd" in exported.stdout
    imported = cli("cache", "--store", tmp_path / "other", "import-wp30", out, tiny_dir, "--prompt", prompt)
    assert f"imported {made.cache_id} ({len(tokens)} tokens, full)" in imported.stdout
    other = tmp_path / "x"
    wrong = cli("cache", "--store", other, "import-wp30", out, tiny_dir, "--prompt", prompt + " more", check=False)
    assert wrong.returncode != 0 and "prefix_token_count" in wrong.stderr and "Traceback" not in wrong.stderr
