"""The mesh's authority: the one Mac that holds the CA key, and what only it can do.

It makes one-time join tokens (`kvmesh mesh token`), signs a joining Mac's CSR when it proves it
holds one, re-signs a member's CSR when the member proves it holds its current certificate's key,
and removes members (`kvmesh mesh remove`: a new signed revocation list). Members never see the CA
key, so no member can make a certificate for another identity, or one that outlasts the mesh's
limit: identities, rate limits and publisher rights are the authority's to give.

Its state lives in `<data dir>/mesh/` beside the CA key, readable by its owner only: `tokens.json`
(each token's secret, expiry, and when and by which node it was used) and `members.json` (every node
id it issued a certificate to, the serials, and the key it last signed for it). Changes to them are
made under a file lock, so a token is redeemed once even when two joins race, or when the daemon and
a command write at once.
"""

import base64
import contextlib
import datetime
import fcntl
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvmesh.errors import CredentialsError
from kvmesh.net.mesh import revocation
from kvmesh.net.mesh.layout import MeshDir
from kvmesh.net.mesh.pki import ca_fingerprint, common_name, issued_by, key_id, now, sign_node_cert

TOKEN_PREFIX = "kvmesh-join-v1:"
JOIN_CONTEXT = b"kvmesh-join-v1"
JOIN_REPLY_CONTEXT = b"kvmesh-join-v1-reply"
RENEW_CONTEXT = b"kvmesh-renew-v1"
DEFAULT_TOKEN_HOURS = 24.0


class NotAuthority(CredentialsError):
    """This node does not hold the mesh CA key, so it cannot do what only the authority does."""


class JoinRefused(CredentialsError):
    """The authority refuses a join or a renewal (the message says why and what to do)."""


@dataclass(frozen=True)
class JoinToken:
    """A one-time join token: a public id, a secret, and the mesh CA's fingerprint (the joiner's pin)."""

    token_id: str
    secret: bytes
    ca_fingerprint: bytes

    def __str__(self) -> str:
        return TOKEN_PREFIX + ".".join((self.token_id, _b64(self.secret), _b64(self.ca_fingerprint)))

    @staticmethod
    def parse(text: str) -> "JoinToken":
        try:
            text = text.strip()
            if not text.startswith(TOKEN_PREFIX):
                raise ValueError(f"it does not start with {TOKEN_PREFIX}")
            token_id, secret, fingerprint = text[len(TOKEN_PREFIX) :].split(".")
            token = JoinToken(token_id, _unb64(secret), _unb64(fingerprint))
            if len(token.secret) < 16 or len(token.ca_fingerprint) != 32 or not token_id:
                raise ValueError("a part of it is too short")
            return token
        except ValueError as e:
            raise CredentialsError(
                f"not a kvmesh join token ({e}): copy the whole line `kvmesh mesh token` printed"
            ) from None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def join_proof(secret: bytes, token_id: str, csr_der: bytes) -> bytes:
    """What a joiner sends instead of the secret: the secret never crosses the network."""
    return hmac.new(secret, JOIN_CONTEXT + token_id.encode() + csr_der, hashlib.sha256).digest()


def reply_proof(secret: bytes, certificate: bytes, trust: bytes) -> bytes:
    """The authority's proof to the joiner that the answer comes from whoever made the token."""
    return hmac.new(secret, JOIN_REPLY_CONTEXT + certificate + trust, hashlib.sha256).digest()


def is_authority(data_dir: Path) -> bool:
    return MeshDir.of(data_dir).holds_ca_key()


def _require_authority(data_dir: Path, what: str) -> MeshDir:
    directory = MeshDir.of(data_dir)
    if not directory.holds_ca_key():
        raise NotAuthority(
            f"only the mesh's authority (the Mac that ran `kvmesh mesh init`) can {what}: this node holds no CA key"
        )
    return directory


