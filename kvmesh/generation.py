"""Generation that uses the mesh: find the longest cached prefix, fetch it, prefill only the rest.

The local store is asked first, then every peer (by block hashes of the prompt; the prompt itself
never leaves). A fetched cache is decoded here as it arrives and kept in the local store in the
same pass (`fetch_cache`), so the next request finds it here.
"""

import logging
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from kvmesh.caches.prefill import generate_from_cache, greedy, time_prefills
from kvmesh.codec.arrays import Layer
from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.basis_file import basis_bytes_bound, geometry_problem
from kvmesh.codec.chunks import parse_frame
from kvmesh.codec.coded import parse_basis
from kvmesh.codec.compat import ReceiverProfile, basis_problem, loss_rank, quality_problem
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import CacheDecoder, decode_chunks
from kvmesh.errors import CacheRejected, IntegrityError, PeerError, Rejection, StoreError
from kvmesh.fetch_or_prefill import Choice, Rates, choose, probe_bytes
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.client import PeerClient, Progress, Transfer
from kvmesh.net.credentials import MeshCredentials
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import ArtifactStore, Incoming, artifact_store, stored_bases
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1.service_pb2 import Candidate

log = logging.getLogger(__name__)
LOCAL_STORE = "local store"
# The least time the mesh part of a request is given, however fast a prefill here would be: a LAN
# lookup and the manifest's round trip take milliseconds, a loaded machine's more.
MIN_MESH_BUDGET = 2.0


@dataclass
class CachedPrefix:
    """The cached prefix of a prompt as a tier found it (memory, the local store, a peer, or none),
    and what finding it cost: the one record from the tiers to what a user reads (`generate
    --json`, the server's usage and log line), all through `report`."""

    where: str  # "memory", "local store", "peer <address>", or "none"
    tokens: int = 0
    seconds: float = 0.0
    wire_bytes: int = 0
    cache_id: str = ""
    # Sources that were tried and failed or refused, with why.
    skipped: list[str] = field(default_factory=list)
    # Each choice between fetching a peer's cache and prefilling its tokens here, with its figures.
    fetch_or_prefill: list[str] = field(default_factory=list)
    # What prefilling the cached tokens here was expected to take, by the prefill rate the choices
    # weigh with (None without one): the time saved is reckoned from it, so the two never disagree.
    expected_prefill_s: float | None = None
    # The cache itself, None when none was found; generation takes it (`released` drops it).
    cache: list | None = field(default=None, repr=False)

    def released(self) -> "CachedPrefix":
        """This record without its cache: what outlives the request (the cache is generation's now)."""
        return replace(self, cache=None)

    def report(self) -> dict:
        """As `kvmesh generate --json` and the server's `usage.kvmesh` print it."""
        return {
            "prefix_from": self.where,
            "prefix_tokens": self.tokens,
            "prefix_s": round(self.seconds, 4),
            "wire_bytes": self.wire_bytes,
            "cache_id": self.cache_id,
            "skipped": list(self.skipped),
            "fetch_or_prefill": list(self.fetch_or_prefill),
        }


@dataclass
class Generation:
    """The tokens generated, where their prompt's cached prefix came from, and the timings."""

    tokens: list[int]
    prefix: CachedPrefix
    prompt_tokens: int
    # Time to the first token: prefill of the tokens the cache did not cover.
    prefill_s: float
    generate_s: float

    @property
    def estimated_saving_s(self) -> float | None:
        """Prefill time the cached tokens would have cost, minus getting them: by the prefill rate the
        fetch was weighed with when there is one, else at this run's prefill rate of the rest."""
        if not self.prefix.tokens:
            return None
        if self.prefix.expected_prefill_s is not None:
            return self.prefix.expected_prefill_s - self.prefix.seconds
        fed = self.prompt_tokens - self.prefix.tokens
        if fed < 8 or self.prefill_s <= 0:
            return None
        return self.prefix.tokens * self.prefill_s / fed - self.prefix.seconds


@dataclass
class Fetched:
    """A fetched cache, ready to generate from, and what getting it cost."""

    manifest: pb.CacheManifest
    cache: list[Layer]
    seconds: float
    wire_bytes: int
    # Whether it was also kept in the local store.
    kept: bool = False


