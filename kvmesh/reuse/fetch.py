"""A peer's cache fetched: decoded here as it arrives and kept in the local store in the same pass
(`fetch_cache`), so the next request finds it here; the transform bases it names come first."""

import logging
import time
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass

from kvmesh.codec.arrays import Layer
from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.basis_file import basis_bytes_bound, geometry_problem
from kvmesh.codec.chunks import Chunk
from kvmesh.codec.coded import parse_basis, parsed_basis
from kvmesh.codec.compat import ReceiverProfile, basis_problem
from kvmesh.errors import IntegrityError, PeerError, Rejection, StoreError
from kvmesh.net.client import PeerClient, Transfer
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.progress import Progress
from kvmesh.reuse.receive import receive
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import ArtifactStore, Incoming, artifact_store
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A fetched cache, ready to generate from, and what getting it cost."""

    manifest: pb.CacheManifest
    cache: list[Layer]
    seconds: float
    wire_bytes: int
    # Whether it was also kept in the local store.
    kept: bool = False
    # Bytes of the bases it needed that were fetched first (0: all were here), the seconds from
    # asking for them to their being checked, parsed and kept, and from the request to its last byte.
    basis_bytes: int = 0
    basis_s: float = 0.0
    wire_s: float = 0.0
    # The chunks' bytes after the first one and the seconds from the first chunk to the last: the
    # link rate's measure, without the setup and the basis (kvmesh.reuse.weigh.record_fetch).
    stream_bytes: int = 0
    stream_s: float = 0.0


@dataclass
class Arrivals:
    """When the first and the latest chunk of a transfer came, and the bytes after the first."""

    first: float = 0.0
    last: float = 0.0
    after_first: int = 0


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
    code: spb.CodeRequest | None = None,
) -> Fetched:
    """Fetch a cache (or a block-aligned prefix of a dense one, `num_tokens`) from the peer of
    `client`, decoded as it arrives into MLX caches; with a `store`, kept there in the same pass.

    With `keep=False`, it is kept only if the store can hold it (its budget, its free disk), else
    the fetch goes on without it. A peer that sends nothing for `idle_timeout` seconds, or a transfer
    longer than `deadline`, is abandoned (`PeerClient.fetch`). With `code`, the peer is asked for a
    copy it codes on request at that level (kvmesh.net.on_request).

    Raises CacheRejected when the manifest does not fit `profile` or the store (no chunk is sent
    then), PeerError when the peer fails or stalls, IntegrityError when what arrives is damaged. Each
    chunk is checked as it is decoded, before the store writes it, and the digest before the entry
    is complete, so a failure of any kind leaves nothing in the store.
    """
    start = time.perf_counter()
    fetch = client.fetch(
        cache_id,
        profile,
        num_tokens=num_tokens,
        progress=progress,
        idle_timeout=idle_timeout,
        deadline=deadline,
        held_from=store,  # the first blocks this store holds already stay home: only the rest travel
        code=code,
    )
    with fetch:
        manifest = fetch.manifest
        artifacts = artifact_store(store.root) if store is not None else None
        missing = sum(a.nbytes for a in manifest.artifacts if artifacts is None or not artifacts.has(a.sha256))
        asked = time.perf_counter()
        bases = fetch_bases(client, fetch, artifacts)
        basis_s = time.perf_counter() - asked if missing else 0.0
        if store is not None and (problem := store.cannot_hold(manifest)):
            if keep:
                fetch.refuse(Rejection(pb.REJECT_REASON_SIZE_LIMIT, f"the local store cannot keep it: {problem}"))
            store = None  # decode it all the same, without keeping it
        fetch.accept()  # (the first chunk travels while the decoder and the store's entry are made)
        arrived = Arrivals(start, start)
        received = receive(manifest, timed(fetch.chunks(), arrived, fetch.held), bases, store)
    seconds = time.perf_counter() - start
    return Fetched(
        received.manifest,
        received.cache,
        seconds,
        fetch.wire_bytes,
        kept=received.kept,
        basis_bytes=missing,
        basis_s=basis_s,
        wire_s=arrived.last - start,
        stream_bytes=arrived.after_first,
        stream_s=arrived.last - arrived.first,
    )


def timed(chunks: Iterable[Chunk], arrived: Arrivals, held: Container[int] = ()) -> Iterator[Chunk]:
    """`chunks`, noting in `arrived` when each that travelled came (the `held` ones, this store's
    own, come at once: counted, they would flatter the link's rate)."""
    first = True
    for chunk in chunks:
        if chunk.index not in held:
            arrived.last = time.perf_counter()
            if first:
                arrived.first, first = arrived.last, False
            else:
                arrived.after_first += len(chunk.data)
        yield chunk


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
    """The basis from the local `artifacts` (parsed by this process already, or read and checked),
    checked against the manifest; None when it is not here (or its copy was damaged or poisoned, and
    removed: ArtifactStore.get)."""
    held = artifacts is None or artifacts.has(artifact.sha256)  # (kept where the cache will be)
    if held and (parsed := parsed_basis(artifact.sha256)) is not None:
        return fits(fetch, parsed)
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
