"""Models whose layers are not all full attention: sliding windows (gemma3), hybrids whose
linear-attention or convolution layers keep recurrent state (qwen3.5, lfm2), composite layers of a
mamba state and attention (falcon_h1: CacheList), and chunked attention (llama4).

Each family is a real mlx-lm architecture with random weights; their caches go through the real
gRPC server and come back as the classes mlx-lm's model code expects, generating exactly as a local
prefill does.
"""

import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
)

from kvmesh.caches.kinds import check_supported
from kvmesh.caches.prefill import prefill, run_prompt
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.chunks import parse_frame
from kvmesh.codec.compat import ReceiverProfile, validate_manifest
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.manifest import layer_report
from kvmesh.errors import CacheRejected, UnsupportedCacheError
from kvmesh.files.mlx_prompt_cache import export_prompt_cache, import_prompt_cache
from kvmesh.model.fingerprint import fingerprint
from kvmesh.model.prompt import cache_prompt_tokens
from kvmesh.net.client import PeerClient
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import model_pb2
from support.processes import ENV, cli, mlx_lm_cli
from support.references import logprobs_after, same_arrays, tokens_after
from support.stores import put

FAMILIES = ["tiny-gemma3", "tiny-qwen3.5", "tiny-lfm2", "tiny-falcon-h1", "tiny-llama4"]
# What mlx-lm's make_cache gives each family, layer by layer.
LAYOUTS = {
    "tiny-gemma3": [RotatingKVCache, KVCache, RotatingKVCache, KVCache],
    "tiny-qwen3.5": [ArraysCache, KVCache, ArraysCache, KVCache],
    "tiny-lfm2": [ArraysCache, KVCache, ArraysCache, KVCache],
    "tiny-falcon-h1": [CacheList, CacheList],
    "tiny-llama4": [ChunkedKVCache, ChunkedKVCache, ChunkedKVCache, KVCache],
}
WINDOW = 32  # tiny-gemma3's sliding window: every prompt here is longer
CHUNK = 64  # tiny-llama4's attention chunk


def parts(cache):
    """Every cache of a cache list, CacheLists opened: what the manifest and `cache show` list."""
    return [part for c in cache for part in (c.caches if isinstance(c, CacheList) else [c])]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, preset_dir, preset_model):
    """(preset, model, tokenizer, fingerprint, model dir) of one family."""
    path = preset_dir(request.param)
    model, tokenizer = preset_model(request.param)
    return request.param, model, tokenizer, fingerprint(path), path


def test_the_presets_have_the_layouts_of_their_families(family):
    preset, model, *_ = family
    assert [type(c) for c in make_prompt_cache(model)] == LAYOUTS[preset]


def test_fetched_from_a_peer_it_generates_exactly_as_a_local_prefill(family, prompt_ids, grpc_peers, tmp_path):
    preset, model, _, fp, _ = family
    prefix, suffix = prompt_ids[:256], prompt_ids[256:]
    store = CacheStore(tmp_path / "producer")
    manifest = put(store, prefill(model, prefix).cache, fp, prefix)
    address = grpc_peers.start(tmp_path / "producer").address

    with PeerClient(address) as client:
        fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
        # Only the exact prefix is on offer: a shorter one is refused with a typed reason.
        assert [m.tokens for m in client.lookup(fp.model_id, prompt_ids)] == [256]
        assert client.lookup(fp.model_id, prompt_ids[:200]) == []
        with pytest.raises(CacheRejected) as refused:
            fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids), num_tokens=128)
        assert refused.value.rejection.reason == pb.REJECT_REASON_PREFIX
        assert "exact prefix of 256 tokens" in str(refused.value)

    expected = [SparseKVCache if cls is KVCache else cls for cls in LAYOUTS[preset]]
    assert [type(c) for c in fetched.cache] == expected
    local, _, _ = run_prompt(model, prefix)
    assert same_arrays(logprobs_after(model, fetched.cache, suffix, 6), logprobs_after(model, local, suffix, 6))


