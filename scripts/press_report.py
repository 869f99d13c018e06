#!/usr/bin/env python3
"""Bytes kept per compression method and ratio, and how generation drifts, on an offline model.

scripts/dev run python scripts/press_report.py [--preset tiny] [--tokens 1024]
"""

import argparse
import tempfile
from importlib import resources

import mlx_lm
from rich.console import Console

from kvmesh.caches.evaluate import compare_presses, results_table
from kvmesh.caches.presses import make_press
from kvmesh.model.testmodels import make_test_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length")
    parser.add_argument("--steps", type=int, default=16, help="tokens generated per comparison")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = mlx_lm.load(str(make_test_model(f"{tmp}/model", args.preset)))
    text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    ids = tokenizer.encode(text * (args.tokens // 500 + 2))[: args.tokens]
    prefix, suffix = ids[:-8], ids[-8:]

    presses = [make_press("full")]
    for ratio in (0.5, 0.75, 0.9):
        presses += [
            make_press("streaming_llm", {"ratio": ratio}),
            make_press("knorm", {"ratio": ratio}),
            make_press("snapkv", {"ratio": ratio}),
        ]
    presses += [make_press("quantize", {"kv_bits": b}) for b in (8, 4)]
    presses += [make_press("snapkv", {"ratio": 0.75, "kv_bits": 4})]
    results = compare_presses(model, prefix, suffix, presses, steps=args.steps)
    Console(width=120).print(
        results_table(results, f"{args.preset}: {len(prefix)}-token prefix, greedy tokens vs full")
    )


if __name__ == "__main__":
    main()
