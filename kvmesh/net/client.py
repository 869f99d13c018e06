"""The Python client of a kvmesh peer: info, lookup, fetch, publish and probe.

`fetch` is manifest first: it checks the manifest against the local model and prompt, and only
once the caller accepts do chunks move, handed over as they arrive, parsed from their frames, the
trailer checked after the last. The client keeps nothing: whoever decodes the chunks (and checks
each one as it does) stores them, `kvmesh.reuse.fetch.fetch_cache`. So the network needs no MLX.
"""

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from kvmesh.codec.chunks import BATCH_BYTES, FRAME_HEADER, Chunk, FrameReader, batch_frames, parse_frame
from kvmesh.codec.compat import ReceiverProfile, check_manifest
from kvmesh.codec.prefix import BLOCK_SIZE, block_hashes, tokens_served
from kvmesh.errors import CacheRejected, IntegrityError, KvmeshError, PeerError, Rejection
from kvmesh.net.addresses import peer_address
from kvmesh.net.flow import IdleWatch
from kvmesh.net.held import held_tokens, own_chunks
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.net.messages import (
    accept,
    check_trailer,
    older_protocol,
    profile_to_proto,
    reject,
    rejection_of,
    trailer,
)
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import as_bytes, method, open_channel, serialize
from kvmesh.progress import Progress
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import ARTIFACT_PIECE_BYTES
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc
from kvmesh.versions import PROTOCOL_VERSION

# progress(bytes received so far, bytes expected); raise to cancel the transfer.
log = logging.getLogger(__name__)
# A lookup answer's candidates tried at most: the longest few serve a prompt as well as any, and a
# peer answering with hundreds must not make a request try them all.
MAX_CANDIDATES = 4


def candidate_problem(c: spb.Candidate, prompt_tokens: int) -> str | None:
    """Why a peer's lookup candidate cannot be true for a prompt of `prompt_tokens` (whose block
    hashes it was asked about), or None."""
    if c.matched_tokens > prompt_tokens:
        return f"{c.matched_tokens:,} matched tokens of a {prompt_tokens:,}-token prompt"
    if c.matched_tokens > c.num_tokens:
        return f"{c.matched_tokens:,} matched tokens of a {c.num_tokens:,}-token cache"
    if c.matched_tokens % BLOCK_SIZE and c.matched_tokens != c.num_tokens:
        return f"{c.matched_tokens:,} matched tokens are not whole blocks of {BLOCK_SIZE}"
    return None


@dataclass(frozen=True)
class Match:
    """A peer's cache that serves `tokens` of the requester's prompt."""

    candidate: spb.Candidate
    tokens: int


def rate_window(chunk_size: int, min_rate: float = TIMEOUTS.min_receive_rate) -> float:
    """Seconds over which a transfer's rate is judged: Timeouts.rate_window, or long enough for two of
    its largest messages at `min_rate` (a whole chunk arrives at once)."""
    return max(TIMEOUTS.rate_window, 2 * chunk_size / min_rate)


class Outbox:
    """A fetch's request stream: the messages put here, as gRPC's thread takes them (`requests`),
    None ending it."""

    # How long `hand_over` waits at most: a live call's thread takes a message within a millisecond;
    # one whose call ended never does, and the transfer's next read says why.
    HAND_OVER_S = 0.1

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[spb.FetchRequest | None] = queue.SimpleQueue()
        self._taken = threading.Event()

    def put(self, message: spb.FetchRequest | None) -> None:
        self._queue.put(message)

    def hand_over(self, message: spb.FetchRequest) -> None:
        """Put `message` and wait until gRPC's thread has it: the accept, after which the receiver
        readies what takes the chunks. Busy at once, that work held the GIL the thread needed to
        send it: the accept reached the sender 0.8 ms later, a tenth of a 1 Gbit/s fetch's set-up."""
        self._taken.clear()
        self._queue.put(message)
        self._taken.wait(self.HAND_OVER_S)

    def requests(self) -> Iterator[spb.FetchRequest]:
        while (message := self._queue.get()) is not None:
            self._taken.set()  # (its serializing and sending go before the waiting thread's work)
            yield message


