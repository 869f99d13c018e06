#!/usr/bin/env python3
"""A study of cross-layer prediction's variants: how much smaller transform-coded caches are when each
layer's coefficients are first predicted from the layer before, and from what (issue 33's
`--compress small` at 8x). The codec now predicts so at `small` (kvmesh.codec.prediction, with the
layer before and this layer's keys: `--predict previous+keys`); this script, which came before it,
still simulates the other choices (the layer before alone, reduced-rank maps, fewer inputs, other
zstd levels) without changing the codec.

The transform codec (kvmesh.codec.transform) codes each layer on its own. But a token's keys and values
in layer l are projections of nearly the same residual stream as in layer l - 1, so a linear map
fitted once per model predicts part of them from the layer before; only the residual need travel.
This script simulates that closed loop on SmolLM2 and the three texts of scripts/bench_quality.py:
layer by layer, the predictors are the *decoded* coefficients a receiver would hold (the layer
before's keys and values, and with `previous+keys` this layer's keys for its values); each map is a
ridge regression fitted on Python's help topics coded the same way at the same step, stored in
float16 as a basis would (`--rank` keeps a reduced-rank map, `--inputs` the leading components of
each predictor); the residual is coded by the codec's own quantizer and writer, its components in the
order of their calibration RMS, into blobs with the codec's headers (their bytes are counted); the
receiver predicts in float32 from what it decoded, the sender in float64 (peers do not compute bit
for bit: the gap is printed). The rebuilt caches are probed as bench_quality.py probes them: KL of
the teacher-forced continuation and the five facts. With `--predict none` it is the codec itself,
which checks the simulation: 6.898x at KL 0.0194 on the Declaration at step 0.48 (2026-12-05), as
bench_quality.py measures the codec.

What it leaves out, and what building it would cost, is in the README (the transform codec's
section). Needs the real model, as bench_quality.py:
    scripts/dev run python scripts/study_cross_layer.py [--predict previous+keys] [--steps 0.44]
        [--zstd-level 19] [--rank 64] [--inputs 64] [--basis FILE]
"""

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

from support.real_model import fast_blas, smollm2_dir

fast_blas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402

from kvmesh.caches.prefill import run_prompt  # noqa: E402
from kvmesh.caches.presses import make_press  # noqa: E402
from kvmesh.caches.sparse import SparseKVCache  # noqa: E402
from kvmesh.codec.basis import Basis  # noqa: E402
from kvmesh.codec.calibration import default_texts, fit_model_basis  # noqa: E402
from kvmesh.codec.layer_blob import MAGIC, Segments, Writer, blob_magic, read_header  # noqa: E402
from kvmesh.codec.levels import CALIBRATION_TOKENS  # noqa: E402
from kvmesh.codec.prediction_fit import ridge_map  # noqa: E402
from kvmesh.codec.quantize import coded_groups  # noqa: E402
from kvmesh.codec.rotary import apply_rope  # noqa: E402
from kvmesh.codec.sensitivity import KEY_FACTOR, PROBE_TOKENS  # noqa: E402
from kvmesh.codec.transform import SINKS, _prepare, layers_of_cache  # noqa: E402
from kvmesh.codec.transform_decode import _coefficients  # noqa: E402
from kvmesh.model.prompt import cache_prompt_tokens, prompt_tokens  # noqa: E402
from support.quality_probes import (  # noqa: E402
    CONTINUATION,
    continuation_logprobs,
    fact_probes,
    facts_retrieved,
    fp16_bytes,
    load_texts,
    split_context,
)

Coefficients = list[list[np.ndarray]]  # [layer][0 keys, 1 values]: (coded rows, features), float64
Maps = dict[tuple[int, int], "Map"]  # (layer, kind) -> its map


@dataclass
class Prepared:
    """A cache as the codec's encoder sees it: each layer's coefficients past the raw rows, in the
    basis's units, and what its blob's header and raw rows say (kvmesh.codec.transform)."""

    coefficients: Coefficients
    metas: list[dict]
    raws: list[list[tuple[bytes, str]]]


