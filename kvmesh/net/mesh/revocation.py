"""The mesh's revocation list: the node ids the authority removed, signed by the CA key.

`kvmesh mesh remove NODE` on the authority writes a new list with the next version number. Members
carry it: each asks its peers for a newer one now and then (kvmesh.net.mesh.gossip) and adopts one
only if the mesh CA signed it and its version is higher than the one it holds, so a member can
neither forge a list nor roll one back. Every member refuses calls from a listed node
(kvmesh.net.mesh.admission). Node ids, not certificate serials, are listed: a removed Mac is out for good,
whatever certificate it still holds.
"""

import base64
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from kvmesh.errors import CredentialsError
from kvmesh.net.mesh.layout import MeshDir
from kvmesh.net.mesh.pki import load_ca_key, now

log = logging.getLogger(__name__)
FORMAT = "kvmesh-revocations-v1"


@dataclass(frozen=True)
class RevocationList:
    """Version `version` of the list: the removed node ids, and the CA's signature of them."""

    version: int
    node_ids: tuple[str, ...]
    issued: str  # ISO 8601, for people
    signature: bytes

    def payload(self) -> bytes:
        """The bytes the CA signs: everything but the signature, canonically."""
        fields = {"format": FORMAT, "version": self.version, "node_ids": sorted(self.node_ids), "issued": self.issued}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_bytes(self) -> bytes:
        document = json.loads(self.payload())
        document["signature"] = base64.b64encode(self.signature).decode()
        return json.dumps(document, sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "RevocationList":
        """Parse a list (unchecked: `verify` says whether the CA signed it)."""
        try:
            document = json.loads(data)
            if document.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} document")
            return RevocationList(
                int(document["version"]),
                tuple(str(n) for n in document["node_ids"]),
                str(document["issued"]),
                base64.b64decode(document["signature"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CredentialsError(f"not a kvmesh revocation list: {e}") from None

    def verify(self, trust_pem: bytes) -> None:
        """CredentialsError unless one of the mesh CA certificates in `trust_pem` signed this list."""
        for ca in x509.load_pem_x509_certificates(trust_pem):
            key = ca.public_key()
            if not isinstance(key, ec.EllipticCurvePublicKey):
                continue
            try:
                key.verify(self.signature, self.payload(), ec.ECDSA(hashes.SHA256()))
                return
            except InvalidSignature:
                continue
        raise CredentialsError(f"revocation list version {self.version} is not signed by this mesh's CA: ignored")


EMPTY = RevocationList(0, (), "", b"")


def sign_list(ca_key_pem: bytes, version: int, node_ids: tuple[str, ...]) -> RevocationList:
    """A list of `node_ids` at `version`, signed with the CA key (on the authority only)."""
    key = load_ca_key(ca_key_pem)
    issued = now().isoformat(timespec="seconds")
    unsigned = RevocationList(version, tuple(sorted(set(node_ids))), issued, b"")
    return RevocationList(
        unsigned.version, unsigned.node_ids, issued, key.sign(unsigned.payload(), ec.ECDSA(hashes.SHA256()))
    )


def list_path(data_dir: Path) -> Path:
    return MeshDir.of(data_dir).revocations


def read_list(data_dir: Path) -> RevocationList:
    """The list this node holds (EMPTY when it holds none), as written: `Revocations` checks it."""
    try:
        return RevocationList.from_bytes(list_path(data_dir).read_bytes())
    except FileNotFoundError:
        return EMPTY


def write_list(data_dir: Path, revocations: RevocationList) -> None:
    """Atomically: a reader (a daemon, a command) sees the old list or the new one."""
    directory = MeshDir.of(data_dir)
    directory.write(directory.revocations, revocations.to_bytes())


class Revocations:
    """The revocation list a daemon holds and enforces: the newest valid one it has seen, on disk
    too, so a restart keeps it. Thread-safe: the server's calls read it as the gossip adopts.

    `own_id`: this node's id, so that a list removing it says so in the log. `on_adopting` is called
    with each newer list as it is taken, before this node enforces it (the daemon pushes it on to its
    peers then, the ones it removes among them: kvmesh.net.mesh.gossip).
    """

    def __init__(self, data_dir: Path, trust_pem: bytes, own_id: str = ""):
        self.data_dir, self.trust_pem, self.own_id = data_dir, trust_pem, own_id
        self._lock = threading.Lock()
        self._mtime_ns = -1
        self.current = EMPTY
        self.on_adopting: Callable[[RevocationList], None] | None = None
        self.reload()

    @property
    def version(self) -> int:
        return self.current.version

    def revoked(self, node_id: str) -> bool:
        return node_id in self.current.node_ids

    def reload(self) -> bool:
        """Take the list on disk if it changed (`kvmesh mesh remove` on the authority writes it
        there): True when a newer one was adopted."""
        try:
            mtime = list_path(self.data_dir).stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime == self._mtime_ns:
            return False
        self._mtime_ns = mtime
        try:
            return self.adopt(list_path(self.data_dir).read_bytes(), source="this node's data dir", persist=False)
        except OSError as e:
            log.warning("cannot read the revocation list in %s: %s", self.data_dir, e.strerror or e)
            return False

    def adopt(self, data: bytes, *, source: str, persist: bool = True) -> bool:
        """Take `data` if it is a list the mesh CA signed, newer than the one held: True when taken.

        A forged, damaged or older list is ignored (and logged): a member cannot unrevoke anyone.
        """
        if not data:
            return False
        try:
            candidate = RevocationList.from_bytes(data)
            if candidate.version <= self.current.version:
                return False
            candidate.verify(self.trust_pem)
        except CredentialsError as e:
            log.warning("revocation list from %s refused: %s", source, e)
            return False
        with self._lock:
            if candidate.version <= self.current.version:
                return False
            if persist:
                write_list(self.data_dir, candidate)
            newly = sorted(set(candidate.node_ids) - set(self.current.node_ids))
            if self.on_adopting is not None:
                self.on_adopting(candidate)
            self.current = candidate
        log.info(
            "revocation list version %d from %s: %s removed from the mesh",
            candidate.version,
            source,
            ", ".join(newly) or "no node newly",
        )
        if self.own_id in newly:
            log.warning(
                "this node (%s) was removed from the mesh by its authority (revocation list version %d): "
                "its members refuse its calls from now on",
                self.own_id,
                candidate.version,
            )
        return True
