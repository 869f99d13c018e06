"""Mesh members made directly from the mesh CA, as the authority would sign them: tests of the
network need members, not the joining protocol (the membership tests test that)."""

from pathlib import Path

from kvmesh.net.credentials import MeshCredentials, init_mesh, issue_node_cert, load_credentials
from kvmesh.net.node_id import node_id
from kvmesh.paths import mesh_dir


def make_mesh(authority: Path, *members: Path) -> dict[Path, MeshCredentials]:
    """A mesh whose CA lives in `authority`'s data dir, and a certificate for each of `members` (their
    own node ids, signed by that CA; no CA key of their own); each data dir's credentials."""
    init_mesh(authority, node_id(authority))
    ca = mesh_dir(authority)
    trust = (ca / "trust.pem").read_bytes()
    for data_dir in members:
        key, cert = issue_node_cert((ca / "ca.key").read_bytes(), trust, node_id(data_dir))
        own = mesh_dir(data_dir)
        own.mkdir(parents=True, exist_ok=True)
        (own / "trust.pem").write_bytes(trust)
        (own / "node.key").write_bytes(key)
        (own / "node.key").chmod(0o600)
        (own / "node.pem").write_bytes(cert)
    return {d: member_credentials(d) for d in (authority, *members)}


def member_credentials(data_dir: Path) -> MeshCredentials:
    credentials = load_credentials(data_dir)
    assert credentials is not None, f"{data_dir} belongs to no mesh"
    return credentials


def stranger(data_dir: Path) -> MeshCredentials:
    """Credentials of another mesh (a stranger's own), in `data_dir`."""
    return init_mesh(data_dir, node_id(data_dir))
