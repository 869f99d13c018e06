"""The Python client of a kvmesh peer: info, lookup, fetch and publish.

`fetch` checks the manifest against the local model and prompt before it accepts, then decodes
chunks as they arrive straight into preallocated buffers, optionally writing them to the local
store in the same pass. A failure of any kind leaves nothing in the store.
"""

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvmesh.codec.arrays import Layer
from kvmesh.codec.chunks import FRAME_HEADER, Chunk, parse_frame
from kvmesh.codec.compat import ReceiverProfile, check_manifest
from kvmesh.codec.decode import CacheDecoder
from kvmesh.codec.prefix import BLOCK_SIZE, block_hashes, prefix_sha256
from kvmesh.errors import CacheRejected, IntegrityError, KvmeshError, PeerError, Rejection
from kvmesh.net.credentials import MeshCredentials
from kvmesh.net.messages import accept, older_protocol, profile_to_proto, reject, rejection_of
from kvmesh.net.transport import (
    IDLE_TIMEOUT,
    MIN_TRANSFER_RATE,
    TRANSFER_GRACE,
    as_bytes,
    method,
    open_channel,
    serialize,
)
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc
from kvmesh.versions import PROTOCOL_VERSION

# progress(bytes received so far, bytes expected); raise to cancel the transfer.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Match:
    """A peer's cache that serves `tokens` of the requester's prompt."""

    candidate: spb.Candidate
    tokens: int


@dataclass
class Fetched:
    """A fetched cache, ready to generate from, and what getting it cost."""

    manifest: pb.CacheManifest
    cache: list[Layer]
    seconds: float
    wire_bytes: int
    # Whether it was also kept in the local store.
    kept: bool = False


class Watchdog:
    """Cancels a streaming call whose peer sends nothing for `idle` seconds or that outlives its
    deadline, and says why: gRPC has no per-message timeout, and a sleeping Mac's TCP stack can keep
    a connection open for minutes."""

    def __init__(self, call: grpc.RpcContext, idle: float, deadline: float):
        self.call, self.idle = call, idle
        self.deadline = time.monotonic() + deadline
        self.last = time.monotonic()
        self.why: str | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="kvmesh-watchdog", daemon=True).start()

    def alive(self) -> None:
        """A message arrived."""
        self.last = time.monotonic()

    def allow(self, seconds: float) -> None:
        """The transfer may take `seconds` more in all."""
        self.deadline = time.monotonic() + seconds

    def _watch(self) -> None:
        while not self._done.wait(min(0.25, self.idle / 4)):
            now = time.monotonic()
            if now - self.last > self.idle:
                self.why = f"sent nothing for {self.idle:g} s (asleep, frozen or cut off): transfer abandoned"
            elif now > self.deadline:
                self.why = "the transfer outlived its deadline: abandoned"
            else:
                continue
            self.call.cancel()
            return

    def stop(self) -> None:
        self._done.set()


