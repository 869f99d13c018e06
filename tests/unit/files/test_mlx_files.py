"""mlx-lm prompt-cache files enter the mesh, and mesh caches become files mlx-lm uses."""

import subprocess
import sys
import textwrap

import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import sparse_from_dense
from kvmesh.errors import KvmeshError
from kvmesh.files.mlx_prompt_cache import export_prompt_cache, import_prompt_cache
from kvmesh.model.fingerprint import fingerprint
from kvmesh.model.prompt import cache_prompt_tokens
from kvmesh.store import CacheStore
from support.processes import mlx_lm_cli
from support.references import same_tensors
from support.stores import load, put

PROMPT = "The kettle on the stove began to sing just as the rain started."


@pytest.mark.slow
def test_import_a_file_made_by_mlx_lm_cache_prompt(tiny, tiny_dir, tmp_path):
    path = tmp_path / "prompt.safetensors"
    made = mlx_lm_cli("cache_prompt", "--model", str(tiny_dir), "--prompt", PROMPT, "--prompt-cache-file", str(path))
    assert made.returncode == 0, made.stderr
    tokens = cache_prompt_tokens(tiny[1], PROMPT)
    store = CacheStore(tmp_path / "store")
    manifest = import_prompt_cache(store, path, fingerprint(tiny_dir), tokens)
    assert manifest.prefix.num_tokens == len(tokens) and manifest.compression.method == "full"
    _, stored = load(store, manifest.cache_id)
    original = [sparse_from_dense(c) for c in load_prompt_cache(str(path))]
    assert same_tensors(stored, original)
    assert store.lookup(manifest.model.model_id, tokens + [5, 6]).tokens == len(tokens)


def test_import_refuses_a_prompt_of_another_length(tiny, tiny_dir, tmp_path):
    path = tmp_path / "prompt.safetensors"
    save_prompt_cache(str(path), prefill(tiny[0], [1, 2, 3, 4]).cache)
    with pytest.raises(KvmeshError, match="the cache holds 4 tokens, the prompt has 3"):
        import_prompt_cache(CacheStore(tmp_path / "store"), path, fingerprint(tiny_dir), [1, 2, 3])


def test_import_refuses_a_file_that_is_not_a_prompt_cache(tiny_dir, tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(KvmeshError, match="not an mlx-lm prompt cache"):
        import_prompt_cache(CacheStore(tmp_path / "store"), path, fingerprint(tiny_dir), [1])


PLAIN_MLX_LM_LOAD = textwrap.dedent(
    """
    import sys
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
    cache, meta = load_prompt_cache(sys.argv[1], return_metadata=True)
    print(type(cache[0]).__name__, cache[0].offset, meta["kvmesh_cache_id"])
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("press", [("full", {}), ("quantize", {"kv_bits": 8})], ids=["float", "8bit"])
def test_export_for_mlx_lm_generate(tiny, tiny_dir, tmp_path, press):
    tokens = cache_prompt_tokens(tiny[1], PROMPT)
    store = CacheStore(tmp_path / "store")
    manifest = put(
        store, prefill(tiny[0], tokens, make_press(*press)).cache, fingerprint(tiny_dir), tokens, make_press(*press)
    )
    path = export_prompt_cache(store, manifest.cache_id, tmp_path / "out.safetensors", str(tiny_dir))

    # A process that never imported kvmesh reads mlx-lm's own classes...
    loaded = subprocess.run(
        [sys.executable, "-c", PLAIN_MLX_LM_LOAD, str(path)], capture_output=True, text=True, check=True
    )
    expected_class = "QuantizedKVCache" if press[0] == "quantize" else "KVCache"
    assert loaded.stdout.split() == [expected_class, str(len(tokens)), manifest.cache_id]
    # ...and mlx-lm's generate command continues from the file.
    args = ["--prompt-cache-file", str(path), "--prompt", " and then", "--max-tokens", "3"]
    if press[0] == "quantize":
        args += ["--kv-bits", "8"]
    generated = mlx_lm_cli("generate", *args)
    assert generated.returncode == 0, generated.stderr
    assert "Generation: 3 tokens" in generated.stdout


def test_an_evicted_cache_is_refused_naming_what_uses_it(tiny, tiny_dir, tmp_path):
    # mlx-lm's own KVCache cannot hold evicted positions, and a file of kvmesh's classes crashes
    # plain mlx_lm.generate (KeyError: 'SparseKVCache'): no file at all is written.
    press = make_press("streaming_llm", {"budget": 8})
    tokens = cache_prompt_tokens(tiny[1], PROMPT)
    store = CacheStore(tmp_path / "store")
    manifest = put(store, prefill(tiny[0], tokens, press).cache, fingerprint(tiny_dir), tokens, press)
    out = tmp_path / "out.safetensors"
    with pytest.raises(KvmeshError, match="evicted tokens .streaming_llm.*kvmesh generate.*cache export"):
        export_prompt_cache(store, manifest.cache_id, out, str(tiny_dir))
    assert not out.exists()
