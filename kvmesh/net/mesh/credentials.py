"""This node's membership as it holds it: the mesh CA certificate(s) it trusts, its own key and
certificate, and the gRPC credentials made of them.

Loading never writes: renewing is kvmesh.net.mesh.enrolment's, and a long-running process's
credentials that renew themselves are kvmesh.net.mesh.renewing's. The trust file may hold several
CA certificates for a CA change-over.
"""

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cryptography import x509

from kvmesh.errors import CredentialsError
from kvmesh.net.mesh.layout import MeshDir
from kvmesh.net.mesh.pki import RENEW_BEFORE_DAYS, now

if TYPE_CHECKING:  # gRPC loads when credentials are made, so settings tables can name the defaults here
    import grpc


class Membership(Protocol):
    """What dialling a peer needs of this node's credentials (MeshCredentials, RenewingCredentials)."""

    def channel_credentials(self) -> "grpc.ChannelCredentials": ...


@dataclass(frozen=True)
class MeshCredentials:
    """This node's membership: the mesh CA certificate(s) it trusts, and its own key and certificate."""

    trust_pem: bytes  # the mesh CA certificate(s)
    key_pem: bytes
    cert_pem: bytes

    def server_credentials(self) -> "grpc.ServerCredentials":
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.trust_pem, require_client_auth=True
        )

    def channel_credentials(self) -> "grpc.ChannelCredentials":
        import grpc

        return grpc.ssl_channel_credentials(self.trust_pem, self.key_pem, self.cert_pem)

    @property
    def expires(self) -> datetime.datetime:
        return x509.load_pem_x509_certificate(self.cert_pem).not_valid_after_utc


def store_node(directory: MeshDir, key_pem: bytes, cert_pem: bytes) -> None:
    """Keep this node's key (this user's only) and certificate."""
    directory.write_secret(directory.node_key, key_pem)
    directory.write(directory.node_cert, cert_pem)


def load_credentials(data_dir: Path) -> MeshCredentials | None:
    """This node's mesh credentials as they are on disk; None if it has joined no mesh. Never writes."""
    directory = MeshDir.of(data_dir)
    if not directory.joined():
        return None
    try:
        return MeshCredentials(
            directory.trust.read_bytes(), directory.node_key.read_bytes(), directory.node_cert.read_bytes()
        )
    except OSError as e:
        raise CredentialsError(
            f"{directory.root}: cannot read this node's certificate ({e.strerror or e}); `kvmesh mesh renew` makes "
            "a new one"
        ) from e


def renewal_due(creds: MeshCredentials | None, *, renew_before_days: float = RENEW_BEFORE_DAYS) -> bool:
    """True when the node certificate is unreadable or ends within `renew_before_days`."""
    try:
        return creds is None or creds.expires - now() < datetime.timedelta(days=renew_before_days)
    except ValueError:
        return True
