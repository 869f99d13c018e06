#!/usr/bin/env python3
"""The transform codec (kvmesh.codec.transform) on the real model: bytes against quality and speed.

A per-model basis is fitted from calibration caches of text that ships in installed packages (a
package README, a license, a Python module's source, Python's own help topics), none of them the
texts probed. Each probed cache (the Declaration of Independence and kvmesh's notes, with five facts
placed at depths 0-100%, as `scripts/bench_quality.py` makes them and with its probes: KL of a
teacher-forced continuation to the full cache, top-1 agreement, facts retrieved greedily and their
NLL) is coded at several target ratios, decoded from its bytes into a dense mlx-lm KVCache, and
probed. mlx-lm's 8-bit and 4-bit quantization are measured beside it as anchors of the KL scale.
Throughput counts the fp16-equivalent bytes of the cache per second of encoding (with the step
bisection, and at a known step) and of decoding.

The process's allocator is tuned as the `kvmesh` command tunes it (`kvmesh.allocator`). `--speed`
measures only the codec's speed, on the basis `kvmesh model calibrate` fits (unless --basis names
one) coded at each `--compress` level (its step for that basis, its tail; `small` predicted): encode and
decode of the first probed text's cache (blobs to arrays, and the wire path: chunks through
`kvmesh.codec.decode.decode_chunks` into caches), then the same for a cache of Llama-3.1-8B's
geometry (8 KV heads of 128, synthetic numbers and basis: `kvmesh.codec.rate`). The codec runs
on MLX's default device: on a GPU, its MLX graphs (`kvmesh.codec.layer_pool.numpy_by_default`).

`--save-coded FILE` keeps the probed cache as coded at the default level (8 MB, against 62 MB of float32);
`--speed --coded FILE --basis FILE` then times the codec on it where the model is not installed (a
machine with a GPU): the cache is what decoding the file gives, which the encoder is timed on.

    scripts/dev run python scripts/bench_transform.py [--texts notes] [--ratios 4 8] [--json FILE]
    scripts/dev run python scripts/bench_transform.py --speed [--basis FILE] [--save-coded FILE]
    python scripts/bench_transform.py --speed --coded FILE --basis FILE
"""

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

from support.real_model import blas_name, fast_blas, smollm2_dir

if "--speed" in sys.argv:
    # The codec codes a layer per core, each product on one BLAS thread (OpenBLAS's own threads spin
    # between products, taking the other layer's core: 0.22 against 0.32 GB/s decoding here).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kvmesh.allocator import tune_allocator  # noqa: E402
from kvmesh.caches.prefill import run_prompt  # noqa: E402
from kvmesh.caches.presses import make_press  # noqa: E402
from kvmesh.caches.sparse import SparseKVCache  # noqa: E402
from kvmesh.codec.basis import Basis, fit_basis  # noqa: E402
from kvmesh.codec.calibration import fit_model_basis  # noqa: E402
from kvmesh.codec.coded import TransformCoding, transform_code  # noqa: E402
from kvmesh.codec.decode import decode_chunks  # noqa: E402
from kvmesh.codec.encode import encode_cache  # noqa: E402
from kvmesh.codec.levels import LEVELS, PREDICTED_STEP  # noqa: E402
from kvmesh.codec.rate import measure_decode_rate, synthetic_basis, synthetic_layers  # noqa: E402
from kvmesh.codec.rotary import model_rotaries  # noqa: E402
from kvmesh.codec.transform import SINKS, encode_layers, fp16_nbytes, layers_of_cache  # noqa: E402
from kvmesh.codec.transform_decode import decode_layers  # noqa: E402
from kvmesh.model.fingerprint import ModelFingerprint, fingerprint  # noqa: E402
from kvmesh.model.prompt import prompt_tokens  # noqa: E402
from support import quality_probes as bq  # noqa: E402

CALIBRATION_TOKENS = 1024


