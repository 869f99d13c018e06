"""wp30-cache-2 files as the original serializer wrote them, imported and generated from; and kvmesh's
exports read by a reader that checks them as the original loader did.

Both sides are written out here from the format's facts (kvmesh/files/wp30.py states its layout), never from
kvmesh's exporter or importer: `original_write` follows the original serializer's code paths (dtypes
as `str(array.dtype)`, which MLX spells `"mlx.core.float32"`; class names from the caches it held;
whole-file gzip/zstd; extra manifest keys), `original_read` the original loader's checks."""

import copy
import gzip
import hashlib
import json
import shutil

import mlx.core as mx
import pytest
import zstandard
from mlx_lm.models.cache import make_prompt_cache

from kvmesh.caches.prefill import generate_from_cache, prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.decode import decode_chunks
from kvmesh.errors import KvmeshError
from kvmesh.files.wp30 import Wp30Error, export_wp30, import_wp30
from kvmesh.store import CacheStore
from support.processes import cli
from support.stores import put

# The caches the original serializer was given, each with the method it recorded and the class it held.
KINDS = {
    "dense": ("full", {}),
    "8-bit": ("quantize", {"kv_bits": 8, "kv_group_size": 32}),
    "sparse": ("snapkv", {"ratio": 0.5, "window": 16}),
    "sparse 8-bit": ("snapkv", {"ratio": 0.5, "window": 16, "kv_bits": 8, "kv_group_size": 32}),
}
CLASSES = {
    "dense": "KVCache",  # mlx-lm's, from a plain prefill
    "8-bit": "QuantizedKVCache",  # mlx-lm's, that prefill quantized
    "sparse": "SparseKVCache",  # kvmesh's, after eviction
    "sparse 8-bit": "SparseQuantizedKVCache",
}
QUANTIZED = ("QuantizedKVCache", "SparseQuantizedKVCache")
GZIP, ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


def prefix_hash(tokens) -> str:
    return hashlib.sha256(",".join(str(t) for t in tokens).encode()).hexdigest()


def original_write(path, cache, tokens, fp, method, config, compression="none", edit=None):
    """A wp30-cache-2 file as the original serializer wrote it: for each layer its class name, its
    arrays as the cache holds them (`keys_and_values()`; quantized: the (packed, scales, biases)
    triples) and their dtypes as `str(array.dtype)`; its own model hashes; extra top-level keys;
    `mx.save_safetensors` with string metadata; then the whole file streamed through gzip or zstd
    (so the zstd frame does not carry its size). `edit(manifest, layers, arrays)` may spoil it first."""
    arrays, layers, described = {}, [], []
    for i, layer in enumerate(cache):
        keys, values = layer.keys_and_values()
        n_kept = getattr(layer, "n_kept", layer.offset)  # mlx-lm's caches keep every position
        entry = {"cls": type(layer).__name__, "offset": layer.offset, "n_kept": n_kept}
        about = {"layer": i, "cls": type(layer).__name__}
        if isinstance(layer.keys, (tuple, list)):
            for role, parts in (("k", keys), ("v", values)):
                for j, part in enumerate(parts):
                    arrays[f"L{i}.{role}{j}"] = part
            entry.update(group_size=layer.group_size, bits=layer.bits)
            about.update(
                k_shapes=[list(a.shape) for a in keys],
                v_shapes=[list(a.shape) for a in values],
                dtypes=[str(a.dtype) for a in keys],
                bits=layer.bits,
                group_size=layer.group_size,
            )
        else:
            arrays[f"L{i}.k"], arrays[f"L{i}.v"] = keys, values
            about.update(k_shape=list(keys.shape), v_shape=list(values.shape), dtype=str(keys.dtype))
        about.update(stored_positions=n_kept, logical_offset=layer.offset)
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
        "prefix_token_hash": prefix_hash(tokens),
        "prefix_token_count": len(tokens),
        "num_layers": fp.num_layers,
        "num_kv_heads": fp.num_kv_heads,
        "head_dim": fp.head_dim,
        "rope_theta": fp.rope_theta,
        "rope_scaling": None,
        "sliding_window": None,
        "positions": "keys are stored post-RoPE at their original positions",
        "causal_mask_semantics": "retained positions are fully visible to new tokens",
        "mlx_version": "0.25.1",
        "mlx_lm_version": "0.24.0",
        "document_id": "doc-1",
        "method_id": method,
        "compression_config": config,
        "layers": described,
        "writer_extra": {"anything": True},
        "press_seconds": 0.25,
    }
    if edit:
        edit(manifest, layers, arrays)
    metadata = {"wp30_manifest": json.dumps(manifest, separators=(",", ":")), "wp30_layers": json.dumps(layers)}
    plain = path.with_suffix(".plain.safetensors")
    mx.save_safetensors(str(plain), arrays, metadata)
    if compression == "none":
        return plain.replace(path)
    with open(plain, "rb") as src, open(path, "wb") as dst:
        if compression == "gzip":
            with gzip.GzipFile(plain.name, "wb", fileobj=dst) as zipped:
                shutil.copyfileobj(src, zipped)
        else:
            zstandard.ZstdCompressor().copy_stream(src, dst)
    return path