class Transfer:
    """A fetch whose manifest arrived and fits the receiver's profile; no chunk byte has moved yet.

    `accept()` accepts it (the chunks start to move), `chunks()` accepts it if nobody did and brings
    its chunks; `refuse()` declines it (before an accept). A context manager: leaving the block ends
    the call, so a transfer given up halfway (an error, a cancel) stops the sender.
    """

    def __init__(
        self,
        client: "PeerClient",
        call: "grpc.CallIterator[bytes]",
        outbox: Outbox,
        *,
        idle_timeout: float,
        deadline: float | None,
        progress: Progress | None,
    ):
        self.address = client.address
        self.manifest = pb.CacheManifest()
        # Chunk bytes received so far (frame headers not counted).
        self.wire_bytes = 0
        # The chunks the receiver holds, which do not travel (CacheManifest.held), by index.
        self.held: dict[int, Chunk] = {}
        self._client, self._call, self._outbox = client, call, outbox
        self._accepted = self._declined = False
        self._stream = iter(call)
        self._progress = progress
        # A deadline given runs from the open; else each part gets its own (transfer_deadline).
        self._ends = None if deadline is None else time.monotonic() + deadline
        self._watchdog = IdleWatch(call.cancel, idle_timeout, deadline=deadline or TIMEOUTS.transfer_grace)

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._watchdog.stop()
        self._outbox.put(None)
        self._call.cancel()

    def _next(self, what: str) -> bytes:
        """The peer's next message; PeerError when the stream breaks, stalls or ends before `what`."""
        self._watchdog.waiting()
        try:
            data = next(self._stream, None)
        except grpc.RpcError as e:
            if self._watchdog.why:
                raise PeerError(self.address, self._watchdog.why) from None
            raise self._client._error(e) from None
        self._watchdog.alive(len(data) if data else 0)
        if data is None:
            raise PeerError(self.address, f"the stream ended before {what}")
        return data

    def _response(self, what: str) -> spb.FetchResponse:
        try:
            return spb.FetchResponse.FromString(self._next(f"the {what}"))
        except DecodeError:
            raise IntegrityError(f"the {what} is not a FetchResponse (more chunks than announced?)") from None

    def _open(self, profile: ReceiverProfile) -> None:
        """Read the peer's answer: its manifest, refused here unless it fits `profile`."""
        first = self._response("answer")
        kind = first.WhichOneof("msg")
        if kind == "refused":
            raise CacheRejected(rejection_of(first.refused))
        if kind != "manifest":
            raise PeerError(self.address, f"answered a fetch with {kind}")
        self.manifest = first.manifest
        if rejection := older_protocol(first.protocol_version, "the peer") or check_manifest(self.manifest, profile):
            self.refuse(rejection)

    def refuse(self, rejection: Rejection) -> NoReturn:
        """Tell the peer no (it sends no chunk), then raise CacheRejected."""
        self.decline(rejection)
        raise CacheRejected(rejection)

    def decline(self, rejection: Rejection) -> None:
        """Tell the peer no (it sends no chunk) and wait for it to end the call. Once accepted, the
        call is cut instead: its chunks are moving, and waiting for its end would take them all."""
        if self._accepted:
            self.close()
            return
        self._declined = True
        self._outbox.put(spb.FetchRequest(decision=reject(rejection)))
        self._outbox.put(None)
        try:
            for _ in self._stream:  # the sender ends the stream once it has read the rejection
                pass
        except grpc.RpcError:
            pass  # it went away instead: refused all the same
        self.close()

    def accept(self) -> None:
        """Tell the peer yes: its chunks start to move. A receiver calls it as soon as it knows, so
        that the first chunk is on its way while it readies what takes it; `chunks()` accepts too."""
        if self._declined:
            raise RuntimeError(f"a fetch declined cannot be accepted ({self.manifest.cache_id} from {self.address})")
        if self._accepted:
            return
        self._accepted = True
        encoding = self.manifest.encoding
        self._outbox.hand_over(spb.FetchRequest(decision=accept()))
        left = None if self._ends is None else self._ends - time.monotonic()
        self._watchdog.allow(TIMEOUTS.transfer_deadline(encoding.encoded_bytes) if left is None else left)
        # A message is a chunk, or a batch of small ones (kvmesh.codec.chunks.batch_frames).
        self._watchdog.measure_rate(TIMEOUTS.min_receive_rate, rate_window(max(encoding.chunk_size, BATCH_BYTES)))

    def chunks(self) -> Iterator[Chunk]:
        """Accept the cache (if not yet), then its chunks as they arrive, parsed from their frames
        (their bytes stay where gRPC put them); after the last, the trailer is checked. Each chunk's
        bytes are checked by whoever decodes or stores them (kvmesh.codec.decode, the store)."""
        encoding = self.manifest.encoding
        self.accept()
        frames = FrameReader(self._next)
        for i in range(encoding.chunk_count):
            if (own := self.held.get(i)) is not None:  # held here: it did not travel
                yield own
                continue
            frame = frames.next(f"chunk {i} of {encoding.chunk_count}")
            self.wire_bytes += len(frame) - FRAME_HEADER.size
            if self._progress:
                self._progress(self.wire_bytes, encoding.encoded_bytes)
            yield parse_frame(frame, f"chunk {i}")
        frames.check_done(encoding.chunk_count)
        check_trailer(self._response("trailer"), self.manifest)


