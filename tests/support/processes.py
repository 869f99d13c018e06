"""Running the `kvmesh` command as a user runs it, and mlx-lm's own command line."""

import os
import subprocess
import sys
from pathlib import Path

# The console script the package installs, beside the interpreter running the tests.
KVMESH = str(Path(sys.executable).with_name("kvmesh"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def cli(*args, data_dir=None, check=True, prefix=(), timeout=300, env=None) -> subprocess.CompletedProcess:
    """`kvmesh [--data-dir DATA_DIR] ARGS` as a user runs it; `prefix` wraps it (`ip netns exec NS`),
    `env` adds environment variables."""
    data = ["--data-dir", str(data_dir)] if data_dir is not None else []
    command = [*prefix, KVMESH, *data, *map(str, args)]
    environment = {**ENV, **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=environment, check=check, timeout=timeout)


def mlx_lm_cli(*args) -> subprocess.CompletedProcess:
    """`python -m mlx_lm ARGS` (mlx-lm's own command line), never raising on failure."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=300
    )


def rss(pid: int, missing: int | None = None) -> int:
    """The resident memory of a process in bytes, from /proc (Linux). A process without one (a zombie)
    raises AssertionError, unless `missing` is given: then that is returned."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    if missing is None:
        raise AssertionError(f"process {pid} has no VmRSS")
    return missing


def start_listening(command: list[str], what: str) -> tuple[subprocess.Popen, str]:
    """`command` in a new process, once it prints `listening on ADDRESS`: (process, address); the
    caller kills it. One that says anything else first is killed, and fails the test."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=ENV)
    line = process.stdout.readline() if process.stdout else ""
    if not line.startswith("listening on "):
        process.kill()
        process.wait()
        raise AssertionError(f"{what} did not start: {line!r}")
    return process, line.split()[-1]
