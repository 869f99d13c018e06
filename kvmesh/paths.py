"""Where kvmesh keeps things by default, in one place: data, config, store, caches, daemon state,
the daemon's log, the measured rates, the remembered file hashes.

Every default can be moved: the data directory by `--data-dir` or `$KVMESH_DATA_DIR`, the file-hash
cache by `$KVMESH_CACHE_DIR`, the config file by `--config`, the store by `--store`.
"""

import os
from pathlib import Path

import platformdirs

APP = "kvmesh"
# Written by a running daemon in its data directory: how the CLI finds it (kvmesh.daemon.control).
STATE_FILE = "daemon.json"
# Written by each running `kvmesh serve` in its data directory, a file each: its URL and model (kvmesh.serve.state).
SERVE_STATE_DIR = "servers"
NODE_ID_FILE = "node-id"


def data_dir() -> Path:
    """The data directory: node id, mesh credentials, the store, the daemon's state file."""
    return Path(os.environ.get("KVMESH_DATA_DIR") or platformdirs.user_data_dir(APP))


def config_file() -> Path:
    return Path(platformdirs.user_config_dir(APP)) / "config.toml"


def cache_dir() -> Path:
    """Things that can be rebuilt: remembered weight-file hashes."""
    return Path(os.environ.get("KVMESH_CACHE_DIR") or platformdirs.user_cache_dir(APP))


def hash_cache_file() -> Path:
    """The weight-file hashes remembered by path, size and mtime (kvmesh.model.fingerprint)."""
    return cache_dir() / "file-hashes.sqlite3"


def store_dir(data: Path | str | None = None) -> Path:
    """The store of a data directory (by default, the default one's)."""
    return Path(data if data is not None else data_dir()) / "store"


def mesh_dir(data: Path | str) -> Path:
    """Mesh credentials: the CA (trust.pem, ca.key) and this node's certificate and key."""
    return Path(data) / "mesh"


def state_file(data: Path | str) -> Path:
    return Path(data) / STATE_FILE


def serve_state_file(data: Path | str, pid: int) -> Path:
    """Where the `kvmesh serve` of process `pid` says, while it runs, at which URL it serves which
    model: a file per server, so that two servers of one data directory keep their own."""
    return Path(data) / SERVE_STATE_DIR / f"{pid}.json"


def node_id_file(data: Path | str) -> Path:
    return Path(data) / NODE_ID_FILE


def daemon_log(data: Path | str) -> Path:
    """Where a daemon started for the CLI, the demo or the tests writes its output."""
    return Path(data) / "daemon.log"


def rates_file(data: Path | str) -> Path:
    """The link and prefill rates this machine measured (kvmesh.reuse.rates.Rates)."""
    return Path(data) / "rates.json"


def coding_times_file(data: Path | str) -> Path:
    """How long this machine's codings on request took, per model (kvmesh.net.on_request)."""
    return Path(data) / "coding-times.json"


def lock_file(data: Path | str) -> Path:
    """Held by the daemon of a data directory for its whole life: one daemon per data directory."""
    return Path(data) / "daemon.lock"
