"""`kvmesh demo`: what kvmesh does, end to end, on a built-in tiny model (no download, no network)."""

import tempfile
import time
from importlib import resources

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from rich.console import Console

from .evaluate import compare_presses, results_table
from .fingerprint import FileHashCache, fingerprint
from .presses import make_press
from .testmodels import make_test_model


def run_demo(steps: int = 24) -> int:
    """Print each step; return 0 when every check passed, 1 otherwise."""
    console = Console(width=110)
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        model_dir = make_test_model(f"{tmp}/tiny", "tiny")
        fp = fingerprint(model_dir, hash_cache=FileHashCache(f"{tmp}/hashes.sqlite3"))
        console.print(f"[bold]model[/] tiny llama built offline in {model_dir}: id {fp.model_id}, "
                      f"{fp.num_layers} layers, {fp.num_kv_heads} kv heads x {fp.head_dim}, {fp.dtype}")
        model, tokenizer = mlx_lm.load(str(model_dir))

    document = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    prefix = tokenizer.encode(document)
    question = tokenizer.encode("\nQuestions: what is a cache?", add_special_tokens=False)
    console.print(f"[bold]prompt[/] a {len(prefix)}-token document, then a {len(question)}-token question")

    start = time.perf_counter()
    reference = [int(t) for t, _ in generate_step(mx.array(prefix + question), model, max_tokens=steps)]
    console.print(f"[bold]reference[/] mlx-lm generation from the whole prompt: {time.perf_counter() - start:.2f} s")

    presses = [make_press("full")] + [
        make_press(m, c) for m, c in [
            ("streaming_llm", {"ratio": 0.5}), ("snapkv", {"ratio": 0.5}), ("knorm", {"ratio": 0.5}),
            ("quantize", {"kv_bits": 8}), ("snapkv", {"ratio": 0.75, "kv_bits": 4}),
        ]
    ]
    results = compare_presses(model, prefix, question, presses, steps=steps)
    console.print(results_table(results, "the document's cache, compressed, then continued with the question"))

    identical = results[0].tokens == reference
    console.print(
        f"[bold]check[/] uncompressed cache + question gives the reference tokens: "
        + ("[green]identical[/]" if identical else "[red]DIFFERENT[/]")
    )
    return 0 if identical else 1
