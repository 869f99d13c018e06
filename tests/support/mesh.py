"""Meshes made in a test's data dirs: one authority and its members, admitted as a join admits them
(the membership tests test the joining protocol itself), or a stranger's mesh of its own."""

from pathlib import Path

from kvmesh.net.mesh.credentials import MeshCredentials, load_credentials
from kvmesh.net.mesh.enrolment import enrol, init_mesh
from kvmesh.net.node_id import node_id


def make_mesh(authority: Path, *members: Path) -> dict[Path, MeshCredentials]:
    """A new mesh made in `authority` (which keeps the CA key), each of `members` admitted to it (its
    own key, and a certificate for its own node id; no CA key); each data dir's credentials."""
    init_mesh(authority, node_id(authority))
    for member in members:
        enrol(authority, member, node_id(member))
    return {d: member_credentials(d) for d in (authority, *members)}


def member_credentials(data_dir: Path) -> MeshCredentials:
    credentials = load_credentials(data_dir)
    assert credentials is not None, f"{data_dir} belongs to no mesh"
    return credentials


def stranger(data_dir: Path) -> MeshCredentials:
    """Credentials of another mesh (a stranger's own), in `data_dir`."""
    return init_mesh(data_dir, node_id(data_dir))
