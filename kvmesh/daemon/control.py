"""Reaching the local daemon: its state file, its loopback Control service, and starting one.

A running daemon writes `daemon.json` in its data directory (pid, node id, control and listen
addresses, store) once it serves, and removes it when it stops. The CLI, the demo, the tests and
the benchmarks find a daemon through that file, never by parsing what it prints. Needs no MLX.
"""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from kvmesh.errors import DaemonNotRunning, KvmeshError
from kvmesh.files.atomic import write_atomic
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.paths import daemon_log, state_file
from kvmesh.v1 import control_pb2 as cpb
from kvmesh.v1 import control_pb2_grpc

T = TypeVar("T")


@dataclass(frozen=True)
class DaemonState:
    """What daemon.json says: how the CLI reaches a running daemon."""

    pid: int
    node_id: str
    control: str
    listen: list[str]
    store: str
    # "mutual TLS", or "loopback only, no mesh credentials".
    mode: str
    # The store's budget in bytes as the daemon resolved it (0: none): every writer of its store
    # keeps to it (kvmesh.cli.common.open_store). None in the state of a daemon before it was written.
    store_budget: int | None = None

    @property
    def address(self) -> str:
        """The first address the peer service listens on."""
        return self.listen[0]


def write_state(data_dir: Path, state: DaemonState) -> None:
    """Atomically: a reader sees the whole file or none."""
    write_atomic(state_file(data_dir), json.dumps(asdict(state)))


def read_state(data_dir: Path | str, check_alive: bool = True) -> DaemonState:
    """The state of the daemon of `data_dir`; DaemonNotRunning if none runs."""
    path = state_file(data_dir)
    try:
        state = DaemonState(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise DaemonNotRunning(f"no kvmesh daemon is running for {data_dir} (start one with `kvmesh daemon`)") from None
    except (ValueError, TypeError) as e:
        raise KvmeshError(f"{path}: unreadable daemon state: {e}") from e
    if check_alive and not process_running(state.pid):
        raise DaemonNotRunning(f"the kvmesh daemon of {data_dir} (pid {state.pid}) is gone; start it again")
    return state


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts: it cannot be signalled, but it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def control_call(data_dir: Path | str, call: Callable[[control_pb2_grpc.ControlStub], T]) -> T:
    """`call` on the local daemon's Control service; DaemonNotRunning when none answers."""
    state = read_state(data_dir)
    with grpc.insecure_channel(state.control) as channel:
        try:
            return call(control_pb2_grpc.ControlStub(channel))
        except grpc.RpcError as e:
            raise DaemonNotRunning(f"the daemon at {state.control} does not answer: {e.details()}") from None


def control_status(data_dir: Path | str, timeout: float = TIMEOUTS.control) -> cpb.StatusResponse:
    """What the local daemon is doing and whom it sees, from its Control service."""
    return control_call(data_dir, lambda stub: stub.Status(cpb.StatusRequest(), timeout=timeout))


def spread_revocations(data_dir: Path | str, timeout: float = TIMEOUTS.control) -> cpb.SpreadResponse:
    """Have the local daemon take the revocation list in its data dir and push it to its live peers."""
    return control_call(data_dir, lambda stub: stub.SpreadRevocations(cpb.SpreadRequest(), timeout=timeout))


def describe_links(peer: cpb.PeerState) -> str:
    """A peer's addresses with what was measured of each, the one in use marked:
    "10.0.0.5:7077 (in use: 0.4 ms, 112.0 MB/s), 192.168.1.20:7077 (3.1 ms, 11.2 MB/s)"."""
    links = {link.address: link for link in peer.links}
    parts = []
    for i, address in enumerate(peer.addresses):
        link = links.get(address, cpb.LinkState())
        figures = []
        if link.checked and not link.answers:
            figures.append("does not answer")
        else:
            figures += [f"{link.rtt_ms:.1f} ms"] if link.rtt_ms else []
            figures += [f"{link.bytes_per_s / 1e6:,.1f} MB/s"] if link.bytes_per_s else []
        said = ", ".join(figures)
        if i == 0 and len(peer.addresses) > 1:
            said = f"in use: {said}" if said else "in use"
        parts.append(f"{address} ({said})" if said else address)
    return ", ".join(parts)


def live_peer_addresses(data_dir: Path | str) -> list[str]:
    """The first address of every peer the local daemon sees alive; none if no daemon runs."""
    try:
        return [p.addresses[0] for p in control_status(data_dir).peers if p.healthy and p.addresses]
    except DaemonNotRunning:
        return []


@dataclass
class DaemonProcess:
    """A daemon started by `start_daemon`, and the state it wrote once it served."""

    process: subprocess.Popen[bytes]
    state: DaemonState
    log: Path

    @property
    def address(self) -> str:
        return self.state.address

    def stop(self, timeout: float = TIMEOUTS.daemon_stop) -> int:
        """SIGTERM (a graceful stop), then wait for the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=timeout)


def start_daemon(
    data_dir: Path | str,
    args: Sequence[str] = (),
    *,
    log: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = TIMEOUTS.daemon_start,
    command: Sequence[str] = (),
) -> DaemonProcess:
    """`kvmesh --data-dir DATA_DIR daemon ARGS` in a new process, returned once it serves.

    Its stdout and stderr go to `log` (default: DATA_DIR/daemon.log). Serving is known from the
    state file the daemon writes with its own pid; a daemon that exits first raises KvmeshError
    naming the log. `command` prefixes the command line (`ip netns exec NS`, say).
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = Path(log) if log else daemon_log(data_dir)
    path = state_file(data_dir)
    before = path.read_bytes() if path.exists() else None
    argv = [*command, sys.executable, "-m", "kvmesh", "--data-dir", str(data_dir), "daemon", *map(str, args)]
    with open(log, "ab") as out:  # the daemon keeps its own copy of the descriptor
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env) if env else None)
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = read_state(data_dir, check_alive=False)
            # Through a wrapper (`command`) the daemon is the wrapper's child: any new state is its.
            if state.pid == process.pid or (command and path.read_bytes() != before):
                return DaemonProcess(process, state, log)
        except (KvmeshError, OSError):
            pass
        if process.poll() is not None:
            raise KvmeshError(f"the daemon for {data_dir} exited with status {process.returncode}; see {log}")
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise KvmeshError(f"the daemon for {data_dir} did not start within {timeout:.0f} s; see {log}")
        time.sleep(0.02)
