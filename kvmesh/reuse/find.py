"""The longest cached prefix of a prompt: the local store's, or a peer's fetched when that is
expected to beat prefilling it here (kvmesh.reuse.weigh), or none.

The local store is asked first, then every peer (by block hashes of the prompt; the prompt itself
never leaves). Among the copies peers hold of one prefix the one expected soonest is taken.
"""

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from kvmesh.codec.arrays import Layer
from kvmesh.codec.chunks import parse_frame
from kvmesh.codec.compat import ReceiverProfile, loss_rank, quality_problem
from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.manifest import LOSS_METRICS
from kvmesh.errors import CacheRejected, IntegrityError, PeerError, StoreError
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.client import PeerClient
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.progress import Progress
from kvmesh.reuse.choice import Weighed
from kvmesh.reuse.fetch import Fetched, fetch_cache
from kvmesh.reuse.rates import Rates
from kvmesh.reuse.records import CachedPrefix
from kvmesh.reuse.weigh import Offer, fetch_or_prefill, record_fetch, within_floor
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store, stored_bases
from kvmesh.v1.service_pb2 import Candidate, CodeRequest

log = logging.getLogger(__name__)
LOCAL_STORE = "local store"
# A copy to fetch: the peer's client, its candidate, and what to ask it to code (None: as held).
Ask = tuple[PeerClient, Candidate, CodeRequest | None]
# The least time the mesh part of a request is given, however fast a prefill here would be: a LAN
# lookup and the manifest's round trip take milliseconds, a loaded machine's more.
MIN_MESH_BUDGET = 2.0


@dataclass(frozen=True)
class _Source:
    """A cache serving `tokens` of the prompt: the local store's entry `cache_id`, or a peer's
    candidate (`peer`: the client reaching it, and the candidate)."""

    tokens: int
    # Among caches of the same length: the least lossy (`loss_rank`), then the local store's, then the smaller.
    tie: tuple
    cache_id: str
    peer: Offer | None = None


def candidate_loss_rank(candidate: Candidate) -> float:
    """`loss_rank` of a peer's candidate (an older peer says only its press: not "full" is lossy)."""
    measured = candidate.quality.value if candidate.quality.metric in LOSS_METRICS else None
    return loss_rank(candidate.lossy or candidate.method != "full", measured)


@dataclass(frozen=True)
class Budget:
    """The seconds the mesh part of a request may take, from `start` (time.perf_counter)."""

    seconds: float
    start: float

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    @property
    def spent(self) -> str:
        return f"the mesh's time budget of {self.seconds:g} s is spent: prefilled instead"


def local_sources(store: CacheStore | None, model_id: str, wanted: list[int], skipped: list[str]) -> list[_Source]:
    """The local store's longest entry serving `wanted`, and (in `skipped`) one that shares more of
    it but serves only its exact prefix."""
    if store is None:
        return []
    sources = []
    if local := store.lookup(model_id, wanted):
        sources.append(_Source(local.tokens, (loss_rank(local.entry.lossy, local.entry.loss), 0), local.entry.cache_id))
    if missed := store.exact_only(model_id, wanted, local.tokens if local else 0):
        match, why = missed
        skipped.append(
            f"{LOCAL_STORE}: {match.entry.cache_id} shares {match.tokens:,} tokens of the prompt but serves only "
            f"its exact prefix of {match.entry.num_tokens:,} ({why})"
        )
    return sources