def calibration_texts() -> dict[str, str]:
    """Text that ships with installed packages and Python itself (none of it a probed text)."""

    def dist_file(dist: str, name: str) -> str:
        for f in metadata.files(dist) or []:
            if f.name == name:
                return f.read_text()
        raise FileNotFoundError(f"{dist}: no {name}")

    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {
        "rich README": dist_file("rich", "METADATA"),
        "MPL-2.0 (hypothesis)": dist_file("hypothesis", "LICENSE.txt"),
        "textwrap.py": (stdlib / "textwrap.py").read_text(),
        "Python help topics": "\n\n".join(topics[k] for k in ("class", "exceptions", "execmodel", "naming")),
        "Apache-2.0 (grpcio)": dist_file("grpcio", "LICENSE"),
        "json/decoder.py": (stdlib / "json" / "decoder.py").read_text(),
        "Python help topics 2": "\n\n".join(topics[k] for k in ("assignment", "compound", "import")),
        "starlette README": dist_file("starlette", "METADATA"),
    }


def rebuild(decoded) -> list:
    from mlx_lm.models.cache import KVCache

    cache = []
    for keys, values in decoded:
        c = KVCache()
        c.update_and_fetch(keys.astype(mx.float32), values.astype(mx.float32))
        cache.append(c)
    return cache


def probe(model, tokenizer, cache, rest, probes, reference):
    logprobs = bq.continuation_logprobs(model, cache, rest)
    if reference is None:
        reference = logprobs
    kl = (mx.exp(reference) * (reference - logprobs)).sum(axis=-1)[:-1].mean().item()
    top1 = (mx.argmax(reference, -1) == mx.argmax(logprobs, -1))[:-1].astype(mx.float32).mean().item()
    facts = bq.facts_retrieved(model, tokenizer, cache, probes)
    fact_nll = sum(bq.value_nll(model, cache, q, v) for q, _, v in probes) / len(probes)
    return reference, {"kl": kl, "top1": top1, "facts": facts, "fact_nll": fact_nll}


