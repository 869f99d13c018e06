#!/usr/bin/env python3
"""A study, not the codec: how much smaller transform-coded caches would be if each layer's
coefficients were first predicted from the layer before (issue 33's `--compress small` at 8x).

The transform codec (kvmesh.codec.transform) codes each layer on its own. But a token's keys and values
in layer l are projections of nearly the same residual stream as in layer l - 1, so a linear map
fitted once per model predicts part of them from the layer before; only the residual need travel.
This script simulates that closed loop on SmolLM2 and the three texts of scripts/bench_quality.py:
layer by layer, the predictors are the *decoded* coefficients a receiver would hold (the previous
layer's keys and values, and with `previous+keys` this layer's keys for its values), the map is
fitted on Python's help topics coded the same way at the same step (ridge regression; `--rank`
keeps a reduced-rank map, `--inputs` the leading components of each predictor), and the residual is
rounded, packed and zstd-coded by runs as the codec codes coefficients (its bits per component from
the residual's calibration RMS; centroid offsets; the first row raw). The decoded caches are probed
as bench_quality.py probes them: KL of the teacher-forced continuation and the five facts. With
`--predict none` it is the codec itself, simulated: that row checks the simulation (2026-12-05:
6.925x at KL 0.0194 on the Declaration at step 0.48, where the codec measures 6.90x at 0.0194).

What it leaves out, and what building it would cost, is in the README (the transform codec's
section). Needs the real model, as bench_quality.py:
    scripts/dev run python scripts/study_cross_layer.py --predict previous+keys --steps 0.43 0.44
        [--zstd-level 19] [--rank 64] [--inputs 64] [--basis FILE]
"""

import argparse
import hashlib
import sys
from pathlib import Path

from support.real_model import fast_blas, smollm2_dir

fast_blas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402
import zstandard  # noqa: E402

from kvmesh.caches.prefill import run_prompt  # noqa: E402
from kvmesh.caches.presses import make_press  # noqa: E402
from kvmesh.caches.sparse import SparseKVCache  # noqa: E402
from kvmesh.codec.basis import Basis  # noqa: E402
from kvmesh.codec.calibration import default_texts, fit_model_basis  # noqa: E402
from kvmesh.codec.levels import CALIBRATION_TOKENS  # noqa: E402
from kvmesh.codec.rotary import apply_rope  # noqa: E402
from kvmesh.codec.sensitivity import PROBE_TOKENS  # noqa: E402
from kvmesh.codec.transform import _prepare, component_groups, kept_components, layers_of_cache, pack_codes  # noqa: E402
from kvmesh.model.prompt import cache_prompt_tokens, prompt_tokens  # noqa: E402
from support.quality_probes import (  # noqa: E402
    CONTINUATION,
    FACTS,
    after,
    continuation_logprobs,
    fp16_bytes,
    greedy,
    load_texts,
    with_facts,
)

# A run's share of its layer's header (offsets, widths, sizes): the codec's headers took 23 KB of a
# `small` cache of the Declaration, ~24 bytes a run.
RUN_HEADER_BYTES = 24
# Ridge regularisation, as a share of each predictor's own energy.
RIDGE = 0.01

Coefficients = list[list[np.ndarray]]  # [layer][0 keys, 1 values]: (tokens after the sink, features)


def coefficients(cache: list, basis: Basis) -> Coefficients:
    """Each layer's keys (RoPE off) and values past the first row, on the basis, in its units."""
    prepared, _ = _prepare(layers_of_cache(cache), basis, (1, 0, 0), list(range(len(basis))))
    return [[np.asarray(p.coeffs).T.astype(np.float64) for p in layer] for layer, _ in prepared]


