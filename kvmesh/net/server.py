"""The gRPC service a daemon serves from its store: Info, Lookup, Fetch, Publish, Probe and Artifact.

Fetch is manifest-first: the sender answers an open with the manifest alone and sends no chunk
until the receiver accepts. Chunks are read from the store file as the frames they travel as, so
serving never parses or recompresses them; a shorter prefix of a dense cache is cut on the fly
(`kvmesh.codec.cut`), re-encoding one chunk per tensor and storing nothing. The service needs no
MLX, unless a receiver asks for a cache coded on request (kvmesh.net.on_request). A bounded number
of transfers run at once; others wait for a slot. Every call is held to the daemon's policy (what
it shares, who may publish) and each mesh member to its own rate, transfer count and stream idle
limits.
"""

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.codec.chunks import FRAME_HEADER, Chunk, FrameReader, batch_frames, parse_frame
from kvmesh.codec.compat import check_manifest, validate_manifest
from kvmesh.codec.cut import can_cut, cut_prefix
from kvmesh.codec.prefix import BLOCK_SIZE, may_serve, shared_tokens
from kvmesh.errors import IntegrityError, NotFoundError, Rejection, StoreError
from kvmesh.net.flow import IdleWatch, read_within
from kvmesh.net.guard import Guard, caller
from kvmesh.net.guard import limits as guard_limits
from kvmesh.net.held import leave_out
from kvmesh.net.listening import bind, connections_allowed
from kvmesh.net.messages import accept, check_trailer, older_protocol, profile_from_proto, reject, trailer
from kvmesh.net.node_id import host_name
from kvmesh.net.on_request import OnRequestCoding
from kvmesh.net.policy import PeerLimits, Policy
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transfers import TransferCounters
from kvmesh.net.transport import SERVICE_NAME, as_bytes, serialize, server_options
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import ARTIFACT_PIECE_BYTES, artifact_store
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc
from kvmesh.versions import PROTOCOL_VERSION, __version__

log = logging.getLogger(__name__)
# A lookup names at most this many blocks: prompts of 8M tokens.
MAX_LOOKUP_BLOCKS = 65536
# A probe sends at most this much, in messages of PROBE_MESSAGE_BYTES.
MAX_PROBE_BYTES = 8 << 20
PROBE_MESSAGE_BYTES = 1 << 20
# Artefacts (in pieces of ARTIFACT_PIECE_BYTES) go to at most this many receivers at once.
ARTIFACT_SENDS = 4
M = TypeVar("M", bound=Message)
T = TypeVar("T")
# Worker threads no transfer may take: health checks, Info and Lookup always find one.
RESERVED_WORKERS = 4


LOCAL = "local"


def peer_identity(context: grpc.ServicerContext) -> str:
    """The node id in the peer's mesh certificate, or LOCAL for a plaintext (loopback-only) caller."""
    names = cast(list[bytes], context.auth_context().get("x509_common_name", []))
    return names[0].decode() if names else LOCAL


def next_within(requests: Iterator, seconds: float, context: grpc.ServicerContext, what: str):
    """The peer's next message, or the stream is cut: a peer that stalls must not hold a slot."""
    try:
        return read_within(requests, seconds)
    except TimeoutError:
        log.warning("%s sent no %s within %.0f s: stream cut", caller(context), what, seconds)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no {what} within {seconds:.0f} s")


class ReadAhead(Iterator[T]):
    """`items`, the first of them taken at once: a sender reads a fetch's first message while the
    receiver decides (nothing of it moves before an accept), and sends it the moment it accepts.
    A failure taking it is raised when it is asked for, where it would have been."""

    def __init__(self, items: Iterator[T]):
        self._items = items
        self._first: list[T] = []
        self._failure: Exception | None = None
        try:
            self._first.append(next(items))
        except StopIteration:
            pass
        except Exception as e:
            self._failure = e

    def __next__(self) -> T:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return self._first.pop() if self._first else next(self._items)


# A receiver that accepted a fetch and stopped reading (its TCP stack still answering keepalive
# pings) would hold a transfer slot for good: cut once it takes nothing for the idle timeout.
NOT_READING = "took nothing for {idle:.0f} s (it stopped reading): transfer cut"


