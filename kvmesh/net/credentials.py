"""Mesh membership: a small certificate authority shared by the user's Macs, and node certificates.

`kvmesh mesh init` makes the mesh CA on one Mac; `kvmesh mesh export` prints it as one line of text
(it is the mesh's secret: whoever holds it can join); `kvmesh mesh join` on every other Mac imports
it. Each node then holds a short-lived certificate signed by the CA, for its own node id, and every
connection between peers is mutual TLS: a peer without a certificate of this mesh, or with an
expired one, cannot complete the handshake. Node certificates are renewed from the CA when they
near their end (`renew_if_due`, which the daemon and the network commands call; loading never
writes), so rotation never loses the mesh; the trust file may hold several CA certificates for a
CA change-over.
"""

import base64
import datetime
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.errors import CredentialsError
from kvmesh.paths import mesh_dir

if TYPE_CHECKING:  # gRPC loads when credentials are made, so settings tables can name the defaults here
    import grpc

# Every node certificate names this host, and clients check for it, whatever address they dial.
SERVER_NAME = "kvmesh.mesh"
BUNDLE_PREFIX = "kvmesh-mesh-v1:"
NODE_CERT_DAYS = 30
RENEW_BEFORE_DAYS = 7


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by this user only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def make_ca(name: str, days: int = 3650) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) of a new mesh CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh mesh {name}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)


def issue_node_cert(
    ca_key_pem: bytes,
    ca_cert_pem: bytes,
    node_id: str,
    not_before: datetime.datetime | None = None,
    days: float = NODE_CERT_DAYS,
) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for a node, signed by the mesh CA, usable as server and client."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("the mesh CA key is not an EC key: was it made by `kvmesh mesh init`?")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)


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


def init_mesh(data_dir: Path, node_id: str, name: str = "") -> MeshCredentials:
    """Create a new mesh CA here and this node's certificate."""
    directory = mesh_dir(data_dir)
    if (directory / "ca.key").exists():
        raise CredentialsError(f"{directory} already holds a mesh; `kvmesh mesh export` prints it")
    key, cert = make_ca(name or node_id)
    _write_private(directory / "ca.key", key)
    (directory / "trust.pem").write_bytes(cert)
    return renew(data_dir, node_id)


def export_bundle(data_dir: Path) -> str:
    """The mesh secret as one line: give it to `kvmesh mesh join` on the user's other Macs only."""
    directory = mesh_dir(data_dir)
    try:
        payload = {"ca_key": (directory / "ca.key").read_text(), "trust": (directory / "trust.pem").read_text()}
    except FileNotFoundError:
        raise CredentialsError(f"no mesh in {directory}: run `kvmesh mesh init` (or `join`) first") from None
    return BUNDLE_PREFIX + base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()


def join_mesh(data_dir: Path, node_id: str, bundle: str, replace: bool = False) -> MeshCredentials:
    """Import a mesh exported on another Mac, and make this node's certificate.

    A node that already belongs to another mesh leaves it only with `replace`.
    """
    try:
        if not bundle.strip().startswith(BUNDLE_PREFIX):
            raise ValueError("it does not start with " + BUNDLE_PREFIX)
        payload = json.loads(base64.urlsafe_b64decode(bundle.strip()[len(BUNDLE_PREFIX) :]))
        ca_key, trust = payload["ca_key"].encode(), payload["trust"].encode()
        serialization.load_pem_private_key(ca_key, password=None)
        x509.load_pem_x509_certificates(trust)
    except (ValueError, KeyError, TypeError) as e:
        raise CredentialsError(f"not a kvmesh mesh bundle: {e}") from e
    directory = mesh_dir(data_dir)
    if (directory / "trust.pem").exists() and not replace:
        if (directory / "trust.pem").read_bytes() == trust:
            return renew(data_dir, node_id)  # joining the same mesh again: a fresh certificate
        raise CredentialsError(
            f"this node already belongs to another mesh ({directory}); `kvmesh mesh join --replace` leaves it "
            "for the new one"
        )
    _write_private(directory / "ca.key", ca_key)
    (directory / "trust.pem").write_bytes(trust)
    return renew(data_dir, node_id)


