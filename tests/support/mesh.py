"""Meshes made in a test's data dirs: one authority and its members, or a stranger's mesh of its own."""

from pathlib import Path

from kvmesh.net.authority import enrol
from kvmesh.net.credentials import init_mesh
from kvmesh.net.node_id import node_id


def make_mesh(authority: Path, *members: Path) -> None:
    """A new mesh made in `authority` (which keeps the CA key), each of `members` admitted to it."""
    init_mesh(authority, node_id(authority))
    for member in members:
        enrol(authority, member, node_id(member))


def stranger(data_dir: Path) -> None:
    """A node of a mesh of its own: it holds certificates, none of them this mesh's."""
    init_mesh(data_dir, node_id(data_dir))