def original_read(path, fp, tokens):
    """A wp30 file checked and rebuilt as the original loader did, before any model ran: its schema,
    its model hashes and revision against the receiver's (here kvmesh's fingerprint, which is what an
    export of kvmesh claims), the geometry, the prefix hash, and each layer's shapes and dtypes
    against `str(array.dtype)` of its arrays. Quantized classes come back sparse-quantized, the rest
    sparse, with offset and n_kept from wp30_layers. Returns (manifest, cache)."""
    data = path.read_bytes()
    if data.startswith(GZIP):
        data = gzip.decompress(data)
    elif data.startswith(ZSTD):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    plain = path.with_suffix(".read.safetensors")
    plain.write_bytes(data)
    arrays, metadata = mx.load(str(plain), return_metadata=True)
    manifest, layers = json.loads(metadata["wp30_manifest"]), json.loads(metadata["wp30_layers"])
    assert manifest["schema_version"] == "wp30-cache-2"
    for theirs, ours in {
        "config_hash": fp.config_sha256,
        "tokenizer_hash": fp.tokenizer_sha256,
        "chat_template_hash": fp.chat_template_sha256,
        "model_revision": fp.revision,
    }.items():
        assert manifest[theirs] == ours, theirs
    assert [manifest[k] for k in ("num_layers", "num_kv_heads", "head_dim")] == [
        fp.num_layers,
        fp.num_kv_heads,
        fp.head_dim,
    ]
    assert manifest["prefix_token_hash"] == prefix_hash(tokens)
    assert manifest["prefix_token_count"] == len(tokens)
    cache: list = []
    for i, (entry, about) in enumerate(zip(layers, manifest["layers"], strict=True)):
        assert about["layer"] == i and about["cls"] == entry["cls"]
        if entry["cls"] in QUANTIZED:
            keys, values = ([arrays[f"L{i}.{role}{j}"] for j in range(3)] for role in "kv")
            assert about["k_shapes"] == [list(a.shape) for a in keys]
            assert about["v_shapes"] == [list(a.shape) for a in values]
            assert about["dtypes"] == [str(a.dtype) for a in keys]
            assert (about["bits"], about["group_size"]) == (entry["bits"], entry["group_size"])
            layer = SparseQuantizedKVCache.from_arrays(
                tuple(keys), tuple(values), entry["offset"], entry["group_size"], entry["bits"]
            )
        else:
            keys, values = arrays[f"L{i}.k"], arrays[f"L{i}.v"]
            assert [about["k_shape"], about["v_shape"]] == [list(keys.shape), list(values.shape)]
            assert about["dtype"] == str(keys.dtype) == str(values.dtype)
            layer = SparseKVCache.from_arrays(keys, values, entry["offset"])
        assert layer.n_kept == entry["n_kept"] == about["stored_positions"]
        assert layer.offset == about["logical_offset"] == len(tokens)
        cache.append(layer)
    return manifest, cache


@pytest.fixture(scope="module")
def tokens(prompt_ids):
    return prompt_ids[:200]


@pytest.fixture(scope="module")
def ours(tiny, tokens):
    """kvmesh's own prefills of the prompt, one per kind (what its store holds and exports)."""
    return {kind: prefill(tiny[0], tokens, make_press(*press)).cache for kind, press in KINDS.items()}


