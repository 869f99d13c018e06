"""Who may call this daemon, decided at each call from the certificate the peer's TLS handshake proved.

TLS already refuses a certificate the mesh CA did not sign (a member's own key cannot make one: a
node certificate is no CA) and one outside its dates. gRPC's Python API cannot add checks to the
handshake itself, so the first thing every call does, on every service of the peer port (health
checks and reflection too), is this: a node the authority removed (kvmesh.net.mesh.revocation), or a
certificate that lasts longer than `max_certificate_days` (one the authority would never issue: a
stolen or leaked CA key's work), is refused with PERMISSION_DENIED before the handler runs.
"""

import datetime
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from cryptography import x509

from kvmesh.net.guard import caller
from kvmesh.net.mesh.pki import common_name
from kvmesh.net.mesh.revocation import Revocations
from kvmesh.net.quiet import Quiet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerCertificate:
    """What admission needs of a peer's certificate."""

    node_id: str
    serial: int
    lifetime: datetime.timedelta


@functools.lru_cache(maxsize=1024)
def peer_certificate(pem: bytes) -> PeerCertificate:
    """The node id, serial and lifetime of a certificate (parsed once per certificate, not per call)."""
    cert = x509.load_pem_x509_certificate(pem)
    return PeerCertificate(common_name(cert), cert.serial_number, cert.not_valid_after_utc - cert.not_valid_before_utc)


def node_refusal(node_id: str, revocations: Revocations) -> str | None:
    """Why node `node_id` may neither call nor be dialled (one line), or None."""
    if revocations.revoked(node_id):
        return f"node {node_id} was removed from the mesh (revocation list version {revocations.version})"
    return None


def refusal(pem: bytes, revocations: Revocations, max_days: float) -> str | None:
    """Why the holder of this certificate may not call (one line for the caller), or None."""
    peer = peer_certificate(pem)
    if why := node_refusal(peer.node_id, revocations):
        return why
    if peer.lifetime > datetime.timedelta(days=max_days):
        return (
            f"the certificate of {peer.node_id} lasts {peer.lifetime.total_seconds() / 86400:.0f} days, "
            f"more than this mesh's {max_days:g}: the authority issues no such certificate"
        )
    return None


class Admission(grpc.ServerInterceptor):
    """A server interceptor that refuses removed nodes and over-long certificates at every call,
    and logs each refused node once an hour: a removed Mac's daemon calls every member each second."""

    def __init__(self, revocations: Revocations, max_days: float):
        self.revocations, self.max_days = revocations, max_days
        self.quiet = Quiet()

    def check(self, context: grpc.ServicerContext) -> None:
        """Abort the call when its peer may not make it; plaintext (loopback) callers pass."""
        pems = cast(list[bytes], context.auth_context().get("x509_pem_cert", []))
        if not pems:
            return
        if why := refusal(pems[0], self.revocations, self.max_days):
            if self.quiet.due(why):
                log.warning(
                    "refused a call from %s: %s (its next refusals are logged once an hour)", caller(context), why
                )
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        return guarded(handler, self.check)


def guarded(handler: Any, check: Callable[[grpc.ServicerContext], None]) -> Any:
    """`handler` (one of grpc's method handler tuples) with `check(context)` run before its behaviour."""
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_uu(request, context)

        return handler._replace(unary_unary=unary_unary)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        def stream_unary(requests: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_su(requests, context)

        return handler._replace(stream_unary=stream_unary)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            yield from inner_us(request, context)

        return handler._replace(unary_stream=unary_stream)
    inner_ss = handler.stream_stream

    def stream_stream(requests: Any, context: grpc.ServicerContext) -> Any:
        check(context)
        yield from inner_ss(requests, context)

    return handler._replace(stream_stream=stream_stream)
