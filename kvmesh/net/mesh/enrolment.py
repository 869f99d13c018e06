"""Becoming and staying a member: a new mesh (`init_mesh`), a join through the authority's join
port (`join_mesh`), and renewals (`renew`, `renew_if_due`), the workflows on top of the layers below.

`kvmesh mesh init` makes the mesh CA on one Mac, the mesh's authority; the CA key never leaves its
data directory. `kvmesh mesh token` there prints a one-time join token, and `kvmesh mesh join TOKEN
ADDRESS` on another Mac makes that Mac's own key and a CSR, which the authority's daemon signs when
the request proves it holds the token (kvmesh.net.mesh.authority, kvmesh.net.mesh.membership). Each
node then holds a short-lived certificate signed by the CA, for its own node id, and every
connection between peers is mutual TLS: a peer without a certificate of this mesh, or with an
expired one, cannot complete the handshake, and one the authority removed is refused at every call
(kvmesh.net.mesh.admission). Node certificates are renewed before they end (`renew_if_due`, which
the daemon and the network commands call; loading never writes): the authority signs its own,
members ask the authority, proving they hold their current certificate's key.
"""

import hmac
import logging
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from kvmesh.errors import CredentialsError
from kvmesh.net.addresses import DEFAULT_JOIN_PORT, host_port, peer_address, split_host_port
from kvmesh.net.mesh import authority, revocation
from kvmesh.net.mesh.credentials import MeshCredentials, load_credentials, renewal_due, store_node
from kvmesh.net.mesh.layout import MeshDir
from kvmesh.net.mesh.membership import request_join, request_renewal
from kvmesh.net.mesh.pki import (
    NODE_CERT_DAYS,
    RENEW_BEFORE_DAYS,
    check_issued,
    load_key,
    make_ca,
    make_request,
    names_node,
    new_key,
    now,
    pem_key,
)
from kvmesh.v1 import membership_pb2 as mpb

log = logging.getLogger(__name__)


def init_mesh(data_dir: Path, node_id: str, name: str = "", *, days: float = NODE_CERT_DAYS) -> MeshCredentials:
    """Create a new mesh here, with this node as its authority: the CA (whose key stays here) and
    this node's certificate."""
    directory = MeshDir.of(data_dir)
    if directory.joined():
        raise CredentialsError(
            f"{directory.root} already belongs to a mesh; `kvmesh mesh status` says which (another data dir makes "
            "another)"
        )
    key, cert = make_ca(name or node_id)
    directory.write_secret(directory.ca_key, key)
    directory.write(directory.trust, cert)
    return renew(data_dir, node_id, days=days)


def export_bundle(data_dir: Path) -> str:
    """Gone: it copied the CA key to every member, so any member could make any identity."""
    raise CredentialsError(
        "the mesh CA key no longer leaves the authority: run `kvmesh mesh token` there and "
        "`kvmesh mesh join TOKEN ADDRESS` on the new Mac"
    )


def read_authority(data_dir: Path) -> dict[str, str]:
    """{"address": the authority's join address, "node_id": its node id}, as the join stored them."""
    return MeshDir.of(data_dir).read_authority()


def write_authority(data_dir: Path, address: str, node_id: str) -> None:
    MeshDir.of(data_dir).write_authority(address, node_id)


def join_address(text: str) -> str:
    """The authority's join address as a person types it: a host alone means its join port (7078)."""
    address = peer_address(text)
    host, port = split_host_port(address)
    return address if text.strip().endswith(f":{port}") else host_port(host, DEFAULT_JOIN_PORT)


def pending_key(directory: MeshDir) -> bytes:
    """The key of this node's join: the one an earlier join that did not finish sent (kept in
    `directory.pending_key`), or a new one kept there. The authority answers a join again for the
    node's same key, so a join that failed after the authority signed (a lost answer, a wrong
    address or CA fingerprint) can be retried with the same token or a new one."""
    try:
        return directory.pending_key.read_bytes()
    except FileNotFoundError:
        key_pem = pem_key(new_key())
        directory.write_secret(directory.pending_key, key_pem)
        return key_pem