def fetch_cache(
    client: PeerClient,
    cache_id: str,
    profile: ReceiverProfile,
    *,
    num_tokens: int = 0,
    store: CacheStore | None = None,
    keep: bool = True,
    progress: Progress | None = None,
    idle_timeout: float = TIMEOUTS.stream_idle,
    deadline: float | None = None,
) -> Fetched:
    """Fetch a cache (or a block-aligned prefix of a dense one, `num_tokens`) from the peer of
    `client`, decoded as it arrives into MLX caches; with a `store`, kept there in the same pass.

    With `keep=False`, it is kept only if the store can hold it (its budget, its free disk), else
    the fetch goes on without it. A peer that sends nothing for `idle_timeout` seconds, or a transfer
    longer than `deadline`, is abandoned (`PeerClient.fetch`).

    Raises CacheRejected when the manifest does not fit `profile` or the store (no chunk is sent
    then), PeerError when the peer fails or stalls, IntegrityError when what arrives is damaged. Each
    chunk is checked as it is decoded, before the store writes it, and the digest before the entry
    is complete, so a failure of any kind leaves nothing in the store.
    """
    start = time.perf_counter()
    fetch = client.fetch(
        cache_id, profile, num_tokens=num_tokens, progress=progress, idle_timeout=idle_timeout, deadline=deadline
    )
    with fetch:
        manifest = fetch.manifest
        bases = fetch_bases(client, fetch, artifact_store(store.root) if store is not None else None)
        if store is not None and (problem := store.cannot_hold(manifest)):
            if keep:
                fetch.refuse(Rejection(pb.REJECT_REASON_SIZE_LIMIT, f"the local store cannot keep it: {problem}"))
            store = None  # decode it all the same, without keeping it
        decoder = CacheDecoder(manifest, bases)
        decoded = decoder.feed_iter(fetch.chunks())
        if store is not None:
            manifest = store.add(manifest, decoded)
        else:
            for _ in decoded:
                pass
        cache = decoder.finish()
    return Fetched(manifest, cache, time.perf_counter() - start, fetch.wire_bytes, kept=store is not None)


def fetch_bases(client: PeerClient, fetch: Transfer, artifacts: ArtifactStore | None) -> dict[str, Basis]:
    """The transform bases a fetched manifest names: from `artifacts`, or else from the sender (and
    kept in `artifacts`), all before the cache is accepted. One that cannot be got, is larger than a
    basis of the cache's geometry can be, does not match its sha256, is not a sane basis or does not
    fit the manifest refuses the cache (REJECT_REASON_ARTIFACT): no chunk moves, nothing is kept."""
    bases = {}
    for a in fetch.manifest.artifacts:
        held = held_basis(fetch, a, artifacts)
        bases[a.sha256] = held if held is not None else fetched_basis(client, fetch, a, artifacts)
    return bases


def held_basis(fetch: Transfer, artifact: pb.Artifact, artifacts: ArtifactStore | None) -> Basis | None:
    """The basis from the local `artifacts`, checked against the manifest; None when it is not here
    (or its copy was damaged or poisoned, and removed: ArtifactStore.get)."""
    try:
        data = artifacts.get(artifact.sha256) if artifacts is not None else None
    except (IntegrityError, StoreError) as e:
        log.warning("%s", e)
        return None
    if data is None:
        return None
    try:
        basis = parse_basis(data, artifact.sha256)
    except BasisError as e:
        fetch.refuse(Rejection(pb.REJECT_REASON_ARTIFACT, f"the cache is coded with basis {artifact.sha256[:12]}: {e}"))
    return fits(fetch, basis)