@dataclass
class Map:
    """One tensor's prediction: weights (predictors + 1, features) as a basis would store them
    (float16), the calibration residual's RMS per component (float32; measured on the rows the map
    was fitted on, so a little low), and the order of that RMS, falling (what the coded components
    are taken in: the codec's bits and runs assume a falling RMS)."""

    weights: np.ndarray
    rms: np.ndarray
    order: np.ndarray


@dataclass(frozen=True)
class Setting:
    """What predicts what (the command line's options)."""

    predict: str  # "none", "previous" or "previous+keys"
    rank: int  # 0: full
    inputs: int  # 0: every component of each predictor


def prepared(cache: list, basis: Basis) -> Prepared:
    """A full-attention cache of contiguous positions (the study's), projected by the codec's own
    encoder."""
    layers, metas = _prepare(layers_of_cache(cache), basis, (SINKS, 0, 0), list(range(len(basis))))
    assert all(positions is None for _, positions in layers), "positions that are not 0, 1, 2, ..."
    return Prepared(
        [[np.asarray(p.coeffs).T.astype(np.float64) for p in layer] for layer, _ in layers],
        metas,
        [[(p.raw, p.raw_dtype) for p in layer] for layer, _ in layers],
    )


def step_of(basis: Basis, step: float, layer: int, kind: int) -> float:
    """A tensor's step at a global `step`: the basis's factor for it, as the codec applies it."""
    return step * basis.step_factor(layer, "kv"[kind], KEY_FACTOR)


def predictors(decoded: Coefficients, layer: int, kind: int, setting: Setting) -> np.ndarray | None:
    """What a receiver holds when it decodes `layer`'s keys (kind 0) or values (1): the layer
    before's decoded keys and values and, with previous+keys, this layer's keys for its values; a
    column of ones last. None: nothing to predict from."""
    if setting.predict == "none":
        return None
    parts = list(decoded[layer - 1]) if layer else []
    if setting.predict == "previous+keys" and kind == 1:
        parts.append(decoded[layer][0])
    if not parts:
        return None
    if setting.inputs:
        parts = [p[:, : setting.inputs] for p in parts]
    return np.concatenate([*parts, np.ones((parts[0].shape[0], 1))], axis=1)


def coded_residual(out: Writer, residual: np.ndarray, tensor: Map, step: float) -> tuple[dict, np.ndarray]:
    """A residual coded into `out` by the codec's own quantizer (`coded_groups`, its components in
    the map's order), and what the codec's decoder makes of the bytes written: the header's entry
    and the decoded residual."""
    entry = coded_groups(
        out, mx.array(residual[:, tensor.order].T.astype(np.float32)), tensor.rms[tensor.order], step, True
    )
    header, body = read_header(out.blob({}, MAGIC))
    values = _coefficients(entry, Segments(header, body), residual.shape[0], tables=True).values  # in steps
    decoded = np.zeros_like(residual)
    decoded[:, tensor.order[: entry["n"]]] = np.asarray(values, dtype=np.float64).T * step
    return entry, decoded


