"""The Membership service (kvmesh/v1/membership.proto) and the calls a node makes to it.

The authority's daemon serves Join and Renew on its join port (`serve_join_port`), a plaintext port
beside its peer port: a joining Mac has no certificate to pass mutual TLS with. Nothing there needs
secrecy: a join sends a CSR and an HMAC made with the token's secret, a renewal a signature by the
member's current key, and answers are certificates, which the joiner checks against the CA
fingerprint its token carries before it trusts anything. Every daemon also serves Revocations on
its peer port, so members pass the signed revocation list on to each other.

Anyone on the LAN reaches the join port, so nobody there may hold it: it runs on an asyncio loop of
its own (grpc.aio), where a call waiting for its request holds no thread; a call must bring its
request within JOIN_MESSAGE_WAIT; one address has at most CALLS_PER_ADDRESS calls open, of which
JOINS_PER_ADDRESS are answered at once; and a refusal is logged once a minute per reason, however
often a stranger earns it.
"""

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from cryptography import x509

from kvmesh.errors import CredentialsError, ListenError
from kvmesh.net.addresses import caller_host, host_port
from kvmesh.net.guard import caller
from kvmesh.net.mesh import authority
from kvmesh.net.mesh.layout import MeshDir
from kvmesh.net.mesh.pki import common_name
from kvmesh.net.mesh.revocation import Revocations
from kvmesh.net.quiet import Quiet
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.v1 import membership_pb2 as mpb
from kvmesh.v1 import membership_pb2_grpc

log = logging.getLogger(__name__)
# A CSR or a certificate is under 2 KiB: nothing bigger is read on the join port.
MAX_JOIN_MESSAGE = 64 << 10
JOIN_PORT_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_JOIN_MESSAGE),
    ("grpc.max_send_message_length", MAX_JOIN_MESSAGE),
    ("grpc.so_reuseport", 0),
    ("grpc.max_connection_idle_ms", 30_000),
]
# A join or renewal request is one small message, sent with the call: a call that brings none
# within this (a LAN answers in milliseconds) is cut.
JOIN_MESSAGE_WAIT = TIMEOUTS.open_message
# Calls one address has answered at once on the join port (a Mac joins or renews with one), calls
# it may have open (the rest wait their turn, within JOIN_MESSAGE_WAIT too), and calls of all.
JOINS_PER_ADDRESS = 2
CALLS_PER_ADDRESS = 10
MAX_JOIN_CALLS = 256
# A refusal on the join port (a wrong proof, a bad renewal) is logged once a minute per reason.
REFUSAL_LOG_EVERY = 60.0
Request = TypeVar("Request")


