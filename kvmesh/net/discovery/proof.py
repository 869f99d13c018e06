"""Who is at an address, proven: the node id in the mesh certificate the peer presents in a mutual
TLS handshake (on a plaintext, loopback-only mesh: the id its Info answers over the real channel).
mDNS is unauthenticated, so nothing an advert claims is believed before this."""

import math
import os
import socket
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.net.addresses import split_host_port
from kvmesh.net.mesh.credentials import Membership, MeshCredentials
from kvmesh.net.mesh.pki import SERVER_NAME, node_name
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import open_channel
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc

# Why a certificate (PEM) the mesh CA signed is refused all the same (a removed node), or None.
Refuse = Callable[[bytes], str | None]
# The same for a node id.
RefuseNode = Callable[[str], str | None]


@dataclass(frozen=True)
class Proof:
    """Who the peer at an address proved to be (`node_id`), or why it could not (`why`; `answered`:
    something answered there); `named`: its certificate holds its node's own name, so a channel can
    be pinned to it (`open_channel`)."""

    node_id: str | None
    why: str = ""
    named: bool = False
    answered: bool = True
    # When the certificate it proved itself with ends (seconds since the epoch): a channel opened
    # before then stays open after it, and gRPC does not check the certificate again on it.
    expires: float = math.inf


def certificate_name(certificate: dict[str, Any]) -> str | None:
    """The common name (a node id) in the subject of a certificate as `ssl` gives it."""
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def certificate_pems(credentials: Membership | None) -> MeshCredentials | None:
    """The PEMs behind this node's credentials (a RenewingCredentials' current ones), if any."""
    current = getattr(credentials, "current", credentials)
    return current if isinstance(current, MeshCredentials) else None


class Prover:
    """Proves who is at an address: over mutual TLS, the node id in the mesh certificate the peer
    presents (the CA's signature and the peer's key checked by the handshake); without credentials,
    the node id the peer's Info answers. Never logs through gRPC: a stranger costs one log line."""

    def __init__(self, credentials: Membership | None, timeout: float = TIMEOUTS.prove, refuse: Refuse | None = None):
        """`refuse`: why a certificate the CA signed is refused all the same (a removed node), or None."""
        self.credentials, self.timeout, self.refuse = credentials, timeout, refuse
        self._context: tuple[bytes, ssl.SSLContext] | None = None

    def prove(self, address: str) -> Proof:
        pems = certificate_pems(self.credentials)
        if pems is not None:
            return self._by_certificate(address, pems)
        return self._by_info(address)

    def _tls(self, pems: MeshCredentials) -> ssl.SSLContext:
        """A TLS client context with this node's certificate, trusting the mesh CA only (made again
        when the certificate was renewed)."""
        if self._context is not None and self._context[0] == pems.cert_pem:
            return self._context[1]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=pems.trust_pem.decode())
        context.set_alpn_protocols(["h2"])  # gRPC servers expect HTTP/2
        # ssl loads a key only from a file: a private one, removed at once.
        fd, path = tempfile.mkstemp(prefix="kvmesh-prove-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pems.key_pem + pems.cert_pem)
            context.load_cert_chain(path)
        finally:
            os.unlink(path)
        self._context = (pems.cert_pem, context)
        return context

    def _by_certificate(self, address: str, pems: MeshCredentials) -> Proof:
        host, port = split_host_port(address)
        try:
            with socket.create_connection((host, port), timeout=self.timeout) as raw:
                with self._tls(pems).wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
                    certificate = tls.getpeercert() or {}
                    presented = tls.getpeercert(binary_form=True)
        except ssl.SSLCertVerificationError:
            return Proof(None, "is not a member of this mesh")
        except ssl.SSLError as e:
            if e.reason == "WRONG_VERSION_NUMBER":  # it answered, in plain text: a daemon of no mesh
                return Proof(None, "answers without TLS: it has not joined this mesh (`kvmesh mesh join` there)")
            return Proof(None, f"does not answer ({e})", answered=False)
        except OSError as e:
            return Proof(None, f"does not answer ({getattr(e, 'strerror', None) or e})", answered=False)
        common_name = certificate_name(certificate)
        if not common_name:
            return Proof(None, "presents a certificate without a node id")
        if self.refuse and presented and (why := self.refuse(ssl.DER_cert_to_PEM_cert(presented).encode())):
            return Proof(None, f"is refused: {why}")
        named = ("DNS", node_name(common_name)) in certificate.get("subjectAltName", ())
        ends = certificate.get("notAfter")
        expires = ssl.cert_time_to_seconds(ends) if isinstance(ends, str) else math.inf
        return Proof(common_name, named=named, expires=expires)

    def _by_info(self, address: str) -> Proof:
        try:
            with open_channel(address) as channel:
                info = service_pb2_grpc.KvMeshStub(channel).Info(spb.InfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            return Proof(None, f"does not answer ({e.code().name.lower() if hasattr(e, 'code') else e})")
        return Proof(info.node_id or None, "" if info.node_id else "answers without a node id")
