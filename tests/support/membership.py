"""Membership tests: an authority's join address, joining through its daemon, and the
certificates a misbehaving member (or a leaked CA key) would make."""

import datetime
import json
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.net.mesh.authority import make_token
from kvmesh.net.mesh.credentials import MeshCredentials, load_credentials
from kvmesh.net.mesh.enrolment import join_mesh
from kvmesh.net.mesh.pki import SERVER_NAME
from kvmesh.net.node_id import node_id
from kvmesh.paths import mesh_dir


def join_address(authority_dir: Path) -> str:
    """Where the authority's running daemon takes joins (it writes mesh/join.json once it serves)."""
    return json.loads((mesh_dir(authority_dir) / "join.json").read_text())["addresses"][0]


def join(authority_dir: Path, member_dir: Path) -> MeshCredentials:
    """`member_dir` joins through the authority's running daemon, with a fresh token."""
    token, _ = make_token(authority_dir)
    return join_mesh(member_dir, node_id(member_dir), str(token), join_address(authority_dir))


def credentials(data_dir: Path) -> MeshCredentials:
    creds = load_credentials(data_dir)
    assert creds is not None, f"{data_dir} belongs to no mesh"
    return creds


def minted(member: MeshCredentials, identity: str, *, chain: bool = False) -> MeshCredentials:
    """A certificate for `identity` that a member makes with its own node key (all it has: no CA key),
    naming the mesh CA as its issuer; with `chain`, sent with the member's own certificate as if that
    were an intermediate CA."""
    signer = serialization.load_pem_private_key(member.key_pem, password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificates(member.trust_pem)[-1]
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
        .issuer_name(x509.load_pem_x509_certificate(member.cert_pem).subject if chain else ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=36500))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(signer, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM) + (member.cert_pem if chain else b"")
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return MeshCredentials(member.trust_pem, key_pem, pem)


def make_legacy(authority_dir: Path, member_dir: Path) -> None:
    """Give the member a certificate as kvmesh issued them before node names: for its own key and
    node id, signed by the mesh CA, naming only the mesh-wide SERVER_NAME."""
    ca = mesh_dir(authority_dir)
    ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificates((ca / "trust.pem").read_bytes())[-1]
    key = serialization.load_pem_private_key((mesh_dir(member_dir) / "node.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id(member_dir))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (mesh_dir(member_dir) / "node.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
