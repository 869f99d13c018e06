"""Models whose layers are not all full attention: sliding windows (gemma3) and hybrids whose
linear-attention or convolution layers keep recurrent state (qwen3.5, lfm2).

Each family is a real mlx-lm architecture with random weights; their caches go through a real
daemon and come back as the classes mlx-lm's model code expects, generating exactly as a local
prefill does.
"""

import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
)

from helpers import ENV, cli, mlx_lm_cli, put
from kvmesh.caches.kinds import check_supported
from kvmesh.caches.prefill import generate_from_cache, prefill, run_prompt
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.compat import ReceiverProfile, validate_manifest
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.manifest import layer_report
from kvmesh.errors import CacheRejected, UnsupportedCacheError
from kvmesh.files.mlx_prompt_cache import cache_prompt_tokens, export_prompt_cache, import_prompt_cache
from kvmesh.model.fingerprint import fingerprint
from kvmesh.net.client import PeerClient
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import model_pb2

FAMILIES = ["tiny-gemma3", "tiny-qwen3.5", "tiny-lfm2"]
# What mlx-lm's make_cache gives each family, layer by layer.
LAYOUTS = {
    "tiny-gemma3": [RotatingKVCache, KVCache, RotatingKVCache, KVCache],
    "tiny-qwen3.5": [ArraysCache, KVCache, ArraysCache, KVCache],
    "tiny-lfm2": [ArraysCache, KVCache, ArraysCache, KVCache],
}
WINDOW = 32  # tiny-gemma3's sliding window: every prompt here is longer


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(preset, model, tokenizer, fingerprint, model dir) of one family."""
    import mlx_lm

    from kvmesh.model.testmodels import make_test_model

    path = make_test_model(tmp_path_factory.mktemp("models") / request.param, request.param)
    model, tokenizer = mlx_lm.load(str(path))
    return request.param, model, tokenizer, fingerprint(path), path


def logprobs_after(model, cache, suffix, n=6):
    """Logprobs of n greedy steps after `suffix`; the cache is changed in place."""
    return [lp for _, lp in generate_from_cache(model, cache, suffix, n)]


def same(a, b):
    return len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def test_the_presets_have_the_layouts_of_their_families(family):
    preset, model, *_ = family
    assert [type(c) for c in make_prompt_cache(model)] == LAYOUTS[preset]


@pytest.mark.slow
def test_fetched_from_a_daemon_it_generates_exactly_as_a_local_prefill(family, prompt_ids, serve, tmp_path):
    preset, model, _, fp, _ = family
    prefix, suffix = prompt_ids[:256], prompt_ids[256:]
    store = CacheStore(tmp_path / "producer")
    manifest = put(store, prefill(model, prefix).cache, fp, prefix)
    address = serve(tmp_path / "producer")

    with PeerClient(address) as client:
        fetched = client.fetch(manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
        # Only the exact prefix is on offer: a shorter one is refused with a typed reason.
        assert [m.tokens for m in client.lookup(fp.model_id, prompt_ids)] == [256]
        assert client.lookup(fp.model_id, prompt_ids[:200]) == []
        with pytest.raises(CacheRejected) as refused:
            client.fetch(manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids), num_tokens=128)
        assert refused.value.rejection.reason == pb.REJECT_REASON_PREFIX
        assert "exact prefix of 256 tokens" in str(refused.value)

    expected = [SparseKVCache if cls is KVCache else cls for cls in LAYOUTS[preset]]
    assert [type(c) for c in fetched.cache] == expected
    local, _, _ = run_prompt(model, prefix)
    assert same(logprobs_after(model, fetched.cache, suffix), logprobs_after(model, local, suffix))


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
    for row, cls in zip(report, LAYOUTS[preset]):
        if cls is KVCache:
            assert (row["kind"], row["kept"], row.get("bits")) == (
                "sparse_quantized_kv" if "kv_bits" in config else "sparse_kv",
                128 if method == "snapkv" else 64,
                config.get("kv_bits"),
            )
        elif cls is RotatingKVCache:
            assert (row["kind"], row["kept"], row["window"], "bits" in row) == ("rotating_kv", WINDOW, WINDOW, False)
        else:
            assert row["kind"] == "arrays" and row["arrays"] and "kept" not in row
    quantized = SparseQuantizedKVCache if "kv_bits" in config else SparseKVCache
    assert [type(c) for c in cache] == [quantized if cls is KVCache else cls for cls in LAYOUTS[preset]]
    tokens = [t for t, _ in generate_from_cache(model, cache, prompt_ids[256:260], 4)]
    assert len(tokens) == 4

    shown = cli("cache", "--store", tmp_path / "store", "show", manifest.cache_id).stdout
    assert f"{method}" in shown and "only its exact prefix" in shown
    assert shown.count("sparse_quantized_kv" if "kv_bits" in config else "sparse_kv") == 2


def test_a_window_that_dropped_nothing_is_cut_like_a_dense_cache(tiny_fp, prompt_ids):
    # A window wider than the prompt holds every position, so shorter prefixes can be cut from it.
    keys, values = (mx.random.normal((1, 2, 300, 64), key=mx.random.key(i)) for i in range(2))
    layers = []
    for _ in range(4):
        layer = RotatingKVCache(max_size=1024)
        layer.update_and_fetch(keys, values)
        layers.append(layer)
    manifest, chunks = encode_cache(layers, tiny_fp, prompt_ids)
    records = [c.SerializeToString() for c in chunks]
    cut, cut_records = cut_prefix(manifest, lambda: iter(records), 256)
    decoded = decode_chunks(cut, map(pb.Chunk.FromString, cut_records))
    assert [(c.offset, c.max_size, c.keys.shape[2]) for c in decoded] == [(256, 1024, 256)] * 4
    assert mx.array_equal(decoded[0].keys, keys[..., :256, :]).item()


def test_unsupported_kinds_are_refused_by_name():
    with pytest.raises(UnsupportedCacheError, match="layer 1 of this model uses CacheList"):
        check_supported([KVCache(), CacheList(ArraysCache(2), KVCache())])
    with pytest.raises(UnsupportedCacheError, match="layer 0 of this model uses ChunkedKVCache"):
        check_supported([ChunkedKVCache(64), KVCache()])


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
    if preset == "tiny-gemma3":

        def wider_window(layer):
            layer.window = 64  # 100 tokens in a 64-window leave 64 positions, not the 32 sent

        def keep_all(layer):
            layer.keep = layer.window

        for edit in (wider_window, keep_all):
            assert refused(edit).reason == pb.REJECT_REASON_MALFORMED
    else:

        def integer_state(layer):
            layer.tensors[0].dtype = model_pb2.DTYPE_UINT32

        def positions(layer):
            layer.n_kept = 5

        def renamed(layer):
            layer.tensors[0].name = "keys"

        assert refused(integer_state).reason == pb.REJECT_REASON_DTYPE
        assert refused(positions).reason == pb.REJECT_REASON_MALFORMED
        assert refused(renamed).reason == pb.REJECT_REASON_MALFORMED


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
    expected = logprobs_after(model, load_prompt_cache(str(made)), suffix)
    assert same(logprobs_after(model, stored, suffix), expected)

    out = export_prompt_cache(store, manifest.cache_id, tmp_path / "out.safetensors", str(path))
    loaded = subprocess.run(
        [sys.executable, "-c", PLAIN_MLX_LM_LOAD, str(out)], capture_output=True, text=True, check=True, env=ENV
    )
    assert loaded.stdout.split() == [cls.__name__ for cls in LAYOUTS[preset]]
    assert same(logprobs_after(model, load_prompt_cache(str(out)), suffix), expected)


def test_the_servers_prompt_cache_keeps_and_finds_caches_of_each_family(family, prompt_ids, tmp_path):
    from mlx_lm.generate import generate_step

    from kvmesh.serve.prompt_cache import MeshPromptCache

    preset, model, _, fp, _ = family
    store = CacheStore(tmp_path / "store")
    served = MeshPromptCache(fp, store, min_store_tokens=1)
    # A request as the server runs it: prompt, then single-token decode steps (a wrapped window's ring).
    cache = make_prompt_cache(model)
    generated = [int(t) for t, _ in generate_step(mx.array(prompt_ids[:200]), model, prompt_cache=cache, max_tokens=40)]
    tokens = prompt_ids[:200] + generated
    served.persist(served.insert(tokens, cache), cache)

    # Another server (nothing in memory) finds it in the store: exactly that prefix, no shorter one.
    other = MeshPromptCache(fp, store)
    hit = other.fetch(tokens + [5, 6])
    assert (hit.where, hit.tokens) == ("local store", len(tokens))
    assert other.fetch(tokens[:150] + [5, 6]).where == "none"
    assert [t for t, _ in generate_from_cache(model, hit.cache, [5, 6], 4)] == [
        t for t, _ in generate_from_cache(model, cache, [5, 6], 4)
    ]