def quantized(residual: np.ndarray, rms: np.ndarray, step: float, compressor) -> tuple[np.ndarray, int]:
    """A region coded as the codec codes one (runs of components by bits, centroid offsets): what a
    receiver decodes, and the bytes."""
    n = kept_components(rms, step)
    out = np.zeros_like(residual)
    nbytes, at = 0, 0
    for count in component_groups(rms, step, n):
        x = residual[:, at : at + count] / step
        q = np.rint(x)
        nonzero = q != 0
        offset = float((np.abs(x) - np.abs(q))[nonzero].mean()) if nonzero.any() else 0.0
        out[:, at : at + count] = (q + offset * np.sign(q)) * step
        _, plane, escapes = pack_codes(q.T.astype(np.int64))
        nbytes += len(compressor.compress(plane)) + len(escapes) + RUN_HEADER_BYTES
        at += count
    return out, nbytes


def predictors(decoded: list, layer: int, kind: int, args) -> np.ndarray | None:
    """What a receiver holds when it decodes `layer`'s keys (kind 0) or values (1): the layer
    before's decoded keys and values and, with previous+keys, this layer's keys for its values; a
    column of ones last."""
    if args.predict == "none":
        return None
    parts = list(decoded[layer - 1]) if layer else []
    if args.predict == "previous+keys" and kind == 1:
        parts.append(decoded[layer][0])
    if not parts:
        return None
    if args.inputs:
        parts = [p[:, : args.inputs] for p in parts]
    return np.concatenate([*parts, np.ones((parts[0].shape[0], 1))], axis=1)


def code(
    sets: list[Coefficients], basis: Basis, step: float, args, maps: dict | None = None
) -> tuple[list[list[list[np.ndarray]]], list[int], dict]:
    """Each set coded layer by layer in the closed loop (the predictors decoded as a receiver
    decodes them): the decoded coefficients and the bytes per set, and the maps used. With no
    `maps`, each is fitted on these sets as they come (calibration)."""
    fitting = maps is None
    maps = {} if maps is None else maps
    compressor = zstandard.ZstdCompressor(level=args.zstd_level)
    decoded: list[list[list[np.ndarray]]] = [[] for _ in sets]
    nbytes = [0 for _ in sets]
    for layer in range(len(basis)):
        for d in decoded:
            d.append([])
        for kind, tb in enumerate((basis.keys[layer], basis.values[layer])):
            s = step * basis.step_factor(layer, "kv"[kind], 2.0)
            xs = [predictors(d, layer, kind, args) for d in decoded]
            if xs[0] is not None and fitting:
                x = np.concatenate(xs)
                y = np.concatenate([c[layer][kind] for c in sets])
                gram = x.T @ x
                gram += RIDGE * np.diag(np.diag(gram)) + 1e-6 * np.trace(gram) / len(gram) * np.eye(len(gram))
                w = np.linalg.solve(gram, x.T @ y)
                if args.rank:
                    _, _, vt = np.linalg.svd(x @ w, full_matrices=False)
                    w = w @ vt[: args.rank].T @ vt[: args.rank]
                maps[layer, kind] = (w, np.sqrt(((y - x @ w) ** 2).mean(axis=0)))
            for i, c in enumerate(sets):
                y = c[layer][kind]
                if xs[i] is None:
                    prediction, rms = np.zeros_like(y), tb.rms / tb.scale
                else:
                    w, rms = maps[layer, kind]
                    prediction = xs[i] @ w
                residual, b = quantized(y - prediction, rms, s, compressor)
                decoded[i][layer].append(prediction + residual)
                nbytes[i] += b
    return decoded, nbytes, maps


def decoded_cache(cache: list, basis: Basis, exact: Coefficients, decoded: list) -> list:
    """The cache as a receiver would rebuild it: each row moved by its coefficients' error."""
    out = []
    for layer, c in enumerate(cache):
        tensors = []
        for kind, x in enumerate((c.keys[..., : c.offset, :], c.values[..., : c.offset, :])):
            tb = (basis.keys[layer], basis.values[layer])[kind]
            b, h, t, d = x.shape
            error = ((decoded[layer][kind] - exact[layer][kind]) * tb.scale).astype(np.float32) @ tb.synthesis()
            moved = mx.array(error.reshape(b, t - 1, h, d).transpose(0, 2, 1, 3))
            if kind == 0:
                moved = apply_rope(moved, np.arange(1, t), basis.rotaries[layer])
            tensors.append(mx.concatenate([x[:, :, :1], x[:, :, 1:] + moved.astype(x.dtype)], axis=2))
        out.append(SparseKVCache.from_arrays(*tensors, c.offset))
    return out


