"""Generation that uses the mesh: find the longest cached prefix, fetch it, prefill only the rest.

The local store is asked first, then every peer (by block hashes of the prompt; the prompt itself
never leaves). A fetched cache is kept in the local store, so the next request finds it here.
"""

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from kvmesh.caches.prefill import generate_from_cache, greedy, time_prefills
from kvmesh.codec.arrays import Layer
from kvmesh.codec.chunks import parse_frame
from kvmesh.codec.compat import ReceiverProfile, quality_problem
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import decode_chunks
from kvmesh.errors import CacheRejected, IntegrityError, PeerError, StoreError
from kvmesh.fetch_or_prefill import Choice, Rates, choose, probe_bytes
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.client import PeerClient, Progress
from kvmesh.net.credentials import MeshCredentials
from kvmesh.net.transport import IDLE_TIMEOUT
from kvmesh.store import CacheStore
from kvmesh.v1.service_pb2 import Candidate

log = logging.getLogger(__name__)


@dataclass
class PrefixSource:
    """Where the cached prefix of a prompt came from, and what getting it cost."""

    where: str  # "local store", "peer <address>", or "none"
    tokens: int = 0
    seconds: float = 0.0
    wire_bytes: int = 0
    cache_id: str = ""
    # Peers that were tried and failed or refused, with why.
    skipped: list[str] = field(default_factory=list)
    # Each choice between fetching a peer's cache and prefilling its tokens here, with its figures.
    choices: list[str] = field(default_factory=list)


@dataclass
class Generation:
    """The tokens generated, where their prompt's cached prefix came from, and the timings."""

    tokens: list[int]
    source: PrefixSource
    prompt_tokens: int
    # Time to the first token: prefill of the tokens the cache did not cover.
    prefill_s: float
    generate_s: float

    @property
    def estimated_saving_s(self) -> float | None:
        """Prefill time the cached tokens would have cost at this run's prefill rate, minus getting them."""
        fed = self.prompt_tokens - self.source.tokens
        if not self.source.tokens or fed < 8 or self.prefill_s <= 0:
            return None
        return self.source.tokens * self.prefill_s / fed - self.source.seconds


def find_prefix(
    model_fp: ModelFingerprint,
    tokens: Sequence[int],
    store: CacheStore | None,
    peers: Sequence[str],
    progress: Progress | None = None,
    credentials: MeshCredentials | None = None,
    idle_timeout: float = IDLE_TIMEOUT,
    min_tokens: int = 0,
    max_kl: float | None = None,
    rates: Rates | None = None,
) -> tuple[list | None, PrefixSource]:
    """The cache of the longest prefix of `tokens[:-1]` found, and where it came from.

    One token is always left to feed, since generation needs at least one. Sources are tried
    longest first (the local store first on a tie); one that fails (a damaged local entry, a peer
    that refuses, breaks or stalls for `idle_timeout` seconds) is skipped with its reason and the
    next is tried; when none delivers, the caller prefills everything. Sources serving no more than
    `min_tokens` (what the caller already holds) are not tried. Without a `store`, only peers are
    asked and nothing fetched is kept. `max_kl` is a quality floor for lossy caches
    (`ReceiverProfile.max_kl`), honoured for the local store's entries too.

    With `rates` (kvmesh.fetch_or_prefill), a peer's cache is fetched only when that is expected to
    be faster than prefilling the tokens it adds here; each fetch's rate is kept for next time.
    Without them, every peer's cache is fetched.
    """
    wanted = list(tokens[:-1])
    start = time.perf_counter()
    skipped: list[str] = []
    # (tokens served, tie-breaker, where, what): the local store wins ties, then a cache that kept
    # every position, then the smaller.
    sources: list[tuple[int, tuple, str, Any]] = []
    if store is not None and (local := store.lookup(model_fp.model_id, wanted)):
        sources.append((local.tokens, (0,), "local store", local))
    for address in peers:
        try:
            with PeerClient(address, timeout=min(5.0, idle_timeout), credentials=credentials) as client:
                for m in client.lookup(model_fp.model_id, wanted):
                    tie = (1, m.candidate.method != "full", m.candidate.stored_bytes)
                    sources.append((m.tokens, tie, address, m))
        except PeerError as e:
            skipped.append(str(e))
    sources = sorted((s for s in sources if s[0] > min_tokens), key=lambda s: (-s[0], s[1]))

    profile = ReceiverProfile(model_fp, prompt=list(tokens), max_kl=max_kl)
    choices: list[str] = []
    for n, _, where, found in sources:
        try:
            if where == "local store":
                assert store is not None
                cache = load_prefix(store, found.entry.cache_id, n, max_kl)
                return cache, PrefixSource(
                    where, n, time.perf_counter() - start, 0, found.entry.cache_id, skipped, choices
                )
            candidate = found.candidate
            if rates is not None:
                # What fetching saves: prefilling the tokens beyond what is held or found here.
                held = max([min_tokens] + [s[0] for s in sources if s[2] == "local store" and s[0] < n])
                choice = fetch_or_prefill(
                    rates, model_fp.model_id, where, candidate, n - held, held, credentials, idle_timeout
                )
                choices.append(str(choice))
                if not choice.fetch:
                    continue
            with PeerClient(where, credentials=credentials) as client:
                fetched = client.fetch(
                    candidate.cache_id,
                    profile,
                    num_tokens=n if n < candidate.num_tokens else 0,
                    store=store,
                    progress=progress,
                    idle_timeout=idle_timeout,
                    keep=False,
                )
            if rates is not None:
                rates.record_transfer(where, fetched.wire_bytes, fetched.seconds)
            return fetched.cache, PrefixSource(
                f"peer {where}",
                n,
                time.perf_counter() - start,
                fetched.wire_bytes,
                fetched.manifest.cache_id,
                skipped,
                choices,
            )
        except (PeerError, IntegrityError, CacheRejected, StoreError) as e:
            reason = str(e) if where != "local store" else f"local store: {e}"
            log.warning("%s", reason)
            skipped.append(reason)
    return None, PrefixSource("none", 0, time.perf_counter() - start, skipped=skipped, choices=choices)