@pytest.fixture(scope="module")
def originals(tiny, tokens, ours):
    """The caches the original serializer was given: mlx-lm's own from a plain prefill (dense, and
    quantized to 8 bits by mlx-lm), kvmesh's sparse ones after eviction."""
    model = tiny[0]
    dense = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=dense)
    mx.eval([c.state for c in dense])
    quantized = [c.to_quantized(group_size=32, bits=8) for c in dense]
    mx.eval([c.state for c in quantized])
    caches = {"dense": dense, "8-bit": quantized, "sparse": ours["sparse"], "sparse 8-bit": ours["sparse 8-bit"]}
    assert {kind: type(c[0]).__name__ for kind, c in caches.items()} == CLASSES
    return caches


def arrays_of(cache) -> list[mx.array]:
    out = []
    for layer in cache:
        for part in layer.keys_and_values():
            out.extend(part if isinstance(part, (tuple, list)) else [part])
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and mx.array_equal(x, y).item() for x, y in zip(a, b))


def continuation(model, cache, suffix):
    """(tokens, logprobs) of 5 greedy steps after `suffix`; the cache is changed in place."""
    steps = list(generate_from_cache(model, cache, suffix, max_tokens=5))
    return [t for t, _ in steps], [lp for _, lp in steps]


def assert_generates_like(model, cache, local, suffix):
    """`cache` continues `suffix` as the local prefill `local` (left as it was) does: the same tokens,
    the same log-probabilities bit for bit."""
    got, expected = continuation(model, cache, suffix), continuation(model, copy.deepcopy(local), suffix)
    assert got[0] == expected[0]
    assert same(got[1], expected[1])


def test_the_original_spells_dtypes_with_the_mlx_module(originals, tiny_fp, tokens, tmp_path):
    """The spelling the importer once refused, on this MLX: what `str(array.dtype)` gives."""
    assert (str(mx.float32), str(mx.float16), str(mx.uint32)) == (
        "mlx.core.float32",
        "mlx.core.float16",
        "mlx.core.uint32",
    )
    path = original_write(tmp_path / "c.wp30", originals["8-bit"], tokens, tiny_fp, *KINDS["8-bit"])
    _, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    layer = json.loads(metadata["wp30_manifest"])["layers"][0]
    assert layer["cls"] == "QuantizedKVCache"
    assert layer["dtypes"] == ["mlx.core.uint32", "mlx.core.float32", "mlx.core.float32"]


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_file_the_original_wrote_imports_and_generates_as_a_local_prefill(
    tiny, tiny_fp, originals, prompt_ids, tokens, tmp_path, kind, compression
):
    method, config = KINDS[kind]
    path = original_write(tmp_path / "c.wp30", originals[kind], tokens, tiny_fp, method, config, compression)
    assert path.read_bytes().startswith({"gzip": GZIP, "zstd": ZSTD}.get(compression, b""))
    store = CacheStore(tmp_path / "store")
    imported = import_wp30(store, path, tiny_fp, tokens)

    assert imported.manifest.compression.method == method
    assert imported.verified == ["tokenizer_hash"]  # the one hash computed as kvmesh does
    assert imported.unchecked == ["config_hash", "weight_files_sha256", "chat_template_hash", "model_revision"]
    got = decode_chunks(store.manifest(imported.manifest.cache_id), store.chunks(imported.manifest.cache_id))
    assert [type(c) for c in got] == [SparseQuantizedKVCache if "8-bit" in kind else SparseKVCache] * len(got)
    assert [(c.offset, c.n_kept) for c in got] == [(c.offset, getattr(c, "n_kept", c.offset)) for c in originals[kind]]
    assert same(arrays_of(got), arrays_of(originals[kind]))
    assert_generates_like(tiny[0], got, originals[kind], prompt_ids[200:210])


def _bare_dtypes(manifest, layers, arrays):
    """The spelling kvmesh's own exports once used: bare names, six of them for quantized layers."""
    for about in manifest["layers"]:
        if "dtype" in about:
            about["dtype"] = about["dtype"].removeprefix("mlx.core.")
        else:
            about["dtypes"] = [d.removeprefix("mlx.core.") for d in about["dtypes"]] * 2