def retrieved(model, tokenizer, cache: list, probes: list) -> int:
    """How many facts the model answers with `cache`, as bench_quality.py asks them."""
    return sum(
        value.lower() in tokenizer.decode(greedy(model, cache, q, 6, tokenizer.eos_token_id)).lower()
        for q, value in probes
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predict", choices=("none", "previous", "previous+keys"), default="previous+keys")
    parser.add_argument("--steps", type=float, nargs="+", default=[0.43, 0.44], help="global steps, as the levels'")
    parser.add_argument("--zstd-level", type=int, default=1, help="the codec codes at 1")
    parser.add_argument("--rank", type=int, default=0, help="a reduced-rank map (0: full)")
    parser.add_argument("--inputs", type=int, default=0, help="the leading components of each predictor (0: all)")
    parser.add_argument("--basis", type=Path, help="a basis file (default: fitted as bench_quality.py fits it)")
    args = parser.parse_args()

    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    if args.basis:
        data = args.basis.read_bytes()
        basis = Basis.from_bytes(data, hashlib.sha256(data).hexdigest())
    else:
        basis = fit_model_basis(model, tokenizer).basis
    print(f"basis {basis.digest[:12]}", file=sys.stderr)
    calibration = []
    for text in default_texts().values():
        tokens = cache_prompt_tokens(tokenizer, text[: 8 * (CALIBRATION_TOKENS + PROBE_TOKENS)])[:CALIBRATION_TOKENS]
        calibration.append(coefficients(run_prompt(model, tokens)[0], basis))
    texts = {}
    for name, text in load_texts().items():
        words = with_facts(text).split(" ")
        cut = len(words) - max(40, len(words) // 8)
        context_text = " ".join(words[:cut])
        rest = tokenizer.encode(" " + " ".join(words[cut:]), add_special_tokens=False)[:CONTINUATION]
        cache = make_press("full").apply(run_prompt(model, prompt_tokens(tokenizer, context_text, "", chat=True))[0])
        probes = [
            (
                after(tokenizer, context_text, f"According to the text, what is the {thing}? Answer briefly.")
                + tokenizer.encode(f"The {thing} is", add_special_tokens=False),
                value,
            )
            for thing, value in FACTS
        ]
        texts[name] = (cache, rest, continuation_logprobs(model, cache, rest), probes)
        print(f"{name}: the full cache retrieves {retrieved(model, tokenizer, cache, probes)} of the facts")
    print(f"predict {args.predict}, zstd {args.zstd_level}, rank {args.rank or 'full'}, inputs {args.inputs or 'all'}")
    for step in args.steps:
        maps = code(calibration, basis, step, args)[2]
        cells, worst = [], (float("inf"), 0.0)
        for name, (cache, rest, reference, probes) in texts.items():
            exact = coefficients(cache, basis)
            (decoded,), (nbytes,), _ = code([exact], basis, step, args, maps)
            raw = sum(2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size for c in cache)  # the first rows
            rebuilt = decoded_cache(cache, basis, exact, decoded)
            logprobs = continuation_logprobs(model, rebuilt, rest)
            kl = (mx.exp(reference) * (reference - logprobs)).sum(axis=-1)[:-1].mean().item()
            facts = retrieved(model, tokenizer, rebuilt, probes)
            ratio = fp16_bytes(cache) / (nbytes + raw)
            cells.append(f"{name} {ratio:.3f}x KL {kl:.4f} facts {facts}")
            worst = (min(worst[0], ratio), max(worst[1], kl))
        print(f"step {step:g}: " + "; ".join(cells) + f" | worst {worst[0]:.3f}x, KL {worst[1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