class MembershipService(membership_pb2_grpc.MembershipServicer):
    """Join and Renew (when this node is the authority: it holds the CA key), and Revocations."""

    def __init__(self, data_dir: Path, revocations: Revocations, *, days: float):
        """`days`: the longest certificate this authority issues."""
        self.data_dir, self.revocations, self.days = data_dir, revocations, days
        self.directory = MeshDir.of(data_dir)
        self.quiet = Quiet(every=REFUSAL_LOG_EVERY)

    def Join(self, request: mpb.JoinRequest, context: grpc.ServicerContext) -> mpb.JoinResponse:
        try:
            return self.join(request, context.peer())
        except CredentialsError as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    def Renew(self, request: mpb.RenewRequest, context: grpc.ServicerContext) -> mpb.RenewResponse:
        try:
            return self.renew(request, context.peer())
        except CredentialsError as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    def refused(self, what: str, peer: str, e: CredentialsError) -> None:
        """Log a refusal: once a minute per reason (a stranger sending wrong proofs in a loop writes
        no more)."""
        if self.quiet.due((what, str(e))):
            log.warning("refused a %s from %s: %s (this reason is logged once a minute)", what, peer, e)

    def join(self, request: mpb.JoinRequest, peer: str) -> mpb.JoinResponse:
        """Admit a new Mac; CredentialsError (logged) when the authority refuses it."""
        try:
            cert, secret = authority.admit(self.data_dir, request.token_id, request.csr, request.proof, days=self.days)
        except CredentialsError as e:
            self.refused("join", peer, e)
            raise
        trust = self._trust()
        log.info("admitted a new member: %s", _common_name(cert))
        return mpb.JoinResponse(
            certificate=cert,
            trust=trust,
            authority_node_id=authority.own_id(self.directory),
            revocations=self._revocations(),
            proof=authority.reply_proof(secret, cert, trust),
        )

    def renew(self, request: mpb.RenewRequest, peer: str) -> mpb.RenewResponse:
        """Renew a member's certificate; CredentialsError (logged) when the authority refuses it."""
        days = min(request.days or self.days, self.days)
        try:
            cert = authority.renew_member(self.data_dir, request.certificate, request.csr, request.signature, days=days)
        except CredentialsError as e:
            self.refused("renewal", peer, e)
            raise
        log.info("renewed the certificate of %s", _common_name(cert))
        return mpb.RenewResponse(certificate=cert, trust=self._trust(), revocations=self._revocations())

    def Revocations(self, request: mpb.RevocationsRequest, context: grpc.ServicerContext) -> mpb.RevocationsResponse:
        """On the peer port (mutual TLS: a member calls): a list the caller pushes is adopted when the
        CA signed it and it is newer (and then pushed on: kvmesh.net.mesh.gossip); the answer is this
        node's list if it is newer than the caller's."""
        if request.revocations:
            self.revocations.adopt(request.revocations, source=f"peer {caller(context)}, pushed")
        return self.newer_revocations(request)

    def newer_revocations(self, request: mpb.RevocationsRequest, peer: str = "") -> mpb.RevocationsResponse:
        """The signed revocation list if it is newer than the caller's."""
        self.revocations.reload()
        if self.revocations.version <= request.version:
            return mpb.RevocationsResponse()
        return mpb.RevocationsResponse(revocations=self.revocations.current.to_bytes())

    def _trust(self) -> bytes:
        return self.directory.trust.read_bytes()

    def _revocations(self) -> bytes:
        self.revocations.reload()
        return self.revocations.current.to_bytes() if self.revocations.version else b""


def _common_name(cert_pem: bytes) -> str:
    return common_name(x509.load_pem_x509_certificate(cert_pem)) or "?"