def fetched_basis(client: PeerClient, fetch: Transfer, artifact: pb.Artifact, artifacts: ArtifactStore | None) -> Basis:
    """The basis from the sender: its announced size held to the cache's geometry before a byte is
    asked for, streamed to a temporary file (hashed as it comes), checked, then kept in `artifacts`."""
    what = f"the cache is coded with basis {artifact.sha256[:12]} ({artifact.nbytes:,} bytes)"
    if artifact.nbytes > (bound := basis_bytes_bound(fetch.manifest)):
        m = fetch.manifest
        geometry = f"{len(m.layers)} layers of {m.num_kv_heads}x{m.head_dim}"
        fetch.refuse(Rejection(pb.REJECT_REASON_ARTIFACT, f"{what}: a basis of {geometry} takes at most {bound:,}"))
    try:
        incoming = artifacts.receive() if artifacts is not None else Incoming()
    except StoreError as e:
        fetch.refuse(Rejection(pb.REJECT_REASON_ARTIFACT, f"{what}, which cannot be kept here: {e}"))
    with incoming:
        try:
            log.info("fetching basis %s (%d bytes) from %s", artifact.sha256[:12], artifact.nbytes, client.address)
            client.artifact(artifact.sha256, artifact.nbytes, incoming.write, deadline=TIMEOUTS.artifact)
            basis = parse_basis(incoming.read(artifact.sha256), artifact.sha256)
        except (PeerError, IntegrityError, BasisError, StoreError) as e:
            fetch.refuse(Rejection(pb.REJECT_REASON_ARTIFACT, f"{what}, which {client.address} could not give: {e}"))
        fits(fetch, basis)
        if artifacts is not None:  # kept only once it is known to be sane and to fit
            try:
                artifacts.keep(incoming, artifact.sha256)
            except (StoreError, IntegrityError) as e:
                fetch.refuse(Rejection(pb.REJECT_REASON_ARTIFACT, f"{what}, which cannot be kept here: {e}"))
    return basis


def fits(fetch: Transfer, basis: Basis) -> Basis:
    """`basis`, once it fits the manifest (its coded layers, and its geometry as a whole); else the
    cache is refused (REJECT_REASON_ARTIFACT)."""
    if rejection := basis_problem(fetch.manifest, basis):
        fetch.refuse(rejection)
    features = [k.features for k in basis.keys]
    if problem := geometry_problem(fetch.manifest, basis.digest, basis.covered(), features):
        fetch.refuse(Rejection(pb.REJECT_REASON_ARTIFACT, f"basis {basis.digest[:12]}: {problem}"))
    return basis


@dataclass(frozen=True)
class _Source:
    """A cache serving `tokens` of the prompt: the local store's entry `cache_id`, or a peer's
    candidate (`peer`: the client reaching it, and the candidate)."""

    tokens: int
    # Among caches of the same length: the least lossy (`loss_rank`), then the local store's, then the smaller.
    tie: tuple
    cache_id: str
    peer: tuple[PeerClient, Candidate] | None = None


def candidate_loss_rank(candidate: Candidate) -> float:
    """`loss_rank` of a peer's candidate (an older peer says only its press: not "full" is lossy)."""
    measured = candidate.quality.value if candidate.quality.metric == "tail_kl" else None
    return loss_rank(candidate.lossy or candidate.method != "full", measured)