@dataclass(frozen=True)
class Probe:
    """What a link probe measured: `bytes` received (the probe data and its framing) `seconds` after
    the call began."""

    bytes: int
    seconds: float

    @property
    def rate(self) -> float:
        """Bytes per second."""
        return self.bytes / self.seconds


@dataclass(frozen=True)
class Published:
    """What a publish did: the id the peer keeps the cache under, and whether its chunks were sent
    (not when the peer held that cache already)."""

    cache_id: str
    sent: bool


class PeerClient:
    """A client of one peer's KvMesh service: `info`, `lookup`, `fetch`, `publish`, `probe`.

    One channel (one TLS handshake) serves every call made through the client: a request keeps its
    client for its lookup, probe and fetch. Every method raises PeerError when the peer cannot be
    reached or fails; `fetch` also raises CacheRejected (before any chunk moves) and IntegrityError.
    """

    def __init__(self, address: str, *, timeout: float = TIMEOUTS.call, credentials: MeshCredentials | None = None):
        """A client of the peer at `address`; with mesh `credentials`, over mutual TLS. `timeout`
        bounds each unary call (`info`, `lookup`, `probe`)."""
        self.address, self.timeout = peer_address(address), timeout
        self.channel = open_channel(self.address, credentials)
        self.stub = service_pb2_grpc.KvMeshStub(self.channel)
        # The streams that carry chunk frames (raw bytes) or probe data: read here, not by stubs.
        self._fetch = self.channel.stream_stream(
            method("Fetch"), request_serializer=serialize, response_deserializer=as_bytes
        )
        self._publish = self.channel.stream_stream(
            method("Publish"), request_serializer=serialize, response_deserializer=spb.PublishResponse.FromString
        )
        self._probe = self.channel.unary_stream(
            method("Probe"), request_serializer=serialize, response_deserializer=as_bytes
        )
        self._artifact = self.channel.unary_stream(
            method("Artifact"), request_serializer=serialize, response_deserializer=spb.ArtifactData.FromString
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _error(self, e: grpc.RpcError) -> PeerError:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        return PeerError(self.address, f"{details} ({code.name.lower() if code else 'error'})", code)

    def info(self) -> spb.InfoResponse:
        try:
            return self.stub.Info(spb.InfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def lookup(self, model_id: str, tokens: Sequence[int]) -> list[Match]:
        """The peer's caches that serve a prefix of `tokens`, longest first (of those serving as much,
        the shortest cache first: the least to cut), at most MAX_CANDIDATES.

        Only block hashes leave this machine; an exact-prefix candidate is confirmed here against
        the prompt itself. A peer's answer is a claim: a candidate that claims more than the prompt
        holds, or than the cache itself, is left out (and logged), so a lying peer costs nothing more.
        A transform-coded candidate that would serve a shorter prefix of itself loses its loss figure
        (its manifest will claim none).
        """
        request = spb.LookupRequest(model_id=model_id, block_size=BLOCK_SIZE, block_hashes=block_hashes(tokens))
        try:
            response = self.stub.Lookup(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None
        matches, seen, bogus = [], set(), []
        for c in response.candidates:
            if problem := candidate_problem(c, len(tokens)):
                bogus.append(f"{c.cache_id[:32]!r}: {problem}")
                continue
            if c.cache_id in seen:
                continue
            seen.add(c.cache_id)
            if n := tokens_served(tokens, c.num_tokens, c.prefix_sha256, c.cuttable, c.matched_tokens):
                if n < c.num_tokens and c.lossy and c.method == "full":
                    # A cut of a transform-coded cache claims no measured loss (kvmesh.codec.cut).
                    c.ClearField("quality")
                matches.append(Match(c, n))
        if bogus:
            log.warning(
                "%s answered a lookup with %d bogus candidate%s (%s); left out",
                self.address,
                len(bogus),
                "" if len(bogus) == 1 else "s",
                bogus[0],
            )
        return sorted(matches, key=lambda m: (-m.tokens, m.candidate.num_tokens))[:MAX_CANDIDATES]

    def fetch(
        self,
        cache_id: str,
        profile: ReceiverProfile,
        *,
        num_tokens: int = 0,
        progress: Progress | None = None,
        idle_timeout: float = TIMEOUTS.stream_idle,
        deadline: float | None = None,
        held_from: CacheStore | None = None,
        code: spb.CodeRequest | None = None,
    ) -> Transfer:
        """Open a fetch of a cache (or of a block-aligned prefix of a dense one, `num_tokens`): the
        Transfer, once its manifest arrived and fits `profile`; its `accept()` lets the chunks move,
        its `chunks()` (accepting if need be) brings them.

        With `held_from` (the receiver's store), a blockwise cache whose first blocks that store
        holds already is asked for again without them (kvmesh.net.held): those chunks come from the
        store, checked equal to the sender's, and only the rest travel (`wire_bytes`); a store whose
        copy differs gets the whole cache.

        With `code`, the peer is asked for a copy it transform codes at that level
        (kvmesh.net.on_request); it refuses (CacheRejected) when that would not pay.

        A peer that sends nothing for `idle_timeout` seconds is abandoned, and so is a transfer
        longer than `deadline` (default: Timeouts.transfer_deadline of its bytes). Raises
        CacheRejected when the peer refuses or the manifest does not fit `profile` (no chunk is sent
        then), PeerError when the peer fails or stalls; the Transfer's chunks raise PeerError and
        IntegrityError likewise.
        """
        open_fetch = functools.partial(
            self._open_fetch, cache_id, profile, num_tokens, progress=progress, idle_timeout=idle_timeout, code=code
        )
        transfer = open_fetch(0, deadline=deadline)
        if held_from is None or (held := held_tokens(held_from, transfer.manifest)) is None:
            return transfer
        local_id, tokens = held
        transfer.decline(Rejection(pb.REJECT_REASON_PREFIX, f"holds its first {tokens} tokens: asks for the rest"))
        transfer = open_fetch(tokens, deadline=deadline)
        if not transfer.manifest.HasField("held"):
            return transfer  # (a peer that leaves nothing out)
        own = own_chunks(held_from, local_id, transfer.manifest, tokens)
        if isinstance(own, dict):
            transfer.held = own
            return transfer
        log.info("%s: %s; fetching the whole cache", self.address, own.message)
        transfer.decline(own)
        return open_fetch(0, deadline=deadline)

    def _open_fetch(
        self,
        cache_id: str,
        profile: ReceiverProfile,
        num_tokens: int,
        held_tokens: int,
        *,
        progress: Progress | None,
        idle_timeout: float,
        deadline: float | None = None,
        code: spb.CodeRequest | None = None,
    ) -> Transfer:
        outbox = Outbox()
        outbox.put(
            spb.FetchRequest(
                open=spb.FetchOpen(
                    cache_id=cache_id,
                    num_tokens=num_tokens,
                    profile=profile_to_proto(profile),
                    protocol_version=PROTOCOL_VERSION,
                    held_tokens=held_tokens,
                    frame_batches=True,
                    code=code,
                )
            )
        )
        call = self._fetch(outbox.requests())
        transfer = Transfer(self, call, outbox, idle_timeout=idle_timeout, deadline=deadline, progress=progress)
        try:
            transfer._open(profile)
        except BaseException:
            transfer.close()
            raise
        return transfer

    def publish(self, store: CacheStore, cache_id: str) -> str:
        """Offer a stored cache to the peer; returns the id it stored it under (`offer` also says
        whether its bytes were sent)."""
        return self.offer(store, cache_id).cache_id

    def offer(self, store: CacheStore, cache_id: str) -> "Published":
        """Offer a stored cache to the peer: its manifest first, and its chunks once the peer accepts;
        a peer that holds that cache already answers so at once, and nothing more is sent.

        A local entry found damaged on the way raises IntegrityError (and is quarantined here).
        """
        manifest = store.manifest(cache_id)
        decided: queue.Queue = queue.Queue()
        local_error: list[Exception] = []

        def requests() -> Iterator[spb.PublishRequest | bytes]:
            yield spb.PublishRequest(manifest=manifest, protocol_version=PROTOCOL_VERSION)
            accepted, batches = decided.get()
            if not accepted:
                return
            try:
                records = store.chunk_records(cache_id)  # the frames, as stored
                yield from (message for message, _ in batch_frames(records)) if batches else records
            except (IntegrityError, KvmeshError) as e:
                local_error.append(e)  # the stream ends without a trailer: the peer stores nothing
                return
            yield spb.PublishRequest(trailer=trailer(manifest))

        # The peer answers only at the start and the end: a frozen peer is found by keepalive pings
        # (kvmesh.net.transport), a crawling transfer by this deadline.
        call = self._publish(requests(), timeout=TIMEOUTS.transfer_deadline(manifest.encoding.encoded_bytes))
        try:
            first = next(iter(call))
            if first.WhichOneof("msg") == "result":  # held there already
                return Published(first.result.cache_id, sent=False)
            rejection = (
                older_protocol(first.protocol_version, "the peer")
                if first.decision.accept
                else rejection_of(first.decision)
            )
            decided.put((rejection is None, first.frame_batches))
            if rejection:
                raise CacheRejected(rejection)
            for response in call:
                if response.WhichOneof("msg") == "result":
                    return Published(response.result.cache_id, sent=True)
            raise PeerError(self.address, "closed the publish without a result")
        except (grpc.RpcError, PeerError) as e:
            if local_error:
                raise local_error[0] from None
            raise e if isinstance(e, PeerError) else self._error(e) from None
        finally:
            decided.put(False)
            call.cancel()

    def artifact(
        self,
        sha256: str,
        nbytes: int,
        write: Callable[[bytes], None],
        *,
        idle_timeout: float = TIMEOUTS.stream_idle,
        deadline: float | None = None,
    ) -> None:
        """The artefact `sha256` (announced as `nbytes` long) from this peer, each piece handed to
        `write` as it arrives (held nowhere here: kvmesh.store.artifacts.Incoming writes it to a file
        and hashes it), within `deadline` seconds (default: Timeouts.transfer_deadline of its size);
        PeerError when the peer does not hold it, stalls for `idle_timeout`, overruns, or sends more
        or less than announced. The caller checks the bytes against their sha256 and for sanity."""
        seconds = deadline if deadline is not None else TIMEOUTS.transfer_deadline(nbytes)
        call = self._artifact(spb.ArtifactRequest(sha256=sha256), timeout=seconds)
        watchdog = IdleWatch(call.cancel, idle_timeout, deadline=seconds)
        watchdog.measure_rate(TIMEOUTS.min_receive_rate, rate_window(ARTIFACT_PIECE_BYTES))
        received, stream = 0, iter(call)
        try:
            while True:
                watchdog.waiting()
                message = next(stream, None)
                if message is None:
                    break
                watchdog.alive(len(message.data))
                received += len(message.data)
                if received > nbytes:
                    raise PeerError(self.address, f"sent more than the {nbytes:,} bytes of artefact {sha256[:12]}")
                write(message.data)
        except grpc.RpcError as e:
            if watchdog.why:
                raise PeerError(self.address, watchdog.why) from None
            raise self._error(e) from None
        finally:
            watchdog.stop()
            call.cancel()  # (a call that ended is not affected; one this side gave up on is ended)
        if received != nbytes:
            raise PeerError(self.address, f"sent {received:,} of the {nbytes:,} bytes of artefact {sha256[:12]}")

    def probe(self, nbytes: int = 4 << 20, *, timeout: float | None = None) -> Probe:
        """The link to this peer measured by receiving `nbytes` (at most 8 MiB) of probe data within
        `timeout` seconds (default: the client's): the fallback when no transfer from it was timed yet."""
        start = time.perf_counter()
        received = 0
        try:
            for message in self._probe(spb.ProbeRequest(bytes=nbytes), timeout=timeout or self.timeout):
                received += len(message)
        except grpc.RpcError as e:
            raise self._error(e) from None
        elapsed = time.perf_counter() - start
        if not received:
            raise PeerError(self.address, "sent no probe data")
        return Probe(received, elapsed)