def join_mesh(
    data_dir: Path, node_id: str, token: str, authority_address: str, *, replace: bool = False
) -> MeshCredentials:
    """Join the mesh whose authority made `token`, at `authority_address` (its join port): a new
    key made here, its CSR signed there. The CA certificate the authority answers with must have
    the token's fingerprint, and the certificate must be for this key and node.

    A node that already belongs to another mesh leaves it only with `replace`.
    """
    parsed = authority.JoinToken.parse(token)
    directory = MeshDir.of(data_dir)
    if directory.joined() and not replace:
        raise CredentialsError(
            f"this node already belongs to a mesh ({directory.root}); `kvmesh mesh join --replace` leaves it for "
            "the new one"
        )
    address = join_address(authority_address)
    key_pem, csr = make_request(node_id, pending_key(directory))
    answer = request_join(
        address,
        mpb.JoinRequest(
            token_id=parsed.token_id, csr=csr, proof=authority.join_proof(parsed.secret, parsed.token_id, csr)
        ),
    )
    check_issued(answer.certificate, answer.trust, key_pem, node_id, parsed.ca_fingerprint)
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
    directory = MeshDir.of(data_dir)
    directory.root.mkdir(parents=True, exist_ok=True)
    for stale in directory.of_another_mesh():
        stale.unlink(missing_ok=True)
    directory.write(directory.trust, trust_pem)
    store_node(directory, key_pem, cert_pem)
    directory.pending_key.unlink(missing_ok=True)
    directory.write_authority(authority_address, authority_node_id)
    if revocations:
        signed = revocation.RevocationList.from_bytes(revocations)
        signed.verify(trust_pem)
        revocation.write_list(data_dir, signed)
    return MeshCredentials(trust_pem, key_pem, cert_pem)


def enrol(data_dir: Path, member_dir: Path, node_id: str, *, days: float = NODE_CERT_DAYS) -> MeshCredentials:
    """Admit a Mac whose data dir is on this machine too (the demo, tests) as a join would: a key
    made for it, its CSR signed through a one-time token, and no CA key given to it."""
    token, _ = authority.make_token(data_dir, hours=1)
    key_pem, csr = make_request(node_id)
    cert, _ = authority.admit(
        data_dir, token.token_id, csr, authority.join_proof(token.secret, token.token_id, csr), days=days
    )
    directory = MeshDir.of(data_dir)
    addresses = directory.join_addresses()
    current = revocation.read_list(data_dir)
    return install(
        member_dir,
        directory.trust.read_bytes(),
        key_pem,
        cert,
        addresses[0] if addresses else "",
        authority.own_id(directory),
        current.to_bytes() if current.version else b"",
    )


def renew(data_dir: Path, node_id: str, *, days: float = NODE_CERT_DAYS) -> MeshCredentials:
    """A fresh certificate for this node, valid `days` (at most what the authority grants), with a
    new key: the authority signs its own; a member asks the authority, signing the request with
    its current key. Rotation: peers need nothing new."""
    directory = MeshDir.of(data_dir)
    trust = directory.trust.read_bytes()
    key_pem, csr = make_request(node_id)
    if authority.is_authority(data_dir):
        cert = authority.sign_own(data_dir, csr, days=days)
    else:
        cert = _renewed_by_authority(data_dir, directory, csr, days=days)
        check_issued(cert, trust, key_pem, node_id, None)
    store_node(directory, key_pem, cert)
    return MeshCredentials(trust, key_pem, cert)


def _renewed_by_authority(data_dir: Path, directory: MeshDir, csr: bytes, *, days: float) -> bytes:
    """The certificate the authority signs for a member's `csr`, asked with its current key."""
    current = load_credentials(data_dir)
    where = directory.read_authority().get("address")
    if current is None or not where:
        raise CredentialsError(
            f"{directory.root}: no record of where the mesh's authority is: `kvmesh mesh renew --authority HOST` "
            "(the authority's address) renews through it"
        )
    try:
        old_key = load_key(current.key_pem)
    except CredentialsError:
        raise CredentialsError(f"{directory.node_key} is not an EC key: join again (`kvmesh mesh join`)") from None
    answer = request_renewal(
        where,
        mpb.RenewRequest(
            certificate=current.cert_pem,
            csr=csr,
            signature=old_key.sign(authority.RENEW_CONTEXT + csr, ec.ECDSA(hashes.SHA256())),
            days=days,
        ),
    )
    return answer.certificate


def renew_if_due(
    data_dir: Path, node_id: str, *, days: float = NODE_CERT_DAYS, renew_before_days: float = RENEW_BEFORE_DAYS
) -> MeshCredentials | None:
    """Load this node's credentials, first renewing a certificate that is missing or ends within
    `renew_before_days` (a week) with one valid `days` (30).

    None if the node has joined no mesh. A member whose authority cannot be reached keeps its
    current certificate while it lasts (a warning says so); CredentialsError once it has ended.
    """
    if not MeshDir.of(data_dir).joined():
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
        if creds is None or creds.expires <= now():
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