def peer_sources(
    clients: ExitStack,
    peers: Sequence[str],
    model_id: str,
    wanted: list[int],
    *,
    credentials: MeshCredentials | None,
    idle_timeout: float,
    budget: Budget,
    skipped: list[str],
) -> list[_Source]:
    """Every peer's candidates for `wanted`, each peer reached over one channel (kept in `clients`)
    for the whole request; a peer that fails, or is reached after the budget, is `skipped`."""
    sources = []
    for address in peers:
        if budget.left() <= 0:
            skipped.append(f"peer {address}: {budget.spent}")
            continue
        timeout = min(TIMEOUTS.lookup, idle_timeout, budget.left())
        client = clients.enter_context(PeerClient(address, timeout=timeout, credentials=credentials))
        try:
            for m in client.lookup(model_id, wanted):
                tie = (candidate_loss_rank(m.candidate), 1, m.candidate.stored_bytes)
                sources.append(_Source(m.tokens, tie, m.candidate.cache_id, (client, m.candidate)))
        except PeerError as e:
            skipped.append(str(e))
    return sources


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

    With `rates` (kvmesh.reuse.rates), the copies peers hold of one prefix are weighed together
    (kvmesh.reuse.weigh): the one expected soonest, its decoding and a missing basis counted, is
    fetched only when that is expected to be faster than prefilling the tokens it adds here; each
    fetch's rate is kept for next time. Without them, every peer's cache is fetched, in the order
    above. Each peer is reached over one channel for the whole request: its lookup, probe and fetch.

    The mesh part (every lookup, probe and fetch) takes at most `budget` seconds in all (default:
    `default_budget`): a peer that stalls, trickles or answers with bogus candidates costs at most
    that, then the rest is prefilled.
    """
    start = time.perf_counter()
    mesh = Budget(default_budget(rates, model_fp.model_id, len(tokens)) if budget is None else budget, start)
    wanted = list(tokens[:-1])
    found = CachedPrefix("none")
    with ExitStack() as clients:
        sources = local_sources(store, model_fp.model_id, wanted, found.skipped)
        sources += peer_sources(
            clients, peers, model_fp.model_id, wanted,
            credentials=credentials, idle_timeout=idle_timeout, budget=mesh, skipped=found.skipped,
        )  # fmt: skip
        sources = sorted((s for s in sources if s.tokens > min_tokens), key=lambda s: (-s.tokens, s.tie))
        profile = ReceiverProfile(model_fp, prompt=list(tokens), max_kl=max_kl)
        tried: set[int] = set()
        for i, s in enumerate(sources):
            if i in tried:
                continue
            if s.peer is None:
                assert store is not None
                try:
                    found.cache = load_prefix(store, s.cache_id, s.tokens, max_kl=max_kl)
                except (IntegrityError, CacheRejected, StoreError) as e:
                    log.warning("%s: %s", LOCAL_STORE, e)
                    found.skipped.append(f"{LOCAL_STORE}: {e}")
                    continue
                found.where, found.tokens, found.cache_id = LOCAL_STORE, s.tokens, s.cache_id
                break
            # Every peer's copy of this length, weighed together.
            group = {j: o for j in range(i, len(sources)) if (o := sources[j].peer) and sources[j].tokens == s.tokens}
            tried.update(group)
            offers = copies_to_try(
                list(group.values()), found, model_fp, store,
                tokens=s.tokens, held=held_tokens(sources, s, min_tokens), max_kl=max_kl, rates=rates,
                idle_timeout=idle_timeout, budget=mesh,
            )  # fmt: skip
            if got := first_fetched(offers, found, profile, s.tokens, store, progress, idle_timeout, mesh):
                (client, candidate, code), fetched = got
                if rates is not None:
                    record_fetch(
                        rates, model_fp.model_id, client.address, candidate, fetched, on_request=code is not None
                    )
                found.where, found.tokens, found.cache = f"peer {client.address}", s.tokens, fetched.cache
                found.wire_bytes, found.cache_id = fetched.wire_bytes, fetched.manifest.cache_id
                break
    model = rates.prefill_model(model_fp.model_id) if rates is not None and found.tokens else None
    found.seconds = time.perf_counter() - start
    found.expected_prefill_s = model.seconds(found.tokens) if model is not None else None
    return found


def held_tokens(sources: list[_Source], s: _Source, min_tokens: int) -> int:
    """What fetching `s` saves is prefilling the tokens beyond these: held, or found here."""
    return max([min_tokens] + [o.tokens for o in sources if o.peer is None and o.tokens < s.tokens])


def copies_to_try(
    offers: list[Offer],
    found: CachedPrefix,
    model_fp: ModelFingerprint,
    store: CacheStore | None,
    *,
    tokens: int,
    held: int,
    max_kl: float | None,
    rates: Rates | None,
    idle_timeout: float,
    budget: Budget,
) -> list[Ask]:
    """The copies of one prefix worth fetching, in the order to try them: with `rates`, those within
    the quality floor expected to beat a prefill here, soonest first (the choice is noted in
    `found`), a copy a peer codes on request with what to ask it for; without, all of them as found.
    After the `budget`, none."""
    if budget.left() <= 0:
        found.skipped += [f"{candidate.cache_id} at {client.address}: {budget.spent}" for client, candidate in offers]
        return []
    if rates is None:
        return [(client, candidate, None) for client, candidate in offers]
    within = []
    for client, candidate in offers:
        if within_floor(candidate, max_kl):
            within.append((client, candidate))
        else:
            found.skipped.append(
                f"{candidate.cache_id} at {client.address}: lossy beyond this receiver's floor of {max_kl} nats/token"
            )
    if not within:
        return []
    bases = bases_held(store, model_fp.model_id, rates) if store is not None else set()
    try:
        decision = fetch_or_prefill(
            rates, model_fp, within,
            tokens=tokens - held, held=held, bases=bases, max_kl=max_kl,
            timeout=max(0.1, min(idle_timeout, budget.left())),
        )  # fmt: skip
    except PeerError as e:
        found.skipped.append(str(e))
        return []
    found.fetch_or_prefill.append(decision)
    if not decision.fetch:
        return []
    by_copy = {(c.address, k.cache_id): (c, k) for c, k in within}
    faster = [w for w in decision.weighed if decision.prefill_s is None or w.cost.seconds < decision.prefill_s]
    return [(*by_copy[(w.copy.where, w.copy.cache_id)], code_request(w, rates)) for w in faster]


def code_request(w: Weighed, rates: Rates) -> CodeRequest | None:
    """What to ask the peer of a copy it codes on request (None: a copy it holds), with the rate its
    full copies stream at here, for the peer to refuse coding that would not pay."""
    if not w.copy.level:
        return None
    return CodeRequest(level=w.copy.level, link_bytes_per_s=rates.stream_rate(w.copy.where, "full") or 0.0)


def bases_held(store: CacheStore, model_id: str, rates: Rates) -> set[str]:
    """The ids of the model's bases the local store holds: its own (`kvmesh model calibrate`), and
    those fetched caches of it were coded with. A peer's coded copy is then expected to need no basis."""
    artifacts = artifact_store(store.root)
    try:
        own = artifacts.model_basis(model_id)
        return {d for d in [own, *rates.bases.get(model_id, [])] if d is not None and artifacts.has(d)}
    except StoreError:
        return set()