class JoinPort:
    """The authority's join port, serving on an asyncio loop of its own thread (`serve_join_port`)."""

    def __init__(self, service: MembershipService):
        self.service = service
        self.port = 0
        # Per address, touched on the loop only: calls open, and the slots of those being answered.
        self._open: Counter[str] = Counter()
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._server: grpc.aio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-join-port", daemon=True)
        self._thread.start()

    def serve(self, hosts: list[str], port: int) -> None:
        """Listen on `port` of each of `hosts` (0: any free port, the same on every host)."""
        asyncio.run_coroutine_threadsafe(self._serve(hosts, port), self._loop).result()

    async def _serve(self, hosts: list[str], port: int) -> None:
        self._server = grpc.aio.server(options=JOIN_PORT_OPTIONS, maximum_concurrent_rpcs=MAX_JOIN_CALLS)
        self._server.add_generic_rpc_handlers((self._handlers(),))
        bound = port
        for host in hosts:
            try:
                bound = self._server.add_insecure_port(host_port(host, bound))
            except RuntimeError:
                bound = 0
            if not bound:
                raise ListenError(f"cannot listen for joins on {host_port(host, port)}: is the port free?", port)
        await self._server.start()
        self.port = bound

    def _handlers(self) -> grpc.GenericRpcHandler:
        """Join, Renew and Revocations, each taking its one request as a stream: the handler runs as
        the call starts, so it can refuse the call, or cut it when no request comes (`_answer`)."""
        service = self.service

        def method(behaviour: Callable[[Any, str], Any], request: Any, response: Any) -> grpc.RpcMethodHandler:
            return grpc.stream_unary_rpc_method_handler(
                self._answer(behaviour),
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            "kvmesh.v1.Membership",
            {
                "Join": method(service.join, mpb.JoinRequest, mpb.JoinResponse),
                "Renew": method(service.renew, mpb.RenewRequest, mpb.RenewResponse),
                "Revocations": method(service.newer_revocations, mpb.RevocationsRequest, mpb.RevocationsResponse),
            },
        )

    def _answer(self, behaviour: Callable[[Request, str], Any]) -> Callable[..., Any]:
        """A call's coroutine: at most CALLS_PER_ADDRESS open per address; within JOIN_MESSAGE_WAIT
        one of its address's JOINS_PER_ADDRESS slots and its request, then `behaviour(request,
        peer)` on a worker thread (it reads the CA key's files)."""

        async def answer(requests: AsyncIterator[Request], context: grpc.aio.ServicerContext) -> Any:
            peer = context.peer()
            source = caller_host(peer)
            if self._open[source] >= CALLS_PER_ADDRESS:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{CALLS_PER_ADDRESS} calls from this address are open: try again when they end",
                )
            self._open[source] += 1
            slot = self._slots.setdefault(source, asyncio.Semaphore(JOINS_PER_ADDRESS))
            taken = False

            async def take() -> Request:
                nonlocal taken
                await slot.acquire()
                taken = True
                return await anext(requests)

            try:
                try:
                    request = await asyncio.wait_for(take(), JOIN_MESSAGE_WAIT)
                except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"no request within {JOIN_MESSAGE_WAIT:g} s of the call"
                    )
                except StopAsyncIteration:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request")
                try:
                    return await asyncio.to_thread(behaviour, request, peer)
                except CredentialsError as e:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            finally:
                self._release(source, slot if taken else None)

        return answer

    def _release(self, source: str, slot: asyncio.Semaphore | None) -> None:
        """A call of `source` ended (holding `slot`, if it got one)."""
        if slot is not None:
            slot.release()
        self._open[source] -= 1
        if not self._open[source]:
            del self._open[source], self._slots[source]

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def serve_join_port(service: MembershipService, hosts: list[str], port: int) -> JoinPort:
    """Serve Join, Renew and Revocations in plaintext on `port` of each of `hosts` (0: any free
    port, the same on every host)."""
    join_port = JoinPort(service)
    try:
        join_port.serve(hosts, port)
    except BaseException:
        join_port.stop(grace=0)
        raise
    return join_port


def _call_error(address: str, e: grpc.RpcError, what: str) -> CredentialsError:
    code = e.code() if hasattr(e, "code") else None
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return authority.JoinRefused(f"the authority at {address} refused the {what}: {e.details()}")
    details = e.details() if hasattr(e, "details") else str(e)
    return CredentialsError(
        f"cannot reach the mesh's authority at {address} for the {what} ({details}): is its daemon running, "
        "and is that its join port?"
    )


def request_join(address: str, request: mpb.JoinRequest, timeout: float = TIMEOUTS.call) -> mpb.JoinResponse:
    """Send a join request to the authority's join port; JoinRefused or CredentialsError if it fails."""
    return _call_authority(address, "Join", request, "join", timeout)


def request_renewal(address: str, request: mpb.RenewRequest, timeout: float = TIMEOUTS.call) -> mpb.RenewResponse:
    """Ask the authority's join port for a fresh certificate; JoinRefused or CredentialsError if it fails."""
    return _call_authority(address, "Renew", request, "renewal", timeout)


def _call_authority(address: str, method: str, request: Any, what: str, timeout: float) -> Any:
    """One call to the authority's join port (plaintext: the caller has no certificate yet)."""
    with grpc.insecure_channel(address, options=JOIN_PORT_OPTIONS) as channel:
        try:
            return getattr(membership_pb2_grpc.MembershipStub(channel), method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _call_error(address, e, what) from None