def fetch_or_prefill(
    rates: Rates,
    model_id: str,
    address: str,
    candidate: Candidate,
    tokens: int,
    held: int,
    credentials: MeshCredentials | None = None,
    timeout: float = IDLE_TIMEOUT,
) -> Choice:
    """Whether fetching the `tokens` that `candidate` at `address` adds to the `held` ones beats
    prefilling them here.

    The link rate is the one measured on earlier transfers from that peer, else a short probe's;
    without timed prefills of the model (`calibrate`), fetching is the choice.
    """
    wire = candidate.stored_bytes * tokens // max(1, candidate.num_tokens)
    prefill = rates.prefill_model(model_id)
    if prefill is None:
        return Choice(True, 0.0, 0.0, f"{tokens:,} cached tokens at {address}: no prefill timed here: fetch")
    if (link_rate := rates.link_rate(address)) is None:
        with PeerClient(address, timeout=timeout, credentials=credentials) as client:
            link_rate = client.probe(probe_bytes(wire))
        rates.record_probe(address, link_rate)
    return choose(tokens, wire, link_rate, prefill, held, address, rates.link_source(address))


def calibrate(model: nn.Module, model_fp: ModelFingerprint, rates: Rates) -> None:
    """Time prefills of the model on this machine, unless some were timed before."""
    if rates.prefill_model(model_fp.model_id) is None:
        for tokens, seconds in time_prefills(model):
            rates.record_prefill(model_fp.model_id, tokens, seconds)


def load_prefix(store: CacheStore, cache_id: str, num_tokens: int, max_kl: float | None = None) -> list[Layer]:
    """The first `num_tokens` of a stored cache, decoded (a dense cache's shorter prefix is cut as read);
    CacheRejected when it is lossy beyond the quality floor `max_kl`."""
    manifest = store.manifest(cache_id)
    if rejection := quality_problem(manifest, max_kl):
        raise CacheRejected(rejection)
    if num_tokens == manifest.prefix.num_tokens:
        records = store.chunk_records(cache_id)
    else:
        manifest, records = cut_prefix(manifest, lambda: store.chunk_records(cache_id), num_tokens)
    return decode_chunks(manifest, map(parse_frame, records))


def generate(
    model: nn.Module,
    model_fp: ModelFingerprint,
    tokens: Sequence[int],
    store: CacheStore,
    peers: Sequence[str] = (),
    max_tokens: int = 64,
    progress: Progress | None = None,
    on_token: Callable[[int], None] | None = None,
    credentials: MeshCredentials | None = None,
    idle_timeout: float = IDLE_TIMEOUT,
    sampler: Callable[[mx.array], mx.array] = greedy,
    stop_tokens: Collection[int] = (),
    max_kl: float | None = None,
    rates: Rates | None = None,
) -> Generation:
    """Generation after `tokens` (greedy, or with an mlx-lm `sampler`), reusing the longest cached
    prefix found on the mesh; it ends at `max_tokens` or at one of `stop_tokens` (the tokenizer's
    end-of-turn ids: `tokenizer.eos_token_ids`), which is not returned.

    With `rates`, a peer's cache is fetched only when that beats prefilling its tokens here (the
    model's prefill rate is measured first if it never was), and this prefill refreshes the rate."""
    if rates is not None and peers:
        calibrate(model, model_fp, rates)
    cache, source = find_prefix(
        model_fp, tokens, store, peers, progress, credentials, idle_timeout, max_kl=max_kl, rates=rates
    )
    suffix = list(tokens[source.tokens :])
    start = time.perf_counter()
    out, first_at = [], None
    for token, _ in generate_from_cache(model, cache or make_prompt_cache(model), suffix, max_tokens, sampler):
        if first_at is None:
            first_at = time.perf_counter()
        if token in stop_tokens:
            break
        out.append(token)
        if on_token:
            on_token(token)
    end = time.perf_counter()
    if rates is not None:
        rates.record_prefill(model_fp.model_id, len(suffix), (first_at or end) - start, source.tokens)
    return Generation(out, source, len(tokens), (first_at or end) - start, end - (first_at or end))