def fit_maps(sets: list[Coefficients], basis: Basis, step: float, setting: Setting) -> Maps:
    """Each tensor's map, fitted layer by layer on `sets` (the calibration texts) coded in the closed
    loop at `step`: layer l's from the layer before as a receiver decodes it. (With `rank`, the
    reduced map's product is rounded to float16, not its factors.)"""
    maps: Maps = {}
    decoded: list[Coefficients] = [[] for _ in sets]
    for layer in range(len(basis)):
        for d in decoded:
            d.append([])
        for kind, tb in enumerate((basis.keys[layer], basis.values[layer])):
            xs = [predictors(d, layer, kind, setting) for d in decoded]
            ys = [c[layer][kind] for c in sets]
            if xs[0] is None:
                rms = (tb.rms / tb.scale).astype(np.float32)
                maps[layer, kind] = Map(np.zeros((0, len(rms))), rms, np.arange(len(rms)))
            else:
                x, y = np.concatenate(xs), np.concatenate(ys)
                w = ridge_map(x, y)  # (the codec's own fit: kvmesh.codec.prediction_fit)
                if setting.rank:
                    _, _, vt = np.linalg.svd(x @ w, full_matrices=False)
                    w = w @ vt[: setting.rank].T @ vt[: setting.rank]
                w = w.astype(np.float16).astype(np.float64)
                rms = np.sqrt(((y - x @ w) ** 2).mean(axis=0)).astype(np.float32)
                maps[layer, kind] = Map(w, rms, np.argsort(-rms, kind="stable"))
            tensor, tensor_step = maps[layer, kind], step_of(basis, step, layer, kind)
            for d, inputs, exact in zip(decoded, xs, ys, strict=True):
                prediction = 0.0 if inputs is None else inputs @ tensor.weights
                _, residual = coded_residual(Writer(1), exact - prediction, tensor, tensor_step)
                d[layer].append(prediction + residual)
    return maps


@dataclass
class Coded:
    """A text coded in the closed loop."""

    decoded: Coefficients  # as the receiver decodes them
    nbytes: int  # the layers' blobs, as the codec writes them
    drift: float  # the largest gap between the receiver's and the sender's decoded coefficients, in steps


def coded(text: Prepared, basis: Basis, step: float, maps: Maps, setting: Setting, level: int) -> Coded:
    """`text` coded in the closed loop: the sender predicts in float64 from what it decoded, the
    receiver in float32 from what it decoded (as a peer's GPU or CPU would, not bit for bit), the same
    residual codes for both; each layer's blob made by the codec's own writer and header."""
    sender: Coefficients = []
    receiver: Coefficients = []
    nbytes, drift = 0, 0.0
    for layer in range(len(basis)):
        sender.append([])
        receiver.append([])
        out = Writer(level)
        header = dict(text.metas[layer])
        for kind in range(2):
            tensor, tensor_step = maps[layer, kind], step_of(basis, step, layer, kind)
            inputs = predictors(sender, layer, kind, setting)
            prediction = 0.0 if inputs is None else inputs @ tensor.weights
            entry, residual = coded_residual(out, text.coefficients[layer][kind] - prediction, tensor, tensor_step)
            raw, raw_dtype = text.raws[layer][kind]
            header["kv"[kind]] = {**entry, "raw": out.add(raw, False), "raw_dtype": raw_dtype}
            sender[layer].append(prediction + residual)
            inputs = predictors(receiver, layer, kind, setting)
            weights = tensor.weights.astype(np.float32)
            theirs = 0.0 if inputs is None else (inputs.astype(np.float32) @ weights).astype(np.float64)
            receiver[layer].append(theirs + residual)
            gap = np.abs(receiver[layer][kind] - sender[layer][kind]).max()
            drift = max(drift, float(gap) / tensor_step)
        magic = blob_magic({raw[1] for raw in text.raws[layer]}, False)
        nbytes += len(out.blob({"basis": basis.digest, **header}, magic))
    return Coded(receiver, nbytes, drift)


def rebuilt(cache: list, basis: Basis, exact: Coefficients, decoded: Coefficients) -> list:
    """The cache as a receiver would rebuild it: each coded row moved by its coefficients' error
    (the synthesis is linear and the analysis its exact inverse; RoPE is linear too)."""
    out = []
    for layer, c in enumerate(cache):
        tensors = []
        for kind, x in enumerate((c.keys[..., : c.offset, :], c.values[..., : c.offset, :])):
            tb = (basis.keys[layer], basis.values[layer])[kind]
            b, h, t, d = x.shape
            error = ((decoded[layer][kind] - exact[layer][kind]) * tb.scale).astype(np.float32) @ tb.synthesis()
            moved = mx.array(error.reshape(b, t - SINKS, h, d).transpose(0, 2, 1, 3))
            if kind == 0:
                moved = apply_rope(moved, np.arange(SINKS, t), basis.rotaries[layer])
            tensors.append(mx.concatenate([x[:, :, :SINKS], x[:, :, SINKS:] + moved.astype(x.dtype)], axis=2))
        out.append(SparseKVCache.from_arrays(*tensors, c.offset))
    return out


