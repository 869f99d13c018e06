"""The Membership service (kvmesh/v1/membership.proto) and the calls a node makes to it.

The authority's daemon serves Join and Renew on its join port (`serve_join_port`), a plaintext port
beside its peer port: a joining Mac has no certificate to pass mutual TLS with. Nothing there needs
secrecy: a join sends a CSR and an HMAC made with the token's secret, a renewal a signature by the
member's current key, and answers are certificates, which the joiner checks against the CA
fingerprint its token carries before it trusts anything. Every daemon also serves Revocations on
its peer port, so members pass the signed revocation list on to each other.
"""

import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.errors import CredentialsError, ListenError
from kvmesh.net import authority
from kvmesh.net.addresses import host_port
from kvmesh.net.revocation import Revocations
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


class MembershipService(membership_pb2_grpc.MembershipServicer):
    """Join and Renew (when this node is the authority: it holds the CA key), and Revocations."""

    def __init__(self, data_dir: Path, revocations: Revocations, *, days: float):
        """`days`: the longest certificate this authority issues."""
        self.data_dir, self.revocations, self.days = data_dir, revocations, days

    def Join(self, request: mpb.JoinRequest, context: grpc.ServicerContext) -> mpb.JoinResponse:
        try:
            cert, secret = authority.admit(self.data_dir, request.token_id, request.csr, request.proof, days=self.days)
        except CredentialsError as e:
            log.warning("refused a join from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        trust = self._trust()
        log.info("admitted a new member: %s", _common_name(cert))
        return mpb.JoinResponse(
            certificate=cert,
            trust=trust,
            authority_node_id=_common_name((authority.mesh_dir(self.data_dir) / "node.pem").read_bytes()),
            revocations=self._revocations(),
            proof=authority.reply_proof(secret, cert, trust),
        )

    def Renew(self, request: mpb.RenewRequest, context: grpc.ServicerContext) -> mpb.RenewResponse:
        days = min(request.days or self.days, self.days)
        try:
            cert = authority.renew_member(self.data_dir, request.certificate, request.csr, request.signature, days=days)
        except CredentialsError as e:
            log.warning("refused a renewal from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        log.info("renewed the certificate of %s", _common_name(cert))
        return mpb.RenewResponse(certificate=cert, trust=self._trust(), revocations=self._revocations())

    def Revocations(self, request: mpb.RevocationsRequest, context: grpc.ServicerContext) -> mpb.RevocationsResponse:
        self.revocations.reload()
        if self.revocations.version <= request.version:
            return mpb.RevocationsResponse()
        return mpb.RevocationsResponse(revocations=self.revocations.current.to_bytes())

    def _trust(self) -> bytes:
        return (authority.mesh_dir(self.data_dir) / "trust.pem").read_bytes()

    def _revocations(self) -> bytes:
        self.revocations.reload()
        return self.revocations.current.to_bytes() if self.revocations.version else b""


def _common_name(cert_pem: bytes) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = x509.load_pem_x509_certificate(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else "?"


@dataclass
class JoinPort:
    """The authority's join port, serving."""

    server: grpc.Server
    port: int

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()


def serve_join_port(service: MembershipService, hosts: list[str], port: int) -> JoinPort:
    """Serve Join, Renew and Revocations in plaintext on `port` of each of `hosts` (0: any free
    port, the same on every host). A few threads: joins are rare, and nothing waits long."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), options=JOIN_PORT_OPTIONS, maximum_concurrent_rpcs=8
    )
    membership_pb2_grpc.add_MembershipServicer_to_server(service, server)
    bound = port
    for host in hosts:
        try:
            bound = server.add_insecure_port(host_port(host, bound))
        except RuntimeError:
            bound = 0
        if not bound:
            raise ListenError(f"cannot listen for joins on {host_port(host, port)}: is the port free?", port)
    server.start()
    return JoinPort(server, bound)


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
    with grpc.insecure_channel(address, options=JOIN_PORT_OPTIONS) as channel:
        try:
            return membership_pb2_grpc.MembershipStub(channel).Join(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _call_error(address, e, "join") from None


def request_renewal(address: str, request: mpb.RenewRequest, timeout: float = TIMEOUTS.call) -> mpb.RenewResponse:
    """Ask the authority's join port for a fresh certificate; JoinRefused or CredentialsError if it fails."""
    with grpc.insecure_channel(address, options=JOIN_PORT_OPTIONS) as channel:
        try:
            return membership_pb2_grpc.MembershipStub(channel).Renew(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _call_error(address, e, "renewal") from None
