"""The real KV cache the codec and transfer benchmarks measure: the `small` preset (Llama-3.2-1B
geometry, random weights) prefilled once into a work dir, then read back, and tiled to a size."""

import argparse
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvmesh.caches.prefill import prefill
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.model.fingerprint import fingerprint
from kvmesh.model.testmodels import make_test_model
from kvmesh.paths import cache_dir


def prepared_cache(work: Path, tokens: int):
    """(cache, fingerprint, token ids): prefilled once, then read back from work/."""
    model_dir, cache_file = work / "small", work / f"small-{tokens}.safetensors"
    if not model_dir.exists():
        make_test_model(model_dir, "small")
    fp = fingerprint(model_dir)
    ids = [(i * 7919) % 2000 + 4 for i in range(tokens)]
    if not cache_file.exists():
        model, _ = mlx_lm.load(str(model_dir))
        start = time.perf_counter()
        cache = prefill(model, ids, progress=lambda d, n: print(f"\rprefill {d}/{n}", end="", flush=True)).cache
        print(f"\rprefilled {tokens} tokens in {time.perf_counter() - start:.0f} s")
        save_prompt_cache(str(cache_file), cache)
    return load_prompt_cache(str(cache_file)), fp, ids


def default_work_dir() -> Path:
    return cache_dir() / "bench"


def add_cache_arguments(parser: argparse.ArgumentParser, mb: int) -> None:
    """--mb, --tokens and --work-dir: the tiled cache of the transfer benchmarks."""
    parser.add_argument("--mb", type=int, default=mb, help="approximate fp16 cache size")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens prefilled before tiling")
    parser.add_argument("--work-dir", type=Path, default=default_work_dir())


def tiled_cache(args: argparse.Namespace):
    """(cache, fingerprint, token ids): the prepared cache repeated along the tokens to about --mb MB."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache, fp, ids = prepared_cache(args.work_dir, args.tokens)
    copies = max(1, round(args.mb * 1e6 / sum(c.nbytes for c in cache)))
    tiled = [
        SparseKVCache.from_arrays(*(mx.concatenate([t] * copies, 2) for t in (c.keys, c.values)), c.offset * copies)
        for c in cache
    ]
    return tiled, fp, ids * copies