@pytest.mark.parametrize("kind", ["dense", "8-bit"])
def test_bare_dtype_names_are_also_accepted(tiny_fp, originals, tokens, tmp_path, kind):
    path = original_write(tmp_path / "c.wp30", originals[kind], tokens, tiny_fp, *KINDS[kind], edit=_bare_dtypes)
    store = CacheStore(tmp_path / "store")
    imported = import_wp30(store, path, tiny_fp, tokens)
    got = decode_chunks(store.manifest(imported.manifest.cache_id), store.chunks(imported.manifest.cache_id))
    assert same(arrays_of(got), arrays_of(originals[kind]))


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
    "class pair": (
        _layer("cls", "QuantizedKVCache", "manifest"),
        "layer 1: class 'KVCache' .manifest 'QuantizedKVCache'",
    ),
    "offset": (_layer("offset", 150), "layer 1: offset 150"),
    "n_kept": (_layer("n_kept", 250), "layer 1: n_kept 250"),
    "stored": (_layer("stored_positions", 3, "manifest"), "layer 1: n_kept 200 / stored_positions 3"),
    "shape": (_layer("k_shape", [1, 2, 7, 64], "manifest"), "layer 1: k_shape/v_shape do not match"),
    "dtype": (
        _layer("dtype", "mlx.core.float16", "manifest"),
        "layer 1: dtype 'mlx.core.float16', the arrays are float32$",
    ),
    "bare dtype": (_layer("dtype", "float16", "manifest"), "layer 1: dtype 'float16', the arrays are float32$"),
    "dtype spelling": (_layer("dtype", "numpy.float32", "manifest"), "layer 1: dtype 'numpy.float32'"),
    "missing array": (_drop_array, "layer 2: missing arrays L2.v"),
    "extra array": (_extra_array, "arrays no layer describes: L9.k"),
    "array rows": (_fewer_kept, "layer 1: k_shape/v_shape do not match"),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_each_wrong_field_is_refused_with_its_reason(tiny_fp, originals, tokens, tmp_path, wrong):
    edit, message = WRONG[wrong]
    path = original_write(tmp_path / "c.wp30", originals["dense"], tokens, tiny_fp, "full", {}, edit=edit)
    store = CacheStore(tmp_path / "store")
    with pytest.raises(Wp30Error, match=message) as refused:
        import_wp30(store, path, tiny_fp, tokens)
    assert "\n" not in str(refused.value)
    assert store.entries() == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (_layer("bits", 4), "layer 1: bits/group_size differ"),
        (
            _layer("dtypes", ["mlx.core.uint8", "mlx.core.float32", "mlx.core.float32"], "manifest"),
            r"layer 1: dtypes \['mlx.core.uint8', 'mlx.core.float32', 'mlx.core.float32'\] do not match the arrays "
            r"\['uint32', 'float32', 'float32'\]$",
        ),
        (_layer("dtypes", "mlx.core.uint32", "manifest"), "layer 1: dtypes 'mlx.core.uint32' do not match"),
    ],
)
def test_quantization_fields_are_checked(tiny_fp, originals, tokens, tmp_path, edit, message):
    path = original_write(tmp_path / "c.wp30", originals["8-bit"], tokens, tiny_fp, *KINDS["8-bit"], edit=edit)
    with pytest.raises(Wp30Error, match=message):
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
@pytest.mark.parametrize("kind", KINDS)
def test_an_export_loads_in_the_original_reader(tiny, tiny_fp, ours, prompt_ids, tokens, tmp_path, kind, compression):
    store = CacheStore(tmp_path / "store")
    manifest = put(store, ours[kind], tiny_fp, tokens, make_press(*KINDS[kind]))
    path = export_wp30(store, manifest.cache_id, tmp_path / "out.wp30", tokens, tiny_fp, compression)
    assert path.read_bytes().startswith({"gzip": GZIP, "zstd": ZSTD}.get(compression, b""))

    theirs, cache = original_read(path, tiny_fp, tokens)
    assert (theirs["document_id"], theirs["method_id"]) == (manifest.cache_id, KINDS[kind][0])
    dtype = theirs["layers"][0].get("dtype") or theirs["layers"][0]["dtypes"][1]
    assert dtype == "mlx.core.float32"
    assert same(arrays_of(cache), arrays_of(ours[kind]))
    assert_generates_like(tiny[0], cache, ours[kind], prompt_ids[200:210])

    imported = import_wp30(CacheStore(tmp_path / "other"), path, tiny_fp, tokens)
    assert imported.manifest.cache_id == manifest.cache_id  # same content, same id
    assert imported.unchecked == ["model_revision"]  # kvmesh's own hashes are verified


def test_export_refuses_what_the_format_cannot_hold(tiny_fp, ours, tokens, tmp_path):
    store = CacheStore(tmp_path / "store")
    manifest = put(store, ours["dense"], tiny_fp, tokens)
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
