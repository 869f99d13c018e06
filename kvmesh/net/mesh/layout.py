"""The mesh directory, `<data dir>/mesh/`: every file a node keeps of its mesh, named once here.

A member holds its trusted CA certificate(s) (`trust.pem`), its key and certificate (`node.key`,
`node.pem`), where its authority is (`authority.json`), the revocation list it enforces
(`revocations.json`), and, while a join has not finished, the key that join sends
(`join-pending.key`). The authority holds, beside those, the CA key (`ca.key`), its tokens and
members (`tokens.json`, `members.json`, changed under `authority.lock`) and, while its daemon runs,
where that daemon takes joins (`join.json`). Every write is atomic (kvmesh.files.atomic): a daemon
and a command reading at once see the old file or the new one; secrets are this user's only.
These names are on disk in meshes made by every earlier kvmesh: they do not change.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from kvmesh.files.atomic import write_atomic
from kvmesh.paths import mesh_dir

SECRET = 0o600


@dataclass(frozen=True)
class MeshDir:
    """The files of one data dir's mesh directory (`root`)."""

    root: Path

    @staticmethod
    def of(data_dir: Path) -> "MeshDir":
        return MeshDir(mesh_dir(data_dir))

    @property
    def trust(self) -> Path:
        """The mesh CA certificate(s) this node trusts: it belongs to a mesh when this exists."""
        return self.root / "trust.pem"

    @property
    def node_key(self) -> Path:
        return self.root / "node.key"

    @property
    def node_cert(self) -> Path:
        return self.root / "node.pem"

    @property
    def ca_key(self) -> Path:
        """The mesh CA key: on the authority only."""
        return self.root / "ca.key"

    @property
    def tokens(self) -> Path:
        """The authority's join tokens: each one's secret, expiry, and when and by whom it was used."""
        return self.root / "tokens.json"

    @property
    def members(self) -> Path:
        """The authority's record of every node it issued a certificate to."""
        return self.root / "members.json"

    @property
    def lock(self) -> Path:
        """What the authority locks while it changes `tokens` and `members`."""
        return self.root / "authority.lock"

    @property
    def join(self) -> Path:
        """Where the authority's running daemon takes joins."""
        return self.root / "join.json"

    @property
    def authority(self) -> Path:
        """Where a member's authority takes joins and renewals, and its node id."""
        return self.root / "authority.json"

    @property
    def revocations(self) -> Path:
        return self.root / "revocations.json"

    @property
    def pending_key(self) -> Path:
        """The key a join sends until it has joined."""
        return self.root / "join-pending.key"

    def joined(self) -> bool:
        return self.trust.exists()

    def holds_ca_key(self) -> bool:
        return self.ca_key.exists()

    def of_another_mesh(self) -> tuple[Path, ...]:
        """What a node that joins a new mesh (`--replace`) removes of the one it leaves: the CA key too
        when it was that mesh's authority."""
        return (self.revocations, self.authority, self.ca_key, self.tokens, self.members, self.join)

    def write(self, path: Path, data: bytes | str) -> None:
        """Write one of this directory's public files (certificates, lists, addresses), atomically."""
        write_atomic(path, data, durable=True)

    def write_secret(self, path: Path, data: bytes | str) -> None:
        """Write a secret (a key, the tokens, the members), atomically and readable by this user only."""
        write_atomic(path, data, mode=SECRET, durable=True)

    def read_authority(self) -> dict[str, str]:
        """{"address": the authority's join address, "node_id": its node id}, as the join stored them."""
        try:
            return json.loads(self.authority.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def write_authority(self, address: str, node_id: str) -> None:
        self.write(self.authority, json.dumps({"address": address, "node_id": node_id}))

    def join_addresses(self) -> list[str]:
        """Where the authority's running daemon takes joins (none when it runs no daemon)."""
        try:
            return list(json.loads(self.join.read_text())["addresses"])
        except (FileNotFoundError, ValueError, KeyError):
            return []

    def write_join_addresses(self, addresses: list[str]) -> None:
        write_atomic(self.join, json.dumps({"addresses": addresses}))