def best_times(runs: dict, repeat: int) -> dict[str, float]:
    """The fastest of `repeat` timed calls of each run, after a warm-up round; taken round-robin, so
    that a shared machine's changing load weighs on all of them alike."""
    best = {name: float("inf") for name in runs}
    for round_ in range(repeat + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def speed_rows(name: str, layers, basis: Basis, cache, fp, repeat: int, levels: list[str]) -> None:
    """Encode and decode GB/s (fp16-equivalent) of one cache at each `--compress` level: blobs to
    arrays (`encode_layers`, `decode_layers`) and the wire path (coded cache -> chunks -> caches)."""
    for level in levels:
        level_row(f"{name}, {level}", layers, basis, cache, fp, repeat, level)


def level_row(name: str, layers, basis: Basis, cache, fp, repeat: int, level: str) -> None:
    """`speed_rows`' row of one level."""
    coding = TransformCoding.at_level(basis, LEVELS[level])  # (its step for such a basis, its tail)
    step = coding.step
    fp16 = fp16_nbytes(layers)
    enc = coding.encode(layers)
    encoded = encode_cache(transform_code(cache, coding), fp, list(range(cache[0].offset)))
    chunks = list(encoded.chunks)
    bases = {basis.digest: basis}
    s = best_times(
        {
            "encode": lambda: coding.encode(layers),
            "decode": lambda: mx.eval(decode_layers(enc.blobs, basis)),
            "wire encode": lambda: list(encode_cache(transform_code(cache, coding), fp, range(cache[0].offset)).chunks),
            "wire decode": lambda: decode_chunks(encoded.manifest, iter(chunks), bases=bases),
        },
        repeat,
    )
    print(
        f"{name}: {fp16 / 1e6:.1f} MB fp16, coded {enc.nbytes / 1e6:.2f} MB ({enc.ratio:.2f}x) at step {step}"
        f"{' (predicted)' if step == basis.predicted_step else ''}: "
        f"encode {fp16 / s['encode'] / 1e9:.3f} GB/s, decode {fp16 / s['decode'] / 1e9:.3f} GB/s; wire path: "
        f"encode {fp16 / s['wire encode'] / 1e9:.3f} GB/s, decode {fp16 / s['wire decode'] / 1e9:.3f} GB/s"
    )


def real_cache_speed(
    model,
    context: list[int],
    basis: Basis,
    fp: ModelFingerprint,
    repeat: int,
    save_coded: Path | None,
    levels: list[str],
) -> None:
    start = time.perf_counter()
    dense, _, _ = run_prompt(model, context)
    print(f"{len(context)} context tokens prefilled in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    cache = make_press("full").apply(dense)
    layers = layers_of_cache(cache)
    if save_coded:
        blobs = TransformCoding.at_level(basis, LEVELS["default"]).encode(layers).blobs
        arrays = {f"layer.{i}": mx.array(np.frombuffer(blob, np.uint8)) for i, blob in enumerate(blobs)}
        mx.save_safetensors(str(save_coded), arrays, {"fingerprint": json.dumps(fp.to_dict()), "basis": basis.digest})
        print(f"the coded cache written to {save_coded}", file=sys.stderr)
    speed_rows("SmolLM2-135M (30 x 3 x 64)", layers, basis, cache, fp, repeat, levels)


def coded_cache_speed(path: Path, basis: Basis, repeat: int, levels: list[str]) -> ModelFingerprint:
    """The rows of `real_cache_speed` on a cache written by `--save-coded` (decoded: a cache the
    model could have made, within the codec's error of the one it made)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    if meta.get("basis") != basis.digest:
        sys.exit(f"{path} was coded with basis {meta.get('basis', '?')[:12]}, --basis is {basis.digest[:12]}")
    blobs = [bytes(np.asarray(arrays[f"layer.{i}"])) for i in range(len(arrays))]
    fp = ModelFingerprint(**json.loads(meta["fingerprint"]))
    decoded = decode_layers(blobs, basis)
    tokens = decoded[0][0].shape[2]
    layers = [(k, v, np.arange(tokens)) for k, v in decoded]
    cache = [SparseKVCache.from_arrays(k, v, tokens) for k, v in decoded]
    name = f"SmolLM2-135M (30 x 3 x 64, decoded from {path.name})"
    speed_rows(name, layers, basis, cache, fp, repeat, levels)
    return fp


def synthetic_speed(
    fp: ModelFingerprint, repeat: int, levels: list[str], *, tokens: int = 1024, n_layers: int = 4
) -> None:
    """A float16 cache of Llama-3.1-8B's geometry (8 KV heads of 128), of `n_layers` layers (with
    predictors that predict nothing: a fitted map costs the codec the same)."""
    basis = synthetic_basis(n_layers, 8, 128, predicted_step=PREDICTED_STEP)
    layers = synthetic_layers(basis, tokens)
    cache = [SparseKVCache.from_arrays(k, v, tokens) for k, v, _ in layers]
    fp = dataclasses.replace(fp, num_layers=n_layers, num_kv_heads=8, head_dim=128, dtype="float16")
    speed_rows(f"8B geometry ({n_layers} x 8 x 128, {tokens} tokens)", layers, basis, cache, fp, repeat, levels)


def decode_rates() -> None:
    for heads, head_dim in ((3, 64), (8, 128)):
        rate = measure_decode_rate(heads, head_dim)
        print(f"measure_decode_rate({heads}, {head_dim}): {rate / 1e9:.3f} GB/s")


def calibrated_basis(model, tokenizer) -> Basis:
    """What `kvmesh model calibrate` fits (in the attention's weights, with per-layer steps): the
    codec's speed is timed on what kvmesh sends."""
    basis = fit_model_basis(model, tokenizer).basis
    print(f"basis: {basis.nbytes / 1e6:.2f} MB, sha256 {basis.digest[:12]}, as kvmesh calibrates", file=sys.stderr)
    return basis


def bench_basis(model, tokenizer, texts: int) -> Basis:
    """A plain PCA basis (no weights, one step) of the first `texts` of `calibration_texts()`."""
    start = time.perf_counter()
    calibration = []
    for name, text in list(calibration_texts().items())[:texts]:
        tokens = prompt_tokens(tokenizer, text, "", chat=True)[:CALIBRATION_TOKENS]
        cache, _, _ = run_prompt(model, tokens)
        calibration.append(layers_of_cache(cache))
        print(f"calibration: {name}, {len(tokens)} tokens", file=sys.stderr)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    basis = fit_basis(calibration, model_rotaries(model), info={"model": "SmolLM2-135M-Instruct", "texts": texts})
    fit_s = time.perf_counter() - start
    print(
        f"basis: {basis.nbytes / 1e6:.2f} MB, sha256 {basis.digest[:12]}, fitted in {fit_s:.2f} s "
        f"(calibration prefills {prefill_s:.1f} s)",
        file=sys.stderr,
    )
    return basis


def read_basis(path: Path) -> Basis:
    digest = path.with_suffix(".sha256").read_text().strip()
    basis = Basis.from_bytes(path.read_bytes(), digest)
    print(f"basis {digest[:12]} read from {path}", file=sys.stderr)
    return basis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", nargs="+", default=["declaration", "notes"], help="probed texts")
    parser.add_argument("--ratios", nargs="+", type=float, default=[3, 4, 6, 8, 12])
    parser.add_argument("--sinks", type=int, default=SINKS)
    parser.add_argument("--recent", type=int, default=0)
    parser.add_argument("--key-factor", type=float, default=2.0, help="keys' step relative to values'")
    parser.add_argument("--calibration", type=int, default=4, help="how many calibration texts (of 8)")
    parser.add_argument("--level", type=int, default=1, help="zstd level")
    parser.add_argument("--no-anchors", action="store_true", help="skip mlx-lm's 8-bit and 4-bit rows")
    parser.add_argument("--basis", type=Path, help="reuse (or write) the basis here (safetensors + .sha256)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--speed", action="store_true", help="only the codec's encode and decode GB/s")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (--speed), the best kept")
    parser.add_argument(
        "--speed-levels", nargs="+", choices=list(LEVELS), default=list(LEVELS), help="(--speed) the levels timed"
    )
    parser.add_argument("--save-coded", type=Path, help="(--speed) also write the probed cache, coded, here")
    parser.add_argument("--coded", type=Path, help="(--speed, --basis) time the codec on this --save-coded cache")
    args = parser.parse_args()
    tune_allocator()  # as the kvmesh command does: freed buffers kept for reuse
    print(f"MLX's default device: {mx.default_device()}", file=sys.stderr)
    if args.coded:
        if not (args.speed and args.basis and args.basis.exists()):
            parser.error("--coded needs --speed and the --basis the cache was coded with")
        fp = coded_cache_speed(args.coded, read_basis(args.basis), args.repeat, args.speed_levels)
        synthetic_speed(fp, args.repeat, args.speed_levels)
        decode_rates()
        return

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    print(f"SmolLM2-135M-Instruct float32 on the CPU ({blas_name()})", file=sys.stderr)

    basis: Basis | None = None
    if args.basis and args.basis.exists():
        basis = read_basis(args.basis)
    if basis is None:
        basis = calibrated_basis(model, tokenizer) if args.speed else bench_basis(model, tokenizer, args.calibration)
        if args.basis:
            args.basis.parent.mkdir(parents=True, exist_ok=True)  # (the README's path is in ~/.cache)
            args.basis.write_bytes(basis.to_bytes())
            args.basis.with_suffix(".sha256").write_text(basis.digest + "\n")

    texts = bq.load_texts()
    if args.speed:
        context = prompt_tokens(tokenizer, bq.with_facts(texts[args.texts[0]]), "", chat=True)
        fp = fingerprint(smollm2_dir())
        real_cache_speed(model, context, basis, fp, args.repeat, args.save_coded, args.speed_levels)
        synthetic_speed(fp, args.repeat, args.speed_levels)
        decode_rates()
        return
    rows = []
    for name in args.texts:
        context_text, rest_text = bq.split_context(texts[name])
        context = prompt_tokens(tokenizer, context_text, "", chat=True)
        rest = tokenizer.encode(rest_text, add_special_tokens=False)[: bq.CONTINUATION]
        probes = bq.fact_probes(tokenizer, context_text)
        start = time.perf_counter()
        dense, _, _ = run_prompt(model, context)
        print(
            f"{name}: {len(context)} context tokens prefilled in {time.perf_counter() - start:.1f} s", file=sys.stderr
        )
        full = make_press("full").apply(dense)
        full_bytes = bq.fp16_bytes(full)

        reference, m = probe(model, tokenizer, full, rest, probes, None)
        rows.append({"text": name, "codec": "full (fp32)", "ratio": 1.0, **m})
        if not args.no_anchors:
            for bits in (8, 4):
                cache = make_press("quantize", {"kv_bits": bits}).apply(dense)
                _, m = probe(model, tokenizer, cache, rest, probes, reference)
                rows.append({"text": name, "codec": f"mlx {bits}-bit", "ratio": full_bytes / bq.fp16_bytes(cache), **m})

        layers = layers_of_cache(full)
        for ratio in args.ratios:
            opts = {"sinks": args.sinks, "recent": args.recent, "key_factor": args.key_factor, "level": args.level}
            start = time.perf_counter()
            enc = encode_layers(layers, basis, ratio=ratio, **opts)
            bisect_s = time.perf_counter() - start
            # The machine is shared: the best of a few runs.
            encode_s = decode_s = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                again = encode_layers(layers, basis, step=enc.step, **opts)
                encode_s = min(encode_s, time.perf_counter() - start)
            assert again.blobs == enc.blobs
            for _ in range(3):
                start = time.perf_counter()
                decoded = decode_layers(enc.blobs, basis)
                decode_s = min(decode_s, time.perf_counter() - start)
            cache = rebuild(decoded)
            _, m = probe(model, tokenizer, cache, rest, probes, reference)
            row = {
                "text": name,
                "codec": f"transform {ratio:g}x",
                "ratio": enc.ratio,
                "step": enc.step,
                "bytes": enc.nbytes,
                "encode_gbs": enc.fp16_bytes / encode_s / 1e9,
                "bisect_s": bisect_s,
                "decode_gbs": enc.fp16_bytes / decode_s / 1e9,
                "decode_ms": decode_s * 1e3,
                **m,
            }
            rows.append(row)
            print(
                f"  {row['codec']:<16} {row['ratio']:.2f}x KL {m['kl']:.4f} facts {m['facts']} "
                f"(nll {m['fact_nll']:.2f}) enc {row['encode_gbs']:.3f} GB/s dec {row['decode_gbs']:.3f} GB/s",
                file=sys.stderr,
            )
        for r in rows:
            if r["text"] == name and r["codec"].startswith(("full", "mlx")):
                print(f"  {r['codec']:<16} {r['ratio']:.2f}x KL {r['kl']:.4f} facts {r['facts']}", file=sys.stderr)

    print(
        f"\nbasis {basis.nbytes / 1e6:.2f} MB; sinks {args.sinks}, recent {args.recent}, key factor {args.key_factor}"
    )
    head = (
        f"| text | codec | vs fp16 | KL | top-1 | facts (of {len(bq.FACTS)}) | fact NLL | encode GB/s "
        "| encode to a ratio, s | decode GB/s |"
    )
    print(head)
    print("|---" * 10 + "|")
    for r in rows:
        enc = f"{r['encode_gbs']:.3f}" if "encode_gbs" in r else ""
        search = f"{r['bisect_s']:.2f}" if "bisect_s" in r else ""
        dec = f"{r['decode_gbs']:.3f}" if "decode_gbs" in r else ""
        print(
            f"| {r['text']} | {r['codec']} | {r['ratio']:.2f}x | {r['kl']:.4f} | {r['top1']:.0%} | {r['facts']} | "
            f"{r['fact_nll']:.2f} | {enc} | {search} | {dec} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