@dataclass
class Probed:
    """One bench text, as bench_quality.py probes it: the full cache, the continuation and the
    model's predictions over it with that cache, the fact questions."""

    cache: list
    rest: list[int]
    reference: mx.array
    probes: list


def probed_texts(model, tokenizer) -> dict[str, Probed]:
    """The bench's three texts, each prefilled with its facts and probed with the full cache."""
    texts = {}
    for name, text in load_texts().items():
        context_text, rest_text = split_context(text)
        rest = tokenizer.encode(rest_text, add_special_tokens=False)[:CONTINUATION]
        cache = make_press("full").apply(run_prompt(model, prompt_tokens(tokenizer, context_text, "", chat=True))[0])
        probes = fact_probes(tokenizer, context_text)
        texts[name] = Probed(cache, rest, continuation_logprobs(model, cache, rest), probes)
        print(f"{name}: the full cache retrieves {facts_retrieved(model, tokenizer, cache, probes)} of the facts")
    return texts


def main() -> None:
    """Fit the maps for each step on the calibration texts, code the bench's texts with them, probe."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predict", choices=("none", "previous", "previous+keys"), default="previous+keys")
    parser.add_argument("--steps", type=float, nargs="+", default=[0.44], help="global steps, as the levels'")
    parser.add_argument("--zstd-level", type=int, default=1, help="the codec codes at 1")
    parser.add_argument("--rank", type=int, default=0, help="a reduced-rank map (0: full)")
    parser.add_argument("--inputs", type=int, default=0, help="the leading components of each predictor (0: all)")
    parser.add_argument("--basis", type=Path, help="a basis file (default: fitted as bench_quality.py fits it)")
    args = parser.parse_args()
    setting = Setting(args.predict, args.rank, args.inputs)

    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    if args.basis:
        data = args.basis.read_bytes()
        basis = Basis.from_bytes(data, hashlib.sha256(data).hexdigest())
    else:
        basis = fit_model_basis(model, tokenizer).basis
    print(f"basis {basis.digest[:12]}", file=sys.stderr)
    calibration = [
        prepared(
            run_prompt(
                model,
                cache_prompt_tokens(tokenizer, text[: 8 * (CALIBRATION_TOKENS + PROBE_TOKENS)])[:CALIBRATION_TOKENS],
            )[0],
            basis,
        ).coefficients
        for text in default_texts().values()
    ]
    texts = probed_texts(model, tokenizer)
    print(f"{setting}, zstd level {args.zstd_level}")
    for step in args.steps:
        maps = fit_maps(calibration, basis, step, setting)
        cells, worst = [], (float("inf"), 0.0, 0.0)
        for name, t in texts.items():
            text = prepared(t.cache, basis)
            result = coded(text, basis, step, maps, setting, args.zstd_level)
            cache = rebuilt(t.cache, basis, text.coefficients, result.decoded)
            logprobs = continuation_logprobs(model, cache, t.rest)
            kl = (mx.exp(t.reference) * (t.reference - logprobs)).sum(axis=-1)[:-1].mean().item()
            ratio = fp16_bytes(t.cache) / result.nbytes
            facts = facts_retrieved(model, tokenizer, cache, t.probes)
            cells.append(f"{name} {ratio:.3f}x KL {kl:.4f} facts {facts}")
            worst = (min(worst[0], ratio), max(worst[1], kl), max(worst[2], result.drift))
        print(
            f"step {step:g}: " + "; ".join(cells) + f" | worst {worst[0]:.3f}x, KL {worst[1]:.4f}; "
            f"the receiver's coefficients within {worst[2]:.1e} steps of the sender's",
            flush=True,
        )


if __name__ == "__main__":
    main()
