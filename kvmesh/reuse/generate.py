"""Generation that uses the mesh: find the longest cached prefix, fetch it, prefill only the rest."""

import time
from collections.abc import Callable, Collection, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from kvmesh.caches.prefill import generate_from_cache, greedy
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.progress import Progress
from kvmesh.reuse.calibration import ensure_calibrated
from kvmesh.reuse.find import find_prefix
from kvmesh.reuse.rates import Rates
from kvmesh.reuse.records import Generation
from kvmesh.store import CacheStore


def generate(
    model: nn.Module,
    model_fp: ModelFingerprint,
    tokens: Sequence[int],
    store: CacheStore,
    *,
    peers: Sequence[str] = (),
    max_tokens: int = 64,
    progress: Progress | None = None,
    on_token: Callable[[int], None] | None = None,
    credentials: MeshCredentials | None = None,
    idle_timeout: float = TIMEOUTS.stream_idle,
    sampler: Callable[[mx.array], mx.array] = greedy,
    stop_tokens: Collection[int] = (),
    max_kl: float | None = None,
    rates: Rates | None = None,
    mesh_budget: float | None = None,
    prefill_progress: Progress | None = None,
) -> Generation:
    """Generation after `tokens` (greedy, or with an mlx-lm `sampler`), reusing the longest cached
    prefix found on the mesh; it ends at `max_tokens` or at one of `stop_tokens` (the tokenizer's
    end-of-turn ids: `tokenizer.eos_token_ids`), which is not returned.

    With `rates`, a peer's cache is fetched only when that beats prefilling its tokens here (the
    model's prefill and decode rates are measured first if they never were), and this prefill
    refreshes the rate.

    The mesh part takes at most `mesh_budget` seconds (default: `default_budget`): the mesh cannot save
    more than prefilling the whole prompt costs, so after that the prompt is prefilled.
    `progress` follows a fetch (bytes), `prefill_progress` the prefill of the rest (tokens)."""
    if rates is not None and peers:
        ensure_calibrated(model, model_fp, rates)
    prefix = find_prefix(
        model_fp,
        tokens,
        store,
        peers=peers,
        progress=progress,
        credentials=credentials,
        idle_timeout=idle_timeout,
        max_kl=max_kl,
        rates=rates,
        budget=mesh_budget,
    )
    suffix = list(tokens[prefix.tokens :])
    start = time.perf_counter()
    out, first_at = [], None
    prompt_cache = prefix.cache or make_prompt_cache(model)
    prefix = prefix.released()
    steps = generate_from_cache(
        model, prompt_cache, suffix, max_tokens=max_tokens, sampler=sampler, progress=prefill_progress
    )
    for token, _ in steps:
        if first_at is None:
            first_at = time.perf_counter()
        if token in stop_tokens:
            break
        out.append(token)
        if on_token:
            on_token(token)
    end = time.perf_counter()
    if rates is not None:
        rates.record_prefill(model_fp.model_id, len(suffix), (first_at or end) - start, context=prefix.tokens)
    return Generation(out, prefix, len(tokens), (first_at or end) - start, end - (first_at or end))
