"""Fitting a model's transform basis (kvmesh.codec.basis) from text, on the Mac that codes its caches.

The basis is the principal axes of the model's keys (RoPE removed) and values in each full-attention
layer, so it must be fitted on the model's own caches of ordinary text: `fit_model_basis` prefills a
few texts (each cut to `tokens_per_text` tokens, in the model's chat template as shared prompts are)
and fits the basis from those caches. The default texts are Python's own help topics
(`pydoc_data.topics`): they ship with every Python, mix English prose with code, and are none of the
texts kvmesh's quality benchmark probes. On SmolLM2-135M four texts of 1,024 tokens take ~3 s to
prefill here and the fit well under a second (scripts/bench_quality.py prints both). The fit weighs
each feature as attention weighs an error there, from the queries recorded while the texts prefill
(kvmesh.codec.attention_metric). Then each
layer's keys and values get their own step factor from how much the model's predictions move when
that tensor alone is coded (kvmesh.codec.sensitivity): two short passes per layer. Last, each
layer's predictors from the layer before (kvmesh.codec.prediction_fit), for the level that predicts.
"""

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import KVCache

from kvmesh.caches.prefill import run_prompt
from kvmesh.codec.attention_metric import layer_weights, recording_queries
from kvmesh.codec.basis import Basis, fit_basis
from kvmesh.codec.levels import CALIBRATION_TOKENS, PREDICTED_STEP
from kvmesh.codec.prediction_fit import fit_predictors
from kvmesh.codec.rotary import RotaryError, model_layers, model_rotaries
from kvmesh.codec.sensitivity import PROBE_TOKENS, step_factors, tensor_sensitivities
from kvmesh.codec.transform import layers_of_cache
from kvmesh.errors import KvmeshError
from kvmesh.model.prompt import cache_prompt_tokens
from kvmesh.progress import Progress

# Which help topics make each default text (a few thousand words each).
DEFAULT_TOPICS = (
    ("class", "exceptions", "execmodel", "naming"),
    ("assignment", "compound", "import"),
    ("types", "datamodel"),
    ("formatstrings", "specialnames", "string-methods"),
)


class NothingToCode(KvmeshError):
    """A model whose caches the transform codec cannot code at all (no plain full-attention layer)."""


# progress(steps done, steps in all): a step per text prefilled, then one per layer's sensitivities.


@dataclass(frozen=True)
class Calibrated:
    basis: Basis
    tokens: int
    prefill_s: float
    fit_s: float
    # Measuring each tensor's sensitivity for its step factor (kvmesh.codec.sensitivity), and fitting
    # the predictors (kvmesh.codec.prediction_fit).
    sensitivity_s: float


def default_texts() -> dict[str, str]:
    """Python's help topics, grouped into a few texts."""
    from pydoc_data.topics import topics

    return {
        "python help: " + ", ".join(group): "\n\n".join(topics[k] for k in group if k in topics)
        for group in DEFAULT_TOPICS
    }


def full_attention_layers(model: Any, cache: list) -> list[int]:
    """The layers of a fresh prompt cache that are plain full attention with a rotary embedding the
    codec can take off (what it codes; a NoPE layer, as llama4's global ones, travels as before)."""
    layers = []
    for i, c in enumerate(cache):
        if type(c) is KVCache:
            try:
                model_rotaries(model, [i])
            except RotaryError:
                continue
            layers.append(i)
    return layers


def fit_model_basis(
    model: Any,
    tokenizer: Any,
    texts: Mapping[str, str] | None = None,
    *,
    tokens_per_text: int = CALIBRATION_TOKENS,
    info: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    weigh: bool = True,
    predict_at: float | None = PREDICTED_STEP,
) -> Calibrated:
    """The model's basis, fitted on its caches of `texts` (default: `default_texts()`), its PCA
    weighed as attention weighs errors (kvmesh.codec.attention_metric; `weigh=False`: as before,
    for comparison), with cross-layer predictors fitted at the step `predict_at`
    (kvmesh.codec.prediction_fit; None: none)."""
    texts = dict(texts or default_texts())
    calibration = []
    every = model_layers(model)
    recorded = []  # each prefill's queries (kvmesh.codec.attention_metric)
    layers: list[int] | None = None
    total = 0
    start = time.perf_counter()
    probed: tuple[list, list[int]] | None = None  # the first text's cache and the tokens after it
    for done, text in enumerate(texts.values()):
        # A token is rarely over 8 characters: tokenize no more than is used.
        read = cache_prompt_tokens(tokenizer, text[: 8 * (tokens_per_text + PROBE_TOKENS)])
        tokens = read[:tokens_per_text]
        if len(tokens) < 16:
            raise KvmeshError(f"a calibration text of {len(tokens)} tokens is too short (give at least a page)")
        # (The layers it codes are known after the first prefill: until then, every layer's queries.)
        with recording_queries(every, range(len(every)) if layers is None else layers) as queries:
            cache, _, _ = run_prompt(model, tokens)
        recorded.append(queries)
        if probed is None:
            # What the model predicts next with the cache: the text past it, or (a text too short
            # for that) its own last tokens read again.
            past = read[tokens_per_text:][:PROBE_TOKENS]
            probed = (cache, past if len(past) >= PROBE_TOKENS // 2 else tokens[-PROBE_TOKENS:])
        layers = full_attention_layers(model, cache) if layers is None else layers
        if not layers:
            raise NothingToCode(
                "this model has no full-attention layers with a rotary embedding: the transform codec has "
                "nothing to code"
            )
        calibration.append(layers_of_cache([cache[i] for i in layers]))
        total += len(tokens)
        if progress:
            progress(done + 1, len(texts) + len(layers))
    prefill_s = time.perf_counter() - start
    assert layers is not None
    start = time.perf_counter()
    rotaries = model_rotaries(model, layers)
    basis = fit_basis(
        calibration,
        rotaries,
        # The texts' names only (a --text path's file name): the basis travels to peers.
        info={**(info or {}), "layers": layers, "texts": sorted(Path(name).name for name in texts), "tokens": total},
        weights=layer_weights(every, layers, rotaries, recorded) if weigh else None,
    )
    fit_s = time.perf_counter() - start
    assert probed is not None
    start = time.perf_counter()
    sensitivities = tensor_sensitivities(
        model,
        probed[0],
        layers,
        basis,
        probed[1],
        progress=progress and (lambda done, total: progress(len(texts) + done, len(texts) + total)),
    )
    # (The probe serialized the basis for its digest: the bytes are made again, with the factors.)
    basis = replace(basis, info={**basis.info, "steps": step_factors(basis, sensitivities)}, _bytes=None, _digest=None)
    if predict_at is not None:
        basis = fit_predictors(calibration, basis, predict_at)
    basis.to_bytes()  # serialized (and its digest known) here, so the calibration's time includes it
    return Calibrated(basis, total, prefill_s, fit_s, time.perf_counter() - start)