def first_fetched(
    offers: list[Ask],
    found: CachedPrefix,
    profile: ReceiverProfile,
    tokens: int,
    store: CacheStore | None,
    progress: Progress | None,
    idle_timeout: float,
    budget: Budget,
) -> tuple[Ask, Fetched] | None:
    """The first of `offers` fetched (a block-aligned prefix of `tokens` of it; coded on request when
    it says so), with the offer; one that fails (a peer that refuses to code it among them) is skipped
    with its reason, and None when none delivers."""
    for ask in offers:
        client, candidate, code = ask
        if budget.left() <= 0:
            found.skipped.append(f"{candidate.cache_id} at {client.address}: {budget.spent}")
            continue
        try:
            fetched = fetch_cache(
                client,
                candidate.cache_id,
                profile,
                num_tokens=tokens if tokens < candidate.num_tokens else 0,
                store=store,
                progress=progress,
                idle_timeout=idle_timeout,
                keep=False,
                deadline=max(0.1, budget.left()),
                code=code,
            )
        except (PeerError, IntegrityError, CacheRejected, StoreError) as e:
            log.warning("%s", e)
            found.skipped.append(str(e))
            continue
        return ask, fetched
    return None


def default_budget(rates: Rates | None, model_id: str, tokens: int) -> float:
    """The mesh part's time budget for a prompt of `tokens`: the prefill of them all, as this machine's
    timed prefills predict (at least MIN_MESH_BUDGET), or Timeouts.mesh_budget when none were timed."""
    model_rate = rates.prefill_model(model_id) if rates is not None else None
    if model_rate is None:
        return TIMEOUTS.mesh_budget
    return max(MIN_MESH_BUDGET, model_rate.seconds(tokens))


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
        if rejection := quality_problem(manifest, max_kl):  # a cut may claim less than the whole
            raise CacheRejected(rejection)
    return decode_chunks(manifest, map(parse_frame, records), bases=stored_bases(store.root, manifest))
