"""The mesh's public-key parts: keys, the CA and node certificates, CSRs, and their checks.

Node certificates are short-lived, signed by the mesh CA, usable as server and client, and name the
shared host SERVER_NAME and their node's own name (`node_name`). Nothing here reads or writes a
file or touches the network: the mesh directory (kvmesh.net.mesh.layout) and the workflows on top
(kvmesh.net.mesh.enrolment, kvmesh.net.mesh.authority) do.
"""

import datetime
import hashlib
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.errors import CredentialsError

# Every node certificate names this host, and its node's own (`node_name`): a client that knows
# which node it dials checks for that one, so no other member (a removed one) can answer for it.
SERVER_NAME = "kvmesh.mesh"
NODE_CERT_DAYS = 30
RENEW_BEFORE_DAYS = 7
# A node certificate lasting longer than this is refused by every member (kvmesh.net.mesh.admission).
MAX_CERT_DAYS = 31


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    """The node key in `key_pem`; CredentialsError when it is not an EC key."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("a kvmesh node key is an EC key: this one is not (delete it and join again)")
    return key


def load_ca_key(ca_key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("the mesh CA key is not an EC key: was it made by `kvmesh mesh init`?")
    return key


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


def common_name(cert: x509.Certificate | x509.CertificateSigningRequest) -> str:
    """The subject's common name (a node id), "" when it has none."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def ca_fingerprint(trust_pem: bytes) -> bytes:
    """SHA-256 of the DER of the newest (last) CA certificate in `trust_pem`: what a join token pins."""
    cert = x509.load_pem_x509_certificates(trust_pem)[-1]
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def key_id(public_key: Any) -> str:
    """The SHA-256 of a public key (its DER SubjectPublicKeyInfo), in hex: which key a member holds."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def make_ca(name: str, days: int = 3650) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) of a new mesh CA."""
    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh mesh {name}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now() - datetime.timedelta(minutes=5))
        .not_valid_after(now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return pem_key(key), cert.public_bytes(serialization.Encoding.PEM)


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
    ca_key = load_ca_key(ca_key_pem)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    start = not_before or now() - datetime.timedelta(minutes=5)
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
    key = new_key()
    return pem_key(key), sign_node_cert(ca_key_pem, ca_cert_pem, node_id, key.public_key(), not_before, days)


def make_request(node_id: str, key_pem: bytes | None = None) -> tuple[bytes, bytes]:
    """(key PEM, CSR DER) for `node_id` of `key_pem` (default: a new key): what a node sends to be
    signed; the key stays here."""
    key = new_key() if key_pem is None else load_key(key_pem)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return pem_key(key), csr.public_bytes(serialization.Encoding.DER)


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether `ca` signed `cert` directly."""
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def check_issued(cert_pem: bytes, trust_pem: bytes, key_pem: bytes, node_id: str, fingerprint: bytes | None) -> None:
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
    if key_id(cert.public_key()) != key_id(key.public_key()) or common_name(cert) != node_id:
        raise CredentialsError("the authority's certificate is not for this node's key and id")
    if not any(issued_by(cert, ca) for ca in cas):
        raise CredentialsError("the authority's certificate is not signed by the mesh CA")