class KvMeshService(service_pb2_grpc.KvMeshServicer):
    def __init__(
        self,
        store: CacheStore,
        node_id: str,
        *,
        max_transfers: int = 4,
        policy: Policy | None = None,
        max_waiting: int | None = None,
        coding_times: Path | None = None,
    ):
        """`coding_times`: where this machine's codings on request are timed across restarts
        (kvmesh.net.on_request; None: in memory only)."""
        self.store = store
        self.artifacts = artifact_store(store.root)
        self._artifact_sends = threading.BoundedSemaphore(ARTIFACT_SENDS)
        self.node_id = node_id
        self.policy = policy or Policy()
        self.limits = PeerLimits(self.policy)
        self.counters = TransferCounters(max_transfers, max_transfers if max_waiting is None else max_waiting)
        self.coding = OnRequestCoding(store, node_id, enabled=self.policy.code_on_request, timings=coding_times)
        self._probe_message = probe_data(PROBE_MESSAGE_BYTES)

    def _admit(self, context: grpc.ServicerContext) -> str:
        """The caller's identity, once it is within its call rate.

        Per-peer limits hold mesh members to account; local callers are this machine's own user.
        """
        peer = peer_identity(context)
        if peer != LOCAL and not self.limits.allow_call(peer):
            log.warning("%s over its rate of %.0f calls/s: refused", peer, self.policy.peer_calls_per_second)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls: slow down")
        return peer

    @contextmanager
    def _peer_slot(self, peer: str, context: grpc.ServicerContext):
        """One of this peer's `peer_transfers`; taken before the call's first message is read, so a
        peer's calls that never send one hold no more threads than its transfers may."""
        if peer == LOCAL:
            yield
            return
        if not self.limits.start_transfer(peer):
            log.warning("%s already runs %d transfers: refused", peer, self.policy.peer_transfers)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {self.policy.peer_transfers} transfers per peer"
            )
        try:
            yield
        finally:
            self.limits.end_transfer(peer)

    @contextmanager
    def _transfer(self, peer: str, context: grpc.ServicerContext):
        """One of this peer's transfers, in one of the daemon's transfer slots."""
        with self._peer_slot(peer, context), self.counters.slot(context):
            yield

    def _first(self, requests: Iterator, context: grpc.ServicerContext, what: str):
        """A call's first message (a fetch's open, a publish's manifest): it goes with the call, so
        one that takes longer than Timeouts.open_message is cut."""
        return next_within(requests, min(TIMEOUTS.open_message, self.policy.idle_timeout), context, what)

    def Info(self, request, context):
        self._admit(context)
        every = self.store.entries()
        entries = [e for e in every if self.policy.shares(e.model_id)]
        # The disk the store takes (its shared blocks once), unless some of it is not shared: then
        # what the shared entries would take whole, which tells nothing of the others.
        held = self.store.total_bytes() if len(entries) == len(every) else sum(e.file_bytes for e in entries)
        return spb.InfoResponse(
            node_id=self.node_id,
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            model_ids=sorted({e.model_id for e in entries}),
            store=spb.StoreStats(
                entries=len(entries),
                bytes=held,
                budget_bytes=self.store.max_bytes or 0,
            ),
            transfers=self.counters.snapshot(),
            host_name=host_name(),
        )

    def Lookup(self, request, context):
        self._admit(context)
        if request.block_size != BLOCK_SIZE or len(request.block_hashes) > MAX_LOOKUP_BLOCKS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lookups use blocks of {BLOCK_SIZE} tokens, at most {MAX_LOOKUP_BLOCKS} of them",
            )
        response = spb.LookupResponse()
        if not self.policy.shares(request.model_id):
            return response
        matched = self.store.blocks_matched(request.model_id, list(request.block_hashes))
        for e in self.store.entries(request.model_id):
            blocks = matched.get(e.cache_id, 0)
            # The requester, who holds the prompt, tells how much of it each candidate serves.
            if not may_serve(e.num_tokens, e.cuttable, blocks):
                continue
            response.candidates.add(
                cache_id=e.cache_id,
                num_tokens=e.num_tokens,
                prefix_sha256=e.prefix_sha256,
                matched_tokens=shared_tokens(blocks, e.num_tokens),
                cuttable=e.cuttable,
                method=e.method,
                raw_bytes=e.raw_bytes,
                stored_bytes=e.file_bytes,
                lossy=e.lossy,
                quality=pb.Quality(metric=e.loss_metric, value=e.loss) if e.loss is not None else None,
                on_request=self.coding.offer(e),
                predicted=e.predicted,
            )
        return response

    def Fetch(self, requests: Iterator[spb.FetchRequest], context) -> Iterator[spb.FetchResponse | bytes]:
        """Manifest first; after an accept, the chunk frames as raw messages (batched when the receiver
        asks: kvmesh.codec.chunks.batch_frames), then the trailer."""
        peer = self._admit(context)
        with self._peer_slot(peer, context):
            with self.counters.arriving(context):
                first = self._first(requests, context, "open")
            if first is None or first.WhichOneof("msg") != "open":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a fetch starts with an open message")
            self.counters.add("fetches_started")
            with self.counters.slot(context):
                yield from self._serve_fetch(first.open, requests, peer, context)

    def _serve_fetch(
        self, opened: spb.FetchOpen, requests: Iterator[spb.FetchRequest], peer: str, context: grpc.ServicerContext
    ) -> Iterator[spb.FetchResponse | bytes]:
        """An opened fetch, in its transfer slot: the manifest (or a refusal), the receiver's decision,
        then the chunks, each taken by the receiver within the idle timeout (IdleWatch)."""
        found = self._open_cache(opened, context)
        profile = profile_from_proto(opened.profile) if opened.HasField("profile") else None
        rejection = older_protocol(opened.protocol_version, "the requester")
        if rejection is None and isinstance(found, Rejection):
            rejection = found
        elif rejection is None and not isinstance(found, Rejection):
            manifest, records = found
            # (one of its store's, or cut or coded from one here: validated when read or made)
            rejection = check_manifest(manifest, profile, validated=True) if profile else None
        if rejection:
            self.counters.add("fetches_rejected")
            log.info("refused %s to %s: %s", opened.cache_id, peer, rejection)
            yield spb.FetchResponse(refused=reject(rejection))
            return
        yield spb.FetchResponse(manifest=manifest, protocol_version=PROTOCOL_VERSION)
        # Stored as they travel: read, then sent, several small ones a message to a receiver that reads them so.
        messages = ReadAhead(batch_frames(records) if opened.frame_batches else ((f, [len(f)]) for f in records))
        reply = next_within(requests, self.policy.idle_timeout, context, "decision")
        if reply is None or reply.WhichOneof("msg") != "decision":
            self.counters.add("fetches_failed")
            return
        if not reply.decision.accept:
            self.counters.add("fetches_rejected")
            log.info("%s rejected %s: %s", peer, manifest.cache_id, reply.decision.message)
            return
        watch = IdleWatch(context.cancel, self.policy.idle_timeout, silent=NOT_READING)
        try:
            for message, lengths in messages:
                watch.waiting()
                yield message
                watch.alive()
                self.counters.add("chunk_bytes_sent", sum(lengths) - len(lengths) * FRAME_HEADER.size)
        except (IntegrityError, StoreError) as e:
            self.counters.add("fetches_failed")
            log.error("cannot serve %s: %s", manifest.cache_id, e)
            context.abort(grpc.StatusCode.DATA_LOSS, f"this peer's copy is damaged: {e}")
        except GeneratorExit:
            self.counters.add("fetches_failed")
            if watch.why:
                log.warning("%s %s", caller(context), watch.why)
            log.info("fetch of %s by %s %s", manifest.cache_id, peer, "cut" if watch.why else "cancelled")
            raise
        finally:
            watch.stop()
        # Counted before the trailer goes: the receiver may ask for Info as soon as it has it.
        self.counters.add("fetches_completed")
        yield spb.FetchResponse(trailer=trailer(manifest))

    def Probe(self, request: spb.ProbeRequest, context) -> Iterator[bytes]:
        """`request.bytes` zero bytes (at most MAX_PROBE_BYTES), in 1 MiB messages: a link measurement."""
        self._admit(context)
        left = min(request.bytes, MAX_PROBE_BYTES)
        while left > 0:
            size = min(left, PROBE_MESSAGE_BYTES)
            yield self._probe_message if size == PROBE_MESSAGE_BYTES else probe_data(size)
            left -= size

    def Artifact(self, request: spb.ArtifactRequest, context) -> Iterator[bytes]:
        """A held artefact (a transform basis) in pieces of ARTIFACT_PIECE_BYTES; NOT_FOUND when this
        peer does not hold it (or its copy turned out damaged, and was removed)."""
        self._admit(context)
        # Not a transfer slot: the receiver asks while its Fetch holds one (a peer may hold only a
        # couple); a few artefacts at once, the rest refused to try later (it then prefills).
        if not self._artifact_sends.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "sending other artefacts: try again shortly")
        try:
            try:
                data = self.artifacts.get(request.sha256)
            except (IntegrityError, StoreError) as e:
                log.error("cannot serve artefact %s: %s", request.sha256[:12], e)
                data = None
            if data is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"this peer holds no artefact {request.sha256[:16]!r}")
                return
            log.info("sending artefact %s (%d bytes) to %s", request.sha256[:12], len(data), peer_identity(context))
            for at in range(0, len(data), ARTIFACT_PIECE_BYTES):
                yield spb.ArtifactData(data=data[at : at + ARTIFACT_PIECE_BYTES]).SerializeToString()
        finally:
            self._artifact_sends.release()

    def _open_cache(
        self, opened: spb.FetchOpen, context: grpc.ServicerContext
    ) -> tuple[pb.CacheManifest, Iterator[bytes]] | Rejection:
        """The manifest of what was asked for (the cache, a prefix cut from it, or a coded copy of
        either made on request: kvmesh.net.on_request) and its chunk records, or why it cannot be
        served. A receiver that holds the first `held_tokens` of a blockwise cache is sent the
        other chunks only (`kvmesh.net.held.leave_out`).

        Reading the records starts only when the receiver has accepted.
        """
        try:
            cache_id = self.store.resolve(opened.cache_id, self.policy.shares)  # a unique start will do
            manifest = self.store.manifest(cache_id)
            if not self.policy.shares(manifest.model.model_id):
                raise NotFoundError(f"no cache {cache_id} in the store")  # unshared looks absent
            whole = not opened.num_tokens or opened.num_tokens == manifest.prefix.num_tokens
            if not whole and (why := can_cut(manifest, opened.num_tokens)):
                return Rejection(
                    pb.REJECT_REASON_PREFIX, f"cache {cache_id} cannot serve a {opened.num_tokens}-token prefix: {why}"
                )
            if opened.HasField("code"):  # a coded copy of it, kept here and served whole
                coded = self.coding.coded(cache_id, manifest, opened.code, 0 if whole else opened.num_tokens)
                if isinstance(coded, Rejection):
                    return coded
                return self.store.manifest(coded), self.store.chunk_records(coded)
            if whole:
                return leave_out(manifest, lambda: self.store.chunk_records(cache_id), opened.held_tokens)
            cut, records = cut_prefix(manifest, lambda: self.store.chunk_records(cache_id), opened.num_tokens)
            if not opened.held_tokens:
                return cut, records
            return leave_out(
                cut,
                lambda: cut_prefix(manifest, lambda: self.store.chunk_records(cache_id), opened.num_tokens)[1],
                opened.held_tokens,
            )
        except NotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (StoreError, IntegrityError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        raise AssertionError("context.abort raises")

    def holds(self, manifest: pb.CacheManifest) -> bool:
        """Whether the store holds the cache of that id, of a model it shares (the others look absent)."""
        if not self.policy.shares(manifest.model.model_id):
            return False
        try:
            self.store.entry(manifest.cache_id)
        except NotFoundError:
            return False
        return True

    def Publish(self, requests: Iterator[bytes], context) -> Iterator[spb.PublishResponse]:
        """A manifest, this peer's decision, then (after an accept) raw chunk frames (batched:
        kvmesh.codec.chunks.batch_frames; a publisher before them sends one a message) and a trailer."""
        peer = self._admit(context)
        with self.counters.arriving(context):
            message = self._first(requests, context, "manifest")
        first = parse_message(spb.PublishRequest, message, context)
        if first.WhichOneof("msg") != "manifest":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a publish starts with a manifest")
        manifest = first.manifest
        refusal = None
        if version_problem := older_protocol(first.protocol_version, "the publisher"):
            refusal = reject(version_problem)
        elif not self.policy.may_publish(peer):
            refusal = reject(Rejection(pb.REJECT_REASON_POLICY, f"this peer does not accept publishes from {peer}"))
        elif rejection := validate_manifest(manifest):
            refusal = reject(rejection)
        elif self.holds(manifest):  # a cache's id names its content: nothing to send (publishing twice)
            log.info("%s published %s, held here already: nothing sent", peer, manifest.cache_id)
            yield spb.PublishResponse(result=spb.PublishResult(cache_id=manifest.cache_id))
            return
        elif (size := manifest.encoding.raw_bytes) > (limit := self.policy.max_publish_bytes):
            message = f"{size:,} bytes exceed the publish limit of {limit:,}"
            refusal = reject(Rejection(pb.REJECT_REASON_SIZE_LIMIT, message))
        elif problem := self.store.cannot_hold(manifest):
            refusal = reject(Rejection(pb.REJECT_REASON_SIZE_LIMIT, problem))
        elif missing := [a for a in manifest.artifacts if not self.artifacts.has(a.sha256)]:
            message = (
                f"this peer lacks the basis {missing[0].sha256[:12]} the cache is coded with: it gets one when "
                "it fetches a cache that needs it, or publish one coded with a basis it holds"
            )
            refusal = reject(Rejection(pb.REJECT_REASON_ARTIFACT, message))
        if refusal is not None:
            self.counters.add("publishes_rejected")
            log.info("refused a publish from %s: %s", peer, refusal.message)
            yield spb.PublishResponse(decision=refusal, protocol_version=PROTOCOL_VERSION)
            return
        with self._transfer(peer, context):
            yield spb.PublishResponse(decision=accept(), protocol_version=PROTOCOL_VERSION, frame_batches=True)

            def incoming(what: str) -> bytes:
                message = next_within(requests, self.policy.idle_timeout, context, what)
                if message is None:
                    raise IntegrityError("the publisher went away before the trailer")
                return message

            def chunks() -> Iterator[Chunk]:
                frames = FrameReader(incoming)
                for i in range(manifest.encoding.chunk_count):
                    yield parse_frame(frames.next(f"chunk {i}"), f"chunk {i}")
                frames.check_done(manifest.encoding.chunk_count)
                try:
                    last = spb.PublishRequest.FromString(incoming("trailer"))
                except DecodeError:
                    raise IntegrityError("more chunks than the manifest announced, or no trailer") from None
                check_trailer(last, manifest)

            try:
                stored = self.store.receive(manifest, chunks())
            except (IntegrityError, StoreError) as e:
                self.counters.add("publishes_rejected")
                log.warning("publish from %s refused, nothing stored: %s", peer, e)
                code = (
                    grpc.StatusCode.DATA_LOSS if isinstance(e, IntegrityError) else grpc.StatusCode.RESOURCE_EXHAUSTED
                )
                context.abort(code, f"publish refused, nothing stored: {e}")
            self.counters.add("publishes_accepted")
            log.info("%s published %s", peer, stored.cache_id)
            yield spb.PublishResponse(result=spb.PublishResult(cache_id=stored.cache_id))


def parse_message(cls: type[M], data: bytes | None, context: grpc.ServicerContext) -> M:
    """A protobuf message of a stream whose messages arrive as bytes; a bad one ends the call."""
    if data is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected a {cls.__name__}, the stream ended")
    try:
        return cls.FromString(data)
    except DecodeError:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected a {cls.__name__}: not one")
    raise AssertionError("context.abort raises")


def probe_data(size: int) -> bytes:
    """A serialized ProbeData of `size` zero bytes."""
    return spb.ProbeData(data=bytes(size)).SerializeToString()


def add_service(service: KvMeshService, server: grpc.Server) -> None:
    """Like the generated add_KvMeshServicer_to_server, but chunk frames and probe data pass as bytes."""
    handlers = {
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, spb.InfoRequest.FromString, spb.InfoResponse.SerializeToString
        ),
        "Lookup": grpc.unary_unary_rpc_method_handler(
            service.Lookup, spb.LookupRequest.FromString, spb.LookupResponse.SerializeToString
        ),
        "Fetch": grpc.stream_stream_rpc_method_handler(service.Fetch, spb.FetchRequest.FromString, serialize),
        "Publish": grpc.stream_stream_rpc_method_handler(
            service.Publish, as_bytes, spb.PublishResponse.SerializeToString
        ),
        "Probe": grpc.unary_stream_rpc_method_handler(service.Probe, spb.ProbeRequest.FromString, serialize),
        "Artifact": grpc.unary_stream_rpc_method_handler(service.Artifact, spb.ArtifactRequest.FromString, serialize),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]  # newer than grpc-stubs


