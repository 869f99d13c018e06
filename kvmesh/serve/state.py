"""`kvmesh serve`'s state file (serve.json in its data directory): its URL and model, while it runs.

Tests, benchmarks and scripts read where a server listens from here, as the CLI reads a daemon's
daemon.json, instead of parsing a line printed for people. Written atomically once the socket
listens (a reader that finds it can connect), removed when the server stops.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.errors import KvmeshError
from kvmesh.paths import serve_state_file


@dataclass(frozen=True)
class ServeState:
    """What serve.json says."""

    pid: int
    url: str  # the OpenAI API's base URL, e.g. http://127.0.0.1:8080/v1
    model: str  # the served model's name (GET /v1/models)
    model_id: str  # its fingerprint's model id (the mesh's name for it)
    mesh: str  # how its prompt cache reaches the mesh, in words


def write_serve_state(data_dir: Path | str, state: ServeState) -> Path:
    """Atomically: a reader sees the whole file or none."""
    path = serve_state_file(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state)))
    tmp.replace(path)
    return path


def read_serve_state(data_dir: Path | str) -> ServeState:
    """The state of the server of `data_dir`; KvmeshError if none wrote one."""
    path = serve_state_file(data_dir)
    try:
        return ServeState(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise KvmeshError(f"no kvmesh serve is running for {data_dir}") from None
    except (ValueError, TypeError) as e:
        raise KvmeshError(f"{path}: unreadable server state: {e}") from e


def remove_serve_state(data_dir: Path | str) -> None:
    """Remove serve.json if this process wrote it (a second server of the directory may have since)."""
    path = serve_state_file(data_dir)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (FileNotFoundError, ValueError):
        pass
