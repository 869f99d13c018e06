"""This machine's identity in the mesh: a random id made once and kept with its data."""

import secrets
import socket
from pathlib import Path

from kvmesh.paths import node_id_file


def node_id(data_dir: Path | str) -> str:
    """The node id stored in `data_dir`, created on first use (16 hex digits)."""
    path = node_id_file(data_dir)
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if len(existing) == 16 and all(c in "0123456789abcdef" for c in existing):
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


def host_name() -> str:
    """This machine's name as its owner knows it ("alices-macbook-pro"), for people reading a peer
    list; never resolved, and never trusted for anything (a node is its id and certificate)."""
    return socket.gethostname().removesuffix(".local")