def find_prefix(
    model_fp: ModelFingerprint,
    tokens: Sequence[int],
    store: CacheStore | None,
    *,
    peers: Sequence[str] = (),
    progress: Progress | None = None,
    credentials: MeshCredentials | None = None,
    idle_timeout: float = TIMEOUTS.stream_idle,
    min_tokens: int = 0,
    max_kl: float | None = None,
    rates: Rates | None = None,
    budget: float | None = None,
) -> CachedPrefix:
    """The longest cached prefix of `tokens[:-1]` found, its cache and where it came from.

    One token is always left to feed, since generation needs at least one. Sources are tried
    longest first; among those of one length, the least lossy first (`loss_rank`: a cache whose loss
    nobody measured after every measured one), then the local store's; one that fails (a damaged local entry, a peer
    that refuses, breaks or stalls for `idle_timeout` seconds) is skipped with its reason and the
    next is tried; when none delivers, the caller prefills everything. Sources serving no more than
    `min_tokens` (what the caller already holds) are not tried. Without a `store`, only peers are
    asked and nothing fetched is kept. `max_kl` is a quality floor for lossy caches
    (`ReceiverProfile.max_kl`), honoured for the local store's entries too.

    With `rates` (kvmesh.fetch_or_prefill), a peer's cache is fetched only when that is expected to
    be faster than prefilling the tokens it adds here; each fetch's rate is kept for next time.
    Without them, every peer's cache is fetched. Each peer is reached over one channel for the
    whole request: its lookup, probe and fetch.

    The mesh part (every lookup, probe and fetch) takes at most `budget` seconds in all (default:
    `default_budget`): a peer that stalls, trickles or answers with bogus candidates costs at most
    that, then the rest is prefilled.
    """
    if budget is None:
        budget = default_budget(rates, model_fp.model_id, len(tokens))
    wanted = list(tokens[:-1])
    start = time.perf_counter()
    skipped: list[str] = []
    choices: list[str] = []
    spent = f"the mesh's time budget of {budget:g} s is spent: prefilled instead"

    def left() -> float:
        """Seconds of the budget left."""
        return budget - (time.perf_counter() - start)

    def found(
        where: str, cache: list | None = None, n: int = 0, wire_bytes: int = 0, cache_id: str = ""
    ) -> CachedPrefix:
        model = rates.prefill_model(model_fp.model_id) if rates is not None and n else None
        return CachedPrefix(
            where,
            tokens=n,
            seconds=time.perf_counter() - start,
            wire_bytes=wire_bytes,
            cache_id=cache_id,
            skipped=skipped,
            fetch_or_prefill=choices,
            expected_prefill_s=model.seconds(n) if model is not None else None,
            cache=cache,
        )

    with ExitStack() as clients:
        sources: list[_Source] = []
        if store is not None and (local := store.lookup(model_fp.model_id, wanted)):
            rank = loss_rank(local.entry.lossy, local.entry.tail_kl)
            sources.append(_Source(local.tokens, (rank, 0), local.entry.cache_id))
        if store is not None and (missed := store.exact_only(model_fp.model_id, wanted, local.tokens if local else 0)):
            match, why = missed
            skipped.append(
                f"{LOCAL_STORE}: {match.entry.cache_id} shares {match.tokens:,} tokens of the prompt but serves only "
                f"its exact prefix of {match.entry.num_tokens:,} ({why})"
            )
        for address in peers:
            if left() <= 0:
                skipped.append(f"peer {address}: {spent}")
                continue
            timeout = min(TIMEOUTS.lookup, idle_timeout, left())
            client = clients.enter_context(PeerClient(address, timeout=timeout, credentials=credentials))
            try:
                for m in client.lookup(model_fp.model_id, wanted):
                    tie = (candidate_loss_rank(m.candidate), 1, m.candidate.stored_bytes)
                    sources.append(_Source(m.tokens, tie, m.candidate.cache_id, (client, m.candidate)))
            except PeerError as e:
                skipped.append(str(e))
        sources = sorted((s for s in sources if s.tokens > min_tokens), key=lambda s: (-s.tokens, s.tie))

        profile = ReceiverProfile(model_fp, prompt=list(tokens), max_kl=max_kl)
        for s in sources:
            try:
                if s.peer is None:
                    assert store is not None
                    cache = load_prefix(store, s.cache_id, s.tokens, max_kl=max_kl)
                    return found(LOCAL_STORE, cache, s.tokens, cache_id=s.cache_id)
                client, candidate = s.peer
                if left() <= 0:
                    skipped.append(f"{candidate.cache_id} at {client.address}: {spent}")
                    continue
                if rates is not None:
                    # What fetching saves: prefilling the tokens beyond what is held or found here.
                    held = max([min_tokens] + [o.tokens for o in sources if o.peer is None and o.tokens < s.tokens])
                    choice = fetch_or_prefill(
                        rates,
                        model_fp.model_id,
                        client,
                        candidate,
                        tokens=s.tokens - held,
                        held=held,
                        timeout=max(0.1, min(idle_timeout, left())),
                    )
                    choices.append(str(choice))
                    if not choice.fetch:
                        continue
                fetched = fetch_cache(
                    client,
                    candidate.cache_id,
                    profile,
                    num_tokens=s.tokens if s.tokens < candidate.num_tokens else 0,
                    store=store,
                    progress=progress,
                    idle_timeout=idle_timeout,
                    keep=False,
                    deadline=max(0.1, left()),
                )
                if rates is not None:
                    rates.record_transfer(client.address, fetched.wire_bytes, fetched.seconds)
                return found(
                    f"peer {client.address}", fetched.cache, s.tokens, fetched.wire_bytes, fetched.manifest.cache_id
                )
            except (PeerError, IntegrityError, CacheRejected, StoreError) as e:
                reason = str(e) if s.peer is not None else f"{LOCAL_STORE}: {e}"
                log.warning("%s", reason)
                skipped.append(reason)
    return found("none")