def renew(data_dir: Path, node_id: str, *, days: float = NODE_CERT_DAYS) -> MeshCredentials:
    """Issue this node a fresh certificate from the mesh CA, valid `days` (rotation: peers need
    nothing new)."""
    directory = mesh_dir(data_dir)
    ca_key = (directory / "ca.key").read_bytes()
    trust = (directory / "trust.pem").read_bytes()
    # The CA that signs is the newest in the trust file (the last one).
    signer = x509.load_pem_x509_certificates(trust)[-1].public_bytes(serialization.Encoding.PEM)
    key, cert = issue_node_cert(ca_key, signer, node_id, days=days)
    _write_private(directory / "node.key", key)
    (directory / "node.pem").write_bytes(cert)
    return MeshCredentials(trust, key, cert)


def load_credentials(data_dir: Path) -> MeshCredentials | None:
    """This node's mesh credentials as they are on disk; None if it has joined no mesh. Never writes."""
    directory = mesh_dir(data_dir)
    if not (directory / "trust.pem").exists():
        return None
    try:
        return MeshCredentials(
            (directory / "trust.pem").read_bytes(),
            (directory / "node.key").read_bytes(),
            (directory / "node.pem").read_bytes(),
        )
    except OSError as e:
        raise CredentialsError(
            f"{directory}: cannot read this node's certificate ({e.strerror or e}); `kvmesh mesh renew` makes a new one"
        ) from e


def renewal_due(creds: MeshCredentials | None, *, renew_before_days: float = RENEW_BEFORE_DAYS) -> bool:
    """True when the node certificate is unreadable or ends within `renew_before_days`."""
    try:
        return creds is None or creds.expires - _now() < datetime.timedelta(days=renew_before_days)
    except ValueError:
        return True


def renew_if_due(
    data_dir: Path, node_id: str, *, days: float = NODE_CERT_DAYS, renew_before_days: float = RENEW_BEFORE_DAYS
) -> MeshCredentials | None:
    """Load this node's credentials, first renewing a certificate that is missing or ends within
    `renew_before_days` (a week) with one valid `days` (30).

    None if the node has joined no mesh. Renewing needs the CA key, which every member holds.
    """
    directory = mesh_dir(data_dir)
    if not (directory / "trust.pem").exists():
        return None
    try:
        creds = load_credentials(data_dir)
    except CredentialsError:
        creds = None
    if not renewal_due(creds, renew_before_days=renew_before_days):
        return creds
    if not (directory / "ca.key").exists():
        raise CredentialsError(
            f"{directory}: the node certificate is missing or ending and no CA key is here to renew it"
        )
    return renew(data_dir, node_id, days=days)


class Membership(Protocol):
    """What dialling a peer needs of this node's credentials (MeshCredentials, RenewingCredentials)."""

    def channel_credentials(self) -> "grpc.ChannelCredentials": ...


class RenewingCredentials:
    """This node's credentials in a process that runs for months (the daemon): `renew_if_due`,
    called now and then, renews the certificate before it ends, and from then on every new TLS
    handshake, served or dialled, uses the new one; connections already open keep theirs (TLS
    checks a certificate's dates only at the handshake)."""

    def __init__(
        self, data_dir: Path, node_id: str, current: MeshCredentials, *, days: float, renew_before_days: float
    ):
        self.data_dir, self.node_id = data_dir, node_id
        self.days, self.renew_before_days = days, renew_before_days
        self.current = current
        self._lock = threading.Lock()
        self._served: bytes | None = None  # the certificate the server last took

    @property
    def expires(self) -> datetime.datetime:
        return self.current.expires

    def renew_if_due(self) -> bool:
        """Renew the certificate if it ends within `renew_before_days`; True when it was."""
        with self._lock:
            renewed = renew_if_due(
                self.data_dir, self.node_id, days=self.days, renew_before_days=self.renew_before_days
            )
            if renewed is None or renewed.cert_pem == self.current.cert_pem:
                return False
            self.current = renewed
            return True

    def channel_credentials(self) -> "grpc.ChannelCredentials":
        return self.current.channel_credentials()

    def server_credentials(self) -> "grpc.ServerCredentials":
        """Credentials whose certificate gRPC asks for again at each new handshake (`_fetch`)."""
        import grpc

        self._served = self.current.cert_pem
        return grpc.dynamic_ssl_server_credentials(
            _server_configuration(self.current), self._fetch, require_client_authentication=True
        )

    def _fetch(self) -> Any:
        """gRPC's certificate fetcher: the renewed certificate once, then None (no change)."""
        current = self.current
        if current.cert_pem == self._served:
            return None
        self._served = current.cert_pem
        return _server_configuration(current)


def _server_configuration(creds: MeshCredentials) -> Any:
    import grpc

    return grpc.ssl_server_certificate_configuration(
        [(creds.key_pem, creds.cert_pem)], root_certificates=creds.trust_pem
    )