class PeerClient:
    """A client of one peer's KvMesh service: `info`, `lookup`, `fetch`, `publish`.

    Every method raises PeerError when the peer cannot be reached or fails; `fetch` also raises
    CacheRejected (before any chunk moves) and IntegrityError (nothing is kept).
    """

    def __init__(self, address: str, timeout: float = 10.0, credentials: MeshCredentials | None = None):
        """A client of the peer at `address`; with mesh `credentials`, over mutual TLS."""
        self.address, self.timeout = address, timeout
        self.channel = open_channel(address, credentials)
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
        """The peer's caches that serve a prefix of `tokens`, longest first.

        Only block hashes leave this machine; an exact-prefix candidate is confirmed here against
        the prompt itself.
        """
        request = spb.LookupRequest(model_id=model_id, block_size=BLOCK_SIZE, block_hashes=block_hashes(tokens))
        try:
            response = self.stub.Lookup(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None
        matches = []
        for c in response.candidates:
            if c.num_tokens <= len(tokens) and prefix_sha256(tokens[: c.num_tokens]) == c.prefix_sha256:
                matches.append(Match(c, c.num_tokens))
            elif c.cuttable and c.matched_tokens:
                matches.append(Match(c, c.matched_tokens))
        return sorted(matches, key=lambda m: -m.tokens)

    def fetch(
        self,
        cache_id: str,
        profile: ReceiverProfile,
        num_tokens: int = 0,
        store: CacheStore | None = None,
        progress: Progress | None = None,
        idle_timeout: float = IDLE_TIMEOUT,
        deadline: float | None = None,
        keep: bool = True,
    ) -> Fetched:
        """Fetch a cache (or a block-aligned prefix of a dense one) as sparse MLX caches.

        With a `store`, what arrives is also kept there, in the same pass; with `keep=False`, only
        if the store can hold it (its budget, its free disk), else the fetch goes on without it.
        A peer that sends nothing for `idle_timeout` seconds is abandoned, and so is a transfer
        longer than `deadline` (default: TRANSFER_GRACE plus its bytes at MIN_TRANSFER_RATE).

        Raises CacheRejected when the manifest does not fit `profile` or the store (no chunk is
        sent then), PeerError when the peer fails or stalls, IntegrityError when what arrives is
        damaged. A failure of any kind leaves nothing in the store.
        """
        start = time.perf_counter()
        outbox: queue.Queue = queue.Queue()

        def requests() -> Iterator[spb.FetchRequest]:
            while (message := outbox.get()) is not None:
                yield message

        outbox.put(
            spb.FetchRequest(
                open=spb.FetchOpen(
                    cache_id=cache_id,
                    num_tokens=num_tokens,
                    profile=profile_to_proto(profile),
                    protocol_version=PROTOCOL_VERSION,
                )
            )
        )
        call = self._fetch(requests())
        stream = iter(call)
        watchdog = Watchdog(call, idle_timeout, deadline or TRANSFER_GRACE)

        def response(what: str) -> spb.FetchResponse:
            data = next(stream, None)
            watchdog.alive()
            if data is None:
                raise PeerError(self.address, f"the stream ended before the {what}")
            try:
                return spb.FetchResponse.FromString(data)
            except DecodeError:
                raise IntegrityError(f"the {what} is not a FetchResponse (more chunks than announced?)") from None

        try:
            first = response("answer")
            if first.WhichOneof("msg") == "refused":
                raise CacheRejected(rejection_of(first.refused))
            if first.WhichOneof("msg") != "manifest":
                raise PeerError(self.address, f"answered a fetch with {first.WhichOneof('msg')}")
            manifest = first.manifest
            rejection = older_protocol(first.protocol_version, "the peer") or check_manifest(manifest, profile)
            if store is not None and rejection is None and (problem := store.cannot_hold(manifest)):
                if keep:
                    rejection = Rejection(pb.REJECT_REASON_SIZE_LIMIT, f"the local store cannot keep it: {problem}")
                else:
                    store = None  # decode it all the same, without keeping it
            if rejection:
                outbox.put(spb.FetchRequest(decision=reject(rejection)))
                outbox.put(None)
                for _ in call:  # the sender ends the stream once it has read the rejection
                    pass
                raise CacheRejected(rejection)
            decoder = CacheDecoder(manifest)
            outbox.put(spb.FetchRequest(decision=accept()))
            watchdog.allow(deadline or TRANSFER_GRACE + manifest.encoding.encoded_bytes / MIN_TRANSFER_RATE)
            received = {"bytes": 0}

            def chunks() -> Iterator[Chunk]:
                count = manifest.encoding.chunk_count
                for i in range(count):
                    frame = next(stream, None)
                    watchdog.alive()
                    if frame is None:
                        raise PeerError(self.address, f"the stream ended after {i} of {count} chunks")
                    received["bytes"] += len(frame) - FRAME_HEADER.size
                    if progress:
                        progress(received["bytes"], manifest.encoding.encoded_bytes)
                    yield parse_frame(frame, f"chunk {i}")
                end = response("trailer")
                if end.WhichOneof("msg") != "trailer":
                    raise PeerError(self.address, f"sent {end.WhichOneof('msg')} where the trailer was due")
                if end.trailer.payload_digest != manifest.encoding.payload_digest:
                    raise IntegrityError("the trailer's digest differs from the manifest's")

            if store is not None:
                manifest = store.receive(manifest, chunks(), decoder=decoder)
            else:
                decoder.feed_all(chunks())
            cache = decoder.finish(manifest.encoding.payload_digest)
            return Fetched(manifest, cache, time.perf_counter() - start, received["bytes"], kept=store is not None)
        except grpc.RpcError as e:
            if watchdog.why:
                raise PeerError(self.address, watchdog.why) from None
            raise self._error(e) from None
        finally:
            watchdog.stop()
            outbox.put(None)
            call.cancel()

    def publish(self, store: CacheStore, cache_id: str) -> str:
        """Offer a stored cache to the peer; returns the id it stored it under.

        A local entry found damaged on the way raises IntegrityError (and is quarantined here).
        """
        manifest = store.manifest(cache_id)
        decided: queue.Queue = queue.Queue()
        local_error: list[Exception] = []

        def requests() -> Iterator[spb.PublishRequest | bytes]:
            yield spb.PublishRequest(manifest=manifest, protocol_version=PROTOCOL_VERSION)
            if not decided.get():
                return
            try:
                yield from store.chunk_records(cache_id)  # the frames, as stored
            except (IntegrityError, KvmeshError) as e:
                local_error.append(e)  # the stream ends without a trailer: the peer stores nothing
                return
            yield spb.PublishRequest(
                trailer=spb.Trailer(
                    payload_digest=manifest.encoding.payload_digest,
                    chunk_count=manifest.encoding.chunk_count,
                )
            )

        # The peer answers only at the start and the end: a frozen peer is found by keepalive pings
        # (kvmesh.net.transport), a crawling transfer by this deadline.
        call = self._publish(requests(), timeout=TRANSFER_GRACE + manifest.encoding.encoded_bytes / MIN_TRANSFER_RATE)
        try:
            first = next(iter(call))
            rejection = (
                older_protocol(first.protocol_version, "the peer")
                if first.decision.accept
                else rejection_of(first.decision)
            )
            decided.put(rejection is None)
            if rejection:
                raise CacheRejected(rejection)
            for response in call:
                if response.WhichOneof("msg") == "result":
                    return response.result.cache_id
            raise PeerError(self.address, "closed the publish without a result")
        except (grpc.RpcError, PeerError) as e:
            if local_error:
                raise local_error[0] from None
            raise e if isinstance(e, PeerError) else self._error(e) from None
        finally:
            decided.put(False)
            call.cancel()

    def probe(self, nbytes: int = 4 << 20) -> float:
        """The link's rate to this peer in bytes per second, measured by receiving `nbytes` (at
        most 8 MiB) of probe data: the fallback when no transfer from it was timed yet."""
        start = time.perf_counter()
        received = 0
        try:
            for message in self._probe(spb.ProbeRequest(bytes=nbytes), timeout=self.timeout):
                received += len(message)
        except grpc.RpcError as e:
            raise self._error(e) from None
        elapsed = time.perf_counter() - start
        if not received:
            raise PeerError(self.address, "sent no probe data")
        return received / elapsed


def fetch_from_any(
    addresses: Sequence[str],
    cache_id: str,
    profile: ReceiverProfile,
    credentials: MeshCredentials | None = None,
    **fetch_options,
) -> tuple[str, Fetched]:
    """Fetch from the first peer that delivers; a peer that fails is skipped for the next."""
    errors = []
    for address in addresses:
        with PeerClient(address, credentials=credentials) as client:
            try:
                return address, client.fetch(cache_id, profile, **fetch_options)
            except (PeerError, IntegrityError) as e:
                errors.append(str(e))
    raise KvmeshError("no peer delivered the cache: " + "; ".join(errors))
