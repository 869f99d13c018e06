"""This machine's identity in the mesh: a random id made once and kept with its data."""

import secrets
import socket
from pathlib import Path

from kvmesh.errors import KvmeshError
from kvmesh.files.atomic import write_atomic
from kvmesh.paths import node_id_file


def stored_node_id(data_dir: Path | str) -> str | None:
    """The node id stored in `data_dir`, or None when none was made yet: writes nothing, so a
    command that needs an id only if this node has one (mesh credentials) runs on a read-only data dir."""
    try:
        existing = node_id_file(data_dir).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return existing if len(existing) == 16 and all(c in "0123456789abcdef" for c in existing) else None


def node_id(data_dir: Path | str) -> str:
    """The node id stored in `data_dir`, created on first use (16 hex digits); KvmeshError, in one
    line, when the data dir cannot take it (read-only)."""
    if existing := stored_node_id(data_dir):
        return existing
    path = node_id_file(data_dir)
    new = secrets.token_hex(8)
    try:
        write_atomic(path, new + "\n", durable=True)
    except OSError as e:
        raise KvmeshError(
            f"cannot keep this node's id in {path.parent}: {e.strerror or e}; give a writable --data-dir "
            "(or $KVMESH_DATA_DIR)"
        ) from None
    return new


def host_name() -> str:
    """This machine's name as its owner knows it ("alices-macbook-pro"), for people reading a peer
    list; never resolved, and never trusted for anything (a node is its id and certificate)."""
    return socket.gethostname().removesuffix(".local")