@pytest.mark.slow  # `kvmesh cache show`
@pytest.mark.parametrize(
    "method, config", [("snapkv", {"ratio": 0.5, "window": 16, "kv_bits": 8}), ("streaming_llm", {"budget": 64})]
)
def test_presses_touch_only_full_attention_and_say_what_each_layer_kept(family, prompt_ids, method, config, tmp_path):
    preset, model, _, fp, _ = family
    press = make_press(method, config)
    prefix = prompt_ids[:256]
    store = CacheStore(tmp_path / "store")
    manifest = put(store, prefill(model, prefix, press).cache, fp, prefix, press)
    cache = decode_chunks(store.manifest(manifest.cache_id), store.chunks(manifest.cache_id))

    report = layer_report(manifest)
    pressed_kind = "sparse_quantized_kv" if "kv_bits" in config else "sparse_kv"
    in_list = [isinstance(c, CacheList) for c in make_prompt_cache(model) for _ in getattr(c, "caches", [c])]
    assert len(report) == len(in_list)
    for row, part, listed in zip(report, parts(make_prompt_cache(model)), in_list):
        if isinstance(part, KVCache) and listed:  # a CacheList's attention is never pressed
            assert (row["kind"], row["kept"], "bits" in row) == ("sparse_kv", 256, False)
        elif isinstance(part, KVCache):
            assert (row["kind"], row["kept"], row.get("bits")) == (
                pressed_kind,
                128 if method == "snapkv" else 64,
                config.get("kv_bits"),
            )
        elif isinstance(part, RotatingKVCache):
            assert (row["kind"], row["kept"], row["window"], "bits" in row) == ("rotating_kv", WINDOW, WINDOW, False)
        elif isinstance(part, ChunkedKVCache):
            # Chunks trim their front before each forward pass: the last chunk, plus what came after it.
            assert row["kind"] == "chunked_kv" and CHUNK < row["kept"] <= CHUNK + 16 and "bits" not in row
        else:
            assert row["kind"] == "arrays" and row["arrays"] and "kept" not in row
    expected = [
        (SparseQuantizedKVCache if "kv_bits" in config else SparseKVCache) if cls is KVCache else cls
        for cls in LAYOUTS[preset]
    ]
    assert [type(c) for c in cache] == expected
    tokens = tokens_after(model, cache, prompt_ids[256:260], 4)
    assert len(tokens) == 4

    shown = cli("cache", "--store", tmp_path / "store", "show", manifest.cache_id).stdout
    assert f"{method}" in shown and "only its exact prefix" in shown
    assert shown.count(f" {pressed_kind} ") == sum(row["kind"] == pressed_kind for row in report)


def test_a_window_that_dropped_nothing_is_cut_like_a_dense_cache(tiny_fp, prompt_ids):
    # A window wider than the prompt holds every position, so shorter prefixes can be cut from it.
    keys, values = (mx.random.normal((1, 2, 300, 64), key=mx.random.key(i)) for i in range(2))
    layers = []
    for _ in range(4):
        layer = RotatingKVCache(max_size=1024)
        layer.update_and_fetch(keys, values)
        layers.append(layer)
    manifest, chunks = encode_cache(layers, tiny_fp, prompt_ids)
    records = [c.frame() for c in chunks]
    cut, cut_records = cut_prefix(manifest, lambda: iter(records), 256)
    decoded = decode_chunks(cut, map(parse_frame, cut_records))
    assert [(c.offset, c.max_size, c.keys.shape[2]) for c in decoded] == [(256, 1024, 256)] * 4
    assert mx.array_equal(decoded[0].keys, keys[..., :256, :]).item()


def test_unsupported_kinds_are_refused_by_name():
    # Kinds no model's make_cache returns for one sequence, or that mlx-lm itself cannot reload.
    with pytest.raises(UnsupportedCacheError, match="layer 1 of this model uses ConcatenateKVCache"):
        check_supported([KVCache(), ConcatenateKVCache()])
    with pytest.raises(UnsupportedCacheError, match="layer 0 of this model uses CacheList"):
        check_supported([CacheList(CacheList(KVCache()), KVCache())])
    with pytest.raises(UnsupportedCacheError, match="layer 0 of this model uses BatchKVCache"):
        check_supported([BatchKVCache([0, 1])])


def test_layer_specs_of_each_kind_are_checked(family, prompt_ids):
    preset, model, _, fp, _ = family
    manifest, chunks = encode_cache(prefill(model, prompt_ids[:100]).cache, fp, prompt_ids[:100])
    list(chunks)
    assert validate_manifest(manifest) is None
    special = next(i for i, cls in enumerate(LAYOUTS[preset]) if cls is not KVCache)

    def refused(edit):
        broken = pb.CacheManifest()
        broken.CopyFrom(manifest)
        edit(broken.layers[special])
        return validate_manifest(broken)

    def unknown_kind(layer):
        layer.kind = 99

    rejection = refused(unknown_kind)
    assert rejection.reason == pb.REJECT_REASON_CACHE_CLASS and "unknown(99)" in rejection.message

    def wider_window(layer):
        layer.window = 64  # 100 tokens in a 64-window leave 64 positions, not the 32 sent

    def keep_all(layer):
        layer.keep = layer.window

    def integer_state(layer):
        arrays = layer.parts[0] if layer.parts else layer
        arrays.tensors[0].dtype = model_pb2.DTYPE_UINT32

    def positions(layer):
        layer.n_kept = 5

    def renamed(layer):
        layer.tensors[0].name = "keys"

    def no_chunks(layer):
        layer.chunk_size = 0

    def later_start(layer):
        layer.start_position += 1

    def nested(layer):
        inner = pb.LayerSpec()
        inner.CopyFrom(layer)
        layer.parts[1].CopyFrom(inner)

    def with_tensors(layer):
        layer.tensors.add().CopyFrom(layer.parts[1].tensors[0])

    edits = {
        pb.CACHE_KIND_ROTATING_KV: {wider_window: "MALFORMED", keep_all: "MALFORMED"},
        pb.CACHE_KIND_ARRAYS: {integer_state: "DTYPE", positions: "MALFORMED", renamed: "MALFORMED"},
        pb.CACHE_KIND_CHUNKED_KV: {no_chunks: "MALFORMED", later_start: "MALFORMED", positions: "MALFORMED"},
        pb.CACHE_KIND_LIST: {nested: "MALFORMED", with_tensors: "MALFORMED", integer_state: "DTYPE"},
    }[manifest.layers[special].kind]
    for edit, reason in edits.items():
        assert refused(edit).reason == getattr(pb, f"REJECT_REASON_{reason}"), edit.__name__