def fetch_or_prefill(
    rates: Rates,
    model_id: str,
    client: PeerClient,
    candidate: Candidate,
    *,
    tokens: int,
    held: int,
    timeout: float = TIMEOUTS.stream_idle,
) -> Choice:
    """Whether fetching the `tokens` that `candidate` at the peer of `client` adds to the `held`
    ones beats prefilling them here.

    The link rate is the one measured on earlier transfers from that peer, else a short probe's
    (within `timeout` seconds); without timed prefills of the model (`calibrate`), fetching is the
    choice.
    """
    address = client.address
    wire = candidate.stored_bytes * tokens // max(1, candidate.num_tokens)
    prefill = rates.prefill_model(model_id)
    if prefill is None:
        return Choice(True, 0.0, 0.0, f"{tokens:,} cached tokens at {address}: no prefill timed here: fetch")
    if (link_rate := rates.link_rate(address)) is None:
        link_rate = client.probe(probe_bytes(wire), timeout=timeout)
        rates.record_probe(address, link_rate)
    return choose(tokens, wire, link_rate, prefill, context=held, where=address, measured=rates.link_source(address))


def default_budget(rates: Rates | None, model_id: str, tokens: int) -> float:
    """The mesh part's time budget for a prompt of `tokens`: the prefill of them all, as this machine's
    timed prefills predict (at least MIN_MESH_BUDGET), or Timeouts.mesh_budget when none were timed."""
    model_rate = rates.prefill_model(model_id) if rates is not None else None
    if model_rate is None:
        return TIMEOUTS.mesh_budget
    return max(MIN_MESH_BUDGET, model_rate.seconds(tokens))


def calibrate(model: nn.Module, model_fp: ModelFingerprint, rates: Rates) -> None:
    """Time prefills of the model on this machine, unless some were timed before."""
    if rates.prefill_model(model_fp.model_id) is None:
        for tokens, seconds in time_prefills(model):
            rates.record_prefill(model_fp.model_id, tokens, seconds)


def load_prefix(store: CacheStore, cache_id: str, num_tokens: int, *, max_kl: float | None = None) -> list[Layer]:
    """The first `num_tokens` of a stored cache, decoded (a shorter prefix of one that evicted nothing,
    transform coded or not, is cut as read); CacheRejected when it is lossy beyond the quality floor
    `max_kl`."""
    manifest = store.manifest(cache_id)
    if rejection := quality_problem(manifest, max_kl):
        raise CacheRejected(rejection)
    if num_tokens == manifest.prefix.num_tokens:
        records = store.chunk_records(cache_id)
    else:
        manifest, records = cut_prefix(manifest, lambda: store.chunk_records(cache_id), num_tokens)
    return decode_chunks(manifest, map(parse_frame, records), bases=stored_bases(store.root, manifest))


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
    prefill_progress: Callable[[int, int], None] | None = None,
) -> Generation:
    """Generation after `tokens` (greedy, or with an mlx-lm `sampler`), reusing the longest cached
    prefix found on the mesh; it ends at `max_tokens` or at one of `stop_tokens` (the tokenizer's
    end-of-turn ids: `tokenizer.eos_token_ids`), which is not returned.

    With `rates`, a peer's cache is fetched only when that beats prefilling its tokens here (the
    model's prefill rate is measured first if it never was), and this prefill refreshes the rate.

    The mesh part takes at most `mesh_budget` seconds (default: `default_budget`): the mesh cannot save
    more than prefilling the whole prompt costs, so after that the prompt is prefilled.
    `progress` follows a fetch (bytes), `prefill_progress` the prefill of the rest (tokens)."""
    if rates is not None and peers:
        calibrate(model, model_fp, rates)
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
