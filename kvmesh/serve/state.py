"""`kvmesh serve`'s state files (servers/<pid>.json in its data directory): its URL and model, while it runs.

Tests, benchmarks and scripts read where a server listens from here, as the CLI reads a daemon's
daemon.json, instead of parsing a line printed for people. Each server writes its own file
atomically once its socket listens (a reader that finds it can connect) and removes it when it
stops, so two servers of one data directory (on two ports) never overwrite or remove each other's.
A server that was killed leaves its file behind: readers skip files whose process is gone.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.daemon.control import process_running
from kvmesh.errors import KvmeshError
from kvmesh.files.atomic import write_atomic
from kvmesh.paths import serve_state_file


@dataclass(frozen=True)
class ServeState:
    """What a server's state file says."""

    pid: int
    url: str  # the OpenAI API's base URL, e.g. http://127.0.0.1:8080/v1
    model: str  # the served model's name (GET /v1/models)
    model_id: str  # its fingerprint's model id (the mesh's name for it)
    mesh: str  # how its prompt cache reaches the mesh, in words


def write_serve_state(data_dir: Path | str, state: ServeState) -> Path:
    """Atomically: a reader sees the whole file or none."""
    path = serve_state_file(data_dir, state.pid)
    write_atomic(path, json.dumps(asdict(state)))
    return path


def serve_states(data_dir: Path | str) -> list[ServeState]:
    """The servers of `data_dir` that run now, the most recently started last."""
    folder = serve_state_file(data_dir, 0).parent
    states = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns) if folder.is_dir() else []:
        try:
            state = ServeState(**json.loads(path.read_text()))
        except FileNotFoundError:  # (it stopped meanwhile)
            continue
        except (ValueError, TypeError) as e:
            raise KvmeshError(f"{path}: unreadable server state: {e}") from e
        if process_running(state.pid):
            states.append(state)
    return states


def read_serve_state(data_dir: Path | str, pid: int | None = None) -> ServeState:
    """The state of the server of `data_dir` of process `pid` (by default, the one started last);
    KvmeshError if none runs."""
    states = [s for s in serve_states(data_dir) if pid is None or s.pid == pid]
    if not states:
        which = f" as process {pid}" if pid is not None else ""
        raise KvmeshError(f"no kvmesh serve is running{which} for {data_dir}")
    return states[-1]


def remove_serve_state(data_dir: Path | str) -> None:
    """Remove this process's state file."""
    serve_state_file(data_dir, os.getpid()).unlink(missing_ok=True)
