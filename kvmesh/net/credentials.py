"""Mesh membership: a certificate authority that stays on one Mac, and node certificates.

`kvmesh mesh init` makes the mesh CA on one Mac, the mesh's authority; the CA key never leaves its
data directory. `kvmesh mesh token` there prints a one-time join token, and `kvmesh mesh join TOKEN
ADDRESS` on another Mac makes that Mac's own key and a CSR, which the authority's daemon signs when
the request proves it holds the token (kvmesh.net.authority, kvmesh.net.membership). Each node then
holds a short-lived certificate signed by the CA, for its own node id, and every connection between
peers is mutual TLS: a peer without a certificate of this mesh, or with an expired one, cannot
complete the handshake, and one the authority removed is refused at every call
(kvmesh.net.admission). Node certificates are renewed before they end (`renew_if_due`, which the
daemon and the network commands call; loading never writes): the authority signs its own, members
ask the authority, proving they hold their current certificate's key. The trust file may hold
several CA certificates for a CA change-over.
"""

import datetime
import hashlib
import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.errors import CredentialsError
from kvmesh.paths import mesh_dir

if TYPE_CHECKING:  # gRPC loads when credentials are made, so settings tables can name the defaults here
    import grpc

log = logging.getLogger(__name__)
# Every node certificate names this host, and its node's own (`node_name`): a client that knows
# which node it dials checks for that one, so no other member (a removed one) can answer for it.
SERVER_NAME = "kvmesh.mesh"
NODE_CERT_DAYS = 30
RENEW_BEFORE_DAYS = 7
# The authority's join port (beside the peer port, DEFAULT_PORT).
DEFAULT_JOIN_PORT = 7078
# A node certificate lasting longer than this is refused by every member (kvmesh.net.admission).
MAX_CERT_DAYS = 31
# Where a member keeps the authority's join address and node id (for renewals).
AUTHORITY_FILE = "authority.json"
# The key a join sends until it has joined (`pending_key`).
PENDING_KEY = "join-pending.key"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by this user only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def node_name(node_id: str) -> str:
    """The DNS name a node's certificate holds for that node alone: the name a client that expects
    `node_id` at an address checks the server's certificate against (TLS hostname verification)."""
    return f"{node_id}.{SERVER_NAME}"


def names_node(cert_pem: bytes, node_id: str) -> bool:
    """Whether the certificate holds `node_id`'s own name (those issued before it was added do not)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    return node_name(node_id) in names.get_values_for_type(x509.DNSName)


def ca_fingerprint(trust_pem: bytes) -> bytes:
    """SHA-256 of the DER of the newest (last) CA certificate in `trust_pem`: what a join token pins."""
    cert = x509.load_pem_x509_certificates(trust_pem)[-1]
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


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


def sign_node_cert(
    ca_key_pem: bytes,
    ca_cert_pem: bytes,
    node_id: str,
    public_key: Any,
    not_before: datetime.datetime | None = None,
    days: float = NODE_CERT_DAYS,
) -> bytes:
    """The PEM certificate of a node's `public_key`, signed by the mesh CA, usable as server and
    client. Only the authority can call it: it needs the CA key."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("the mesh CA key is not an EC key: was it made by `kvmesh mesh init`?")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    start = not_before or _now() - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME), x509.DNSName(node_name(node_id))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def issue_node_cert(
    ca_key_pem: bytes,
    ca_cert_pem: bytes,
    node_id: str,
    not_before: datetime.datetime | None = None,
    days: float = NODE_CERT_DAYS,
) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for a node: a new key, and its certificate from the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    return _pem_key(key), sign_node_cert(ca_key_pem, ca_cert_pem, node_id, key.public_key(), not_before, days)


def make_request(node_id: str, key_pem: bytes | None = None) -> tuple[bytes, bytes]:
    """(key PEM, CSR DER) for `node_id` of `key_pem` (default: a new key): what a node sends to be
    signed; the key stays here."""
    key = ec.generate_private_key(ec.SECP256R1()) if key_pem is None else _load_key(key_pem)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), csr.public_bytes(serialization.Encoding.DER)


def _load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("a kvmesh node key is an EC key: this one is not (delete it and join again)")
    return key


def pending_key(directory: Path) -> bytes:
    """The key of this node's join: the one an earlier join that did not finish sent (kept in
    `PENDING_KEY`), or a new one kept there. The authority answers a join again for the node's same
    key, so a join that failed after the authority signed (a lost answer, a wrong address or CA
    fingerprint) can be retried with the same token or a new one."""
    path = directory / PENDING_KEY
    try:
        return path.read_bytes()
    except FileNotFoundError:
        key_pem = _pem_key(ec.generate_private_key(ec.SECP256R1()))
        write_private(path, key_pem)
        return key_pem


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