@dataclass
class RunningServer:
    server: grpc.Server
    service: KvMeshService
    port: int
    health: health.HealthServicer
    guard: Guard | None = None

    def stop(self, grace: float | None = TIMEOUTS.shutdown_grace) -> None:
        """Stop serving; calls in flight get `grace` seconds to finish (through the guard, stopped last)."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.guard is not None:
            self.guard.stop()


def start_server(
    store: CacheStore,
    node_id: str,
    addresses: str | list[str] = "127.0.0.1:0",
    *,
    max_transfers: int = 4,
    policy: Policy | None = None,
    credentials: grpc.ServerCredentials | Callable[[], grpc.ServerCredentials] | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    services: Sequence[Callable[[grpc.Server], None]] = (),
    guarded: bool = False,
    coding_times: Path | None = None,
) -> RunningServer:
    """Serve the kvmesh service, standard health checking and reflection.

    Every address gets the same port: the first one's, when its port is 0 (any free port).
    `credentials` may be a function that makes them, called once per address: gRPC cannot serve two
    addresses with one set of certificate-reloading credentials. `interceptors` run before every
    call (membership: kvmesh.net.admission); `services` add more services to the server (the
    Membership service). `guarded`: the addresses are served by a Guard that holds each peer address
    to `policy.connections_per_address` connections (kvmesh.net.guard), gRPC on a loopback port
    behind it: the daemon on a mesh, whose port a stranger reaches. `coding_times`: the file that
    keeps the codings on request timed here (the daemon's data directory: kvmesh.paths).
    """
    policy = policy or Policy()
    listen = [addresses] if isinstance(addresses, str) else addresses
    per_address, total = guard_limits(connections_allowed(1), policy.connections_per_address)
    options = server_options(
        connection_idle=policy.connection_idle,
        max_connections=policy.max_connections or (total if guarded else connections_allowed(len(listen))),
    )
    # Calls beyond twice the worker threads are refused by gRPC itself, never queued without bound.
    workers = 4 * max_transfers + RESERVED_WORKERS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        options=options,
        maximum_concurrent_rpcs=2 * workers,
        interceptors=list(interceptors),
    )
    # Transfers, running or waiting, leave RESERVED_WORKERS threads to health checks, Info and Lookup.
    service = KvMeshService(
        store,
        node_id,
        max_transfers=max_transfers,
        policy=policy,
        max_waiting=workers - max_transfers - RESERVED_WORKERS,
        coding_times=coding_times,
    )
    add_service(service, server)
    for add in services:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    guard = None
    if guarded:
        inner = bind(server, ["127.0.0.1:0"], credentials)
        guard = Guard(("127.0.0.1", inner), per_address=per_address, total=policy.max_connections or total)
        try:
            port = guard.listen(listen)
        except BaseException:
            guard.stop()
            raise
    else:
        port = bind(server, listen, credentials)
    server.start()
    return RunningServer(server, service, port, health_servicer, guard)