@contextlib.contextmanager
def _locked(directory: MeshDir) -> Iterator[None]:
    with open(directory.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise CredentialsError(f"{path}: unreadable ({e}); the authority's state is damaged") from None


def _write_json(directory: MeshDir, path: Path, data: dict[str, Any]) -> None:
    directory.write_secret(path, json.dumps(data, indent=1, sort_keys=True).encode())


def make_token(data_dir: Path, hours: float = DEFAULT_TOKEN_HOURS) -> tuple[JoinToken, datetime.datetime]:
    """A new one-time join token, valid `hours`, and when it expires."""
    directory = _require_authority(data_dir, "make join tokens")
    token = JoinToken(
        secrets.token_hex(4),
        secrets.token_bytes(16),
        ca_fingerprint(directory.trust.read_bytes()),
    )
    expires = now() + datetime.timedelta(hours=hours)
    with _locked(directory):
        tokens = _read_json(directory.tokens)
        # Expired tokens are forgotten as new ones are made.
        tokens = {k: v for k, v in tokens.items() if datetime.datetime.fromisoformat(v["expires"]) > now()}
        tokens[token.token_id] = {"secret": _b64(token.secret), "expires": expires.isoformat(), "used": ""}
        _write_json(directory, directory.tokens, tokens)
    return token, expires


def _check_csr(csr_der: bytes) -> tuple[x509.CertificateSigningRequest, str]:
    """The CSR and the node id it asks for; JoinRefused if it is malformed or not self-signed."""
    try:
        csr = x509.load_der_x509_csr(csr_der)
    except ValueError:
        raise JoinRefused("the request holds no valid CSR") from None
    if not csr.is_signature_valid:
        raise JoinRefused("the CSR is not signed by its own key")
    if not isinstance(csr.public_key(), ec.EllipticCurvePublicKey):
        raise JoinRefused("the CSR's key is not an EC key")
    node_id = common_name(csr)
    if len(node_id) != 16 or any(c not in "0123456789abcdef" for c in node_id):
        raise JoinRefused(f"the CSR names {node_id!r}, not a node id (16 hex digits)")
    return csr, node_id


def _sign(directory: MeshDir, csr: x509.CertificateSigningRequest, node_id: str, days: float) -> bytes:
    """Sign the CSR, and record the member's serials and current key (`members.json`)."""
    trust = directory.trust.read_bytes()
    signer = x509.load_pem_x509_certificates(trust)[-1].public_bytes(serialization.Encoding.PEM)
    cert = sign_node_cert(directory.ca_key.read_bytes(), signer, node_id, csr.public_key(), days=days)
    members = _read_json(directory.members)
    entry = members.setdefault(node_id, {"joined": now().isoformat(timespec="seconds"), "serials": []})
    entry["serials"] = [*entry["serials"], str(x509.load_pem_x509_certificate(cert).serial_number)][-10:]
    entry["key"] = key_id(csr.public_key())
    _write_json(directory, directory.members, members)
    return cert


def admit(data_dir: Path, token_id: str, csr_der: bytes, proof: bytes, *, days: float) -> tuple[bytes, bytes]:
    """Redeem a join token for the CSR's node: (its certificate PEM, the HMAC of the reply).

    The token is used up only when a certificate is issued: a wrong proof or a bad CSR leaves it
    for the real joiner. A node id already issued with another key, or removed, is refused: no join
    can take over another member's identity. A join of a member with the very key the authority
    last signed for it (the CSR proves the joiner holds it) is answered again, with the token that
    admitted it or a new one: that Mac's earlier join failed after the authority signed (its answer
    lost, or refused by the joiner: a wrong address or CA fingerprint), and it may retry.
    """
    directory = _require_authority(data_dir, "admit a new Mac")
    with _locked(directory):
        tokens = _read_json(directory.tokens)
        entry = tokens.get(token_id)
        if entry is None:
            raise JoinRefused("unknown join token: make a new one on the authority (`kvmesh mesh token`)")
        secret = _unb64(entry["secret"])
        if not hmac.compare_digest(join_proof(secret, token_id, csr_der), proof):
            raise JoinRefused("the join token does not match: copy the whole line `kvmesh mesh token` printed")
        csr, node_id = _check_csr(csr_der)
        again = _joined_with(directory, node_id, key_id(csr.public_key()))
        if entry["used"] and not (again and entry.get("node") == node_id):
            raise JoinRefused(
                f"this join token was used at {entry['used']}: make a new one on the authority (`kvmesh mesh token`)"
            )
        if datetime.datetime.fromisoformat(entry["expires"]) <= now():
            raise JoinRefused(f"this join token expired at {entry['expires']}: make a new one (`kvmesh mesh token`)")
        if node_id in revocation.read_list(data_dir).node_ids:
            raise JoinRefused(
                f"node {node_id} was removed from this mesh: give the Mac a new node id (delete the node-id file "
                "in its kvmesh data dir) and join again"
            )
        if not again and node_id in _read_json(directory.members):
            raise JoinRefused(
                f"node {node_id} is already a member, with another key: a member renews, it does not join; a Mac "
                "that is not that member needs a new node id (delete the node-id file in its kvmesh data dir) to join"
            )
        if not entry["used"]:
            entry["used"], entry["node"] = now().isoformat(timespec="seconds"), node_id
            _write_json(directory, directory.tokens, tokens)
        cert = _sign(directory, csr, node_id, days)
    return cert, secret


def _joined_with(directory: MeshDir, node_id: str, key: str) -> bool:
    """Whether the authority admitted `node_id` and last signed a certificate for `key` (its join
    went wrong after it was signed, and it tries again)."""
    entry = _read_json(directory.members).get(node_id)
    return entry is not None and not entry.get("removed") and entry.get("key") == key


def renew_member(data_dir: Path, cert_pem: bytes, csr_der: bytes, signature: bytes, *, days: float) -> bytes:
    """A fresh certificate for a member that proves it holds its current one's key.

    The current certificate must be this CA's, unexpired, and of a node not removed; the CSR must
    name the same node. Expired members join again with a new token.
    """
    directory = _require_authority(data_dir, "renew certificates")
    trust = directory.trust.read_bytes()
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise JoinRefused("the renewal names no valid certificate") from None
    if not any(issued_by(cert, ca) for ca in x509.load_pem_x509_certificates(trust)):
        raise JoinRefused("the certificate to renew was not issued by this mesh's CA")
    if not cert.not_valid_before_utc <= now() <= cert.not_valid_after_utc:
        raise JoinRefused(
            f"the certificate to renew ended at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC: join again with a "
            "new token (`kvmesh mesh token` on the authority)"
        )
    node_id = common_name(cert)
    key = cert.public_key()
    try:
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise InvalidSignature
        key.verify(signature, RENEW_CONTEXT + csr_der, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise JoinRefused("the renewal is not signed by the key of the certificate it renews") from None
    csr, wanted = _check_csr(csr_der)
    if wanted != node_id:
        raise JoinRefused(f"a renewal of {node_id}'s certificate asks for {wanted}'s")
    if node_id in revocation.read_list(data_dir).node_ids:
        raise JoinRefused(f"node {node_id} was removed from this mesh")
    with _locked(directory):
        if node_id not in _read_json(directory.members):
            raise JoinRefused(f"node {node_id} is not a member this authority admitted")
        return _sign(directory, csr, node_id, days)


def members(data_dir: Path) -> dict[str, dict[str, Any]]:
    """Every node the authority admitted: {node id: {"joined": ..., "serials": [...]}}."""
    return _read_json(_require_authority(data_dir, "list members").members)


def remove(data_dir: Path, node_id: str) -> revocation.RevocationList:
    """Remove a member (a node id, or the unique start of one): the next revocation list, signed
    and written; the authority's daemon and then every member adopt it."""
    directory = _require_authority(data_dir, "remove members")
    with _locked(directory):
        known = _read_json(directory.members)
        matches = [n for n in known if n.startswith(node_id)] if node_id else []
        if len(matches) > 1:
            raise CredentialsError(f"{node_id!r} is the start of several members' ids: {', '.join(sorted(matches))}")
        if matches:
            node_id = matches[0]
        elif len(node_id) != 16:
            raise CredentialsError(f"no member {node_id!r}: `kvmesh mesh members` lists them")
        if own_id(directory) == node_id:
            raise CredentialsError("the authority cannot remove itself: make a new mesh instead (`kvmesh mesh init`)")
        current = revocation.read_list(data_dir)
        if node_id in current.node_ids:
            return current
        signed = revocation.sign_list(directory.ca_key.read_bytes(), current.version + 1, (*current.node_ids, node_id))
        revocation.write_list(data_dir, signed)
        if node_id in known:
            known[node_id]["removed"] = now().isoformat(timespec="seconds")
            _write_json(directory, directory.members, known)
        return signed


def sign_own(data_dir: Path, csr_der: bytes, *, days: float) -> bytes:
    """The authority's own certificate, from its CSR: it renews without asking anyone."""
    directory = _require_authority(data_dir, "sign its own certificate")
    csr, node_id = _check_csr(csr_der)
    with _locked(directory):
        return _sign(directory, csr, node_id, days)


def own_id(directory: MeshDir) -> str:
    """The node id of the authority's own certificate."""
    return common_name(x509.load_pem_x509_certificate(directory.node_cert.read_bytes()))