PLAIN_MLX_LM_LOAD = textwrap.dedent(
    """
    import sys
    from mlx_lm.models.cache import load_prompt_cache
    print(" ".join(type(c).__name__ for c in load_prompt_cache(sys.argv[1])))
    """
)


@pytest.mark.slow
def test_mlx_lm_files_of_each_family_go_in_and_out(family, tmp_path):
    preset, model, tokenizer, fp, path = family
    prompt = "The kettle on the stove began to sing just as the rain started, and the cat looked up."
    made = tmp_path / "made.safetensors"
    result = mlx_lm_cli("cache_prompt", "--model", path, "--prompt", prompt, "--prompt-cache-file", made)
    assert result.returncode == 0, result.stderr
    tokens = cache_prompt_tokens(tokenizer, prompt)
    store = CacheStore(tmp_path / "store")
    manifest = import_prompt_cache(store, made, fp, tokens)
    stored = decode_chunks(store.manifest(manifest.cache_id), store.chunks(manifest.cache_id))
    suffix = tokenizer.encode(" and then", add_special_tokens=False)
    expected = logprobs_after(model, load_prompt_cache(str(made)), suffix, 6)
    assert same_arrays(logprobs_after(model, stored, suffix, 6), expected)

    out = export_prompt_cache(store, manifest.cache_id, tmp_path / "out.safetensors", str(path))
    loaded = subprocess.run(
        [sys.executable, "-c", PLAIN_MLX_LM_LOAD, str(out)], capture_output=True, text=True, check=True, env=ENV
    )
    assert loaded.stdout.split() == [cls.__name__ for cls in LAYOUTS[preset]]
    assert same_arrays(logprobs_after(model, load_prompt_cache(str(out)), suffix, 6), expected)


def test_the_servers_prompt_cache_keeps_and_finds_caches_of_each_family(family, prompt_ids, tmp_path):
    from mlx_lm.generate import generate_step

    from kvmesh.serve.engine.prompt_cache import MeshPromptCache

    preset, model, _, fp, _ = family
    store = CacheStore(tmp_path / "store")
    served = MeshPromptCache(fp, store, min_store_tokens=1)
    # A request as the server runs it: prompt, then single-token decode steps (a wrapped window's ring).
    cache = make_prompt_cache(model)
    generated = [int(t) for t, _ in generate_step(mx.array(prompt_ids[:200]), model, prompt_cache=cache, max_tokens=40)]
    tokens = prompt_ids[:200] + generated
    served.persist(served.insert(tokens, cache), cache)

    # The same server finds it in memory (a copy), for the next turn. Not for a shorter prefix: each
    # family holds a kind that cannot be cut back to 150 tokens (a wrapped window, recurrent state,
    # a chunk begun after it), though mlx-lm's `is_trimmable` says yes to some (trims_exactly).
    again = served.fetch(tokens + [5, 6])
    assert (again.where, again.tokens) == ("memory", len(tokens))
    assert served.fetch(tokens[:150] + [5, 6]).where == "none"

    # Another server (nothing in memory) finds it in the store: exactly that prefix, no shorter one.
    other = MeshPromptCache(fp, store)
    hit = other.fetch(tokens + [5, 6])
    assert (hit.where, hit.tokens) == ("local store", len(tokens))
    assert other.fetch(tokens[:150] + [5, 6]).where == "none"
    reference = tokens_after(model, cache, [5, 6], 4)
    assert tokens_after(model, hit.cache, [5, 6], 4) == reference == tokens_after(model, again.cache, [5, 6], 4)


@pytest.mark.slow
def test_prefill_says_when_a_press_has_nothing_to_press(family, tmp_path):
    preset, *_, path = family
    args = ["--prompt", "The kettle on the stove began to sing. " * 20, "--method", "snapkv", "--ratio", 0.5]
    made = cli("prefill", path, *args, "--store", tmp_path / "store")
    # falcon_h1's attention lives inside CacheLists, which are never pressed.
    assert ("snapkv changed nothing" in made.stderr) == (preset == "tiny-falcon-h1")