def _store(directory: Path, key_pem: bytes, cert_pem: bytes) -> None:
    write_private(directory / "node.key", key_pem)
    (directory / "node.pem").write_bytes(cert_pem)


def init_mesh(data_dir: Path, node_id: str, name: str = "", *, days: float = NODE_CERT_DAYS) -> MeshCredentials:
    """Create a new mesh here, with this node as its authority: the CA (whose key stays here) and
    this node's certificate."""
    directory = mesh_dir(data_dir)
    if (directory / "trust.pem").exists():
        raise CredentialsError(
            f"{directory} already belongs to a mesh; `kvmesh mesh status` says which (another data dir makes another)"
        )
    key, cert = make_ca(name or node_id)
    write_private(directory / "ca.key", key)
    (directory / "trust.pem").write_bytes(cert)
    return renew(data_dir, node_id, days=days)


def export_bundle(data_dir: Path) -> str:
    """Gone: it copied the CA key to every member, so any member could make any identity."""
    raise CredentialsError(
        "the mesh CA key no longer leaves the authority: run `kvmesh mesh token` there and "
        "`kvmesh mesh join TOKEN ADDRESS` on the new Mac"
    )


def read_authority(data_dir: Path) -> dict[str, str]:
    """{"address": the authority's join address, "node_id": its node id}, as the join stored them."""
    try:
        return json.loads((mesh_dir(data_dir) / AUTHORITY_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def write_authority(data_dir: Path, address: str, node_id: str) -> None:
    (mesh_dir(data_dir) / AUTHORITY_FILE).write_text(json.dumps({"address": address, "node_id": node_id}))


def join_mesh(
    data_dir: Path, node_id: str, token: str, authority_address: str, *, replace: bool = False
) -> MeshCredentials:
    """Join the mesh whose authority made `token`, at `authority_address` (its join port): a new
    key made here, its CSR signed there. The CA certificate the authority answers with must have
    the token's fingerprint, and the certificate must be for this key and node.

    A node that already belongs to another mesh leaves it only with `replace`.
    """
    from kvmesh.net import authority, membership
    from kvmesh.v1 import membership_pb2 as mpb

    parsed = authority.JoinToken.parse(token)
    directory = mesh_dir(data_dir)
    if (directory / "trust.pem").exists() and not replace:
        raise CredentialsError(
            f"this node already belongs to a mesh ({directory}); `kvmesh mesh join --replace` leaves it for the new one"
        )
    address = join_address(authority_address)
    key_pem, csr = make_request(node_id, pending_key(directory))
    answer = membership.request_join(
        address,
        mpb.JoinRequest(
            token_id=parsed.token_id, csr=csr, proof=authority.join_proof(parsed.secret, parsed.token_id, csr)
        ),
    )
    _check_answer(answer.certificate, answer.trust, key_pem, node_id, parsed.ca_fingerprint)
    if not hmac.compare_digest(authority.reply_proof(parsed.secret, answer.certificate, answer.trust), answer.proof):
        raise CredentialsError(
            f"the answer from {address} does not match the token: it is not this mesh's authority; check the "
            "address and join again"
        )
    return install(
        data_dir, answer.trust, key_pem, answer.certificate, address, answer.authority_node_id, answer.revocations
    )


def install(
    data_dir: Path,
    trust_pem: bytes,
    key_pem: bytes,
    cert_pem: bytes,
    authority_address: str,
    authority_node_id: str,
    revocations: bytes = b"",
) -> MeshCredentials:
    """Keep a new member's credentials (never a CA key), where its authority is, and the
    revocation list it was given (if the CA signed it)."""
    from kvmesh.net.revocation import RevocationList, write_list

    directory = mesh_dir(data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    # What belonged to the mesh it leaves (`--replace`), the CA key too when it was that mesh's authority.
    for stale in ("revocations.json", AUTHORITY_FILE, "ca.key", "tokens.json", "members.json", "join.json"):
        (directory / stale).unlink(missing_ok=True)
    (directory / "trust.pem").write_bytes(trust_pem)
    _store(directory, key_pem, cert_pem)
    (directory / PENDING_KEY).unlink(missing_ok=True)
    write_authority(data_dir, authority_address, authority_node_id)
    if revocations:
        signed = RevocationList.from_bytes(revocations)
        signed.verify(trust_pem)
        write_list(data_dir, signed)
    return MeshCredentials(trust_pem, key_pem, cert_pem)


def join_address(text: str) -> str:
    """The authority's join address as a person types it: a host alone means its join port (7078)."""
    from kvmesh.net.addresses import host_port, peer_address

    address = peer_address(text)
    host, port = address.rsplit(":", 1)
    return address if text.strip().endswith(f":{port}") else host_port(host, DEFAULT_JOIN_PORT)


def _check_answer(cert_pem: bytes, trust_pem: bytes, key_pem: bytes, node_id: str, fingerprint: bytes | None) -> None:
    """CredentialsError unless `cert_pem` is `node_id`'s, for `key_pem`, signed by the CA in
    `trust_pem` (whose fingerprint is `fingerprint`, when given: the join token's pin)."""
    try:
        cas = x509.load_pem_x509_certificates(trust_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise CredentialsError(f"the authority answered with no valid certificate: {e}") from None
    if fingerprint is not None and ca_fingerprint(trust_pem) != fingerprint:
        raise CredentialsError(
            "the mesh CA the authority sent is not the one the join token names (a wrong address, or someone in "
            "between): check the address, or make a new token on the authority (`kvmesh mesh token`), and join again"
        )
    key = serialization.load_pem_private_key(key_pem, password=None)
    same_key = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not same_key or not names or names[0].value != node_id:
        raise CredentialsError("the authority's certificate is not for this node's key and id")
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):
            continue
    raise CredentialsError("the authority's certificate is not signed by the mesh CA")


def renew(data_dir: Path, node_id: str, *, days: float = NODE_CERT_DAYS) -> MeshCredentials:
    """A fresh certificate for this node, valid `days` (at most what the authority grants), with a
    new key: the authority signs its own; a member asks the authority, signing the request with
    its current key. Rotation: peers need nothing new."""
    from kvmesh.net import authority, membership
    from kvmesh.v1 import membership_pb2 as mpb

    directory = mesh_dir(data_dir)
    trust = (directory / "trust.pem").read_bytes()
    key_pem, csr = make_request(node_id)
    if authority.is_authority(data_dir):
        cert = authority.sign_own(data_dir, csr, days=days)
    else:
        current = load_credentials(data_dir)
        where = read_authority(data_dir).get("address")
        if current is None or not where:
            raise CredentialsError(
                f"{directory}: no record of where the mesh's authority is: `kvmesh mesh renew --authority HOST` "
                "(the authority's address) renews through it"
            )
        old_key = serialization.load_pem_private_key(current.key_pem, password=None)
        if not isinstance(old_key, ec.EllipticCurvePrivateKey):
            raise CredentialsError(f"{directory}/node.key is not an EC key: join again (`kvmesh mesh join`)")
        answer = membership.request_renewal(
            where,
            mpb.RenewRequest(
                certificate=current.cert_pem,
                csr=csr,
                signature=old_key.sign(authority.RENEW_CONTEXT + csr, ec.ECDSA(hashes.SHA256())),
                days=days,
            ),
        )
        _check_answer(answer.certificate, trust, key_pem, node_id, None)
        cert = answer.certificate
    _store(directory, key_pem, cert)
    return MeshCredentials(trust, key_pem, cert)


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

    None if the node has joined no mesh. A member whose authority cannot be reached keeps its
    current certificate while it lasts (a warning says so); CredentialsError once it has ended.
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
    try:
        return renew(data_dir, node_id, days=days)
    except CredentialsError as e:
        if creds is None or creds.expires <= _now():
            raise
        log.warning(
            "cannot renew this node's certificate yet (it runs to %s): %s", f"{creds.expires:%Y-%m-%d %H:%M} UTC", e
        )
        return creds


def renew_if_unnamed(data_dir: Path, node_id: str, creds: MeshCredentials, *, days: float) -> MeshCredentials:
    """`creds`, renewed once if its certificate lacks its node's own name (an older kvmesh issued
    it), so that peers can pin this node's identity when they dial it; kept when the authority
    cannot renew it now (peers dial it unpinned meanwhile, and say so)."""
    if names_node(creds.cert_pem, node_id):
        return creds
    try:
        renewed = renew(data_dir, node_id, days=days)
    except CredentialsError as e:
        log.warning("this node's certificate holds no name of its own (an older kvmesh issued it), not renewed: %s", e)
        return creds
    log.info("renewed this node's certificate: the new one holds its node's name, so peers pin its identity")
    return renewed


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
        """Renew the certificate if it ends within `renew_before_days`; True when it changed (renewed
        here, or by `kvmesh mesh renew` meanwhile). CredentialsError when it is due and the
        authority cannot renew it (the caller logs it and tries again later; the old one holds)."""
        with self._lock:
            try:
                on_disk = load_credentials(self.data_dir)
            except CredentialsError:
                on_disk = None
            if on_disk is not None and not renewal_due(on_disk, renew_before_days=self.renew_before_days):
                renewed = on_disk
            else:
                renewed = renew(self.data_dir, self.node_id, days=self.days)
            if renewed.cert_pem == self.current.cert_pem:
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
