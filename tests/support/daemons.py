"""Real `kvmesh daemon` and `kvmesh serve` processes, started as a user starts them, and stopped."""

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvmesh.daemon import control
from kvmesh.daemon.control import DaemonProcess
from kvmesh.errors import KvmeshError
from kvmesh.serve.state import read_serve_state
from support.processes import ENV, KVMESH

LOOPBACK = ("--interface", "127.0.0.1", "--port", "0")


def start_daemon(data_dir, *args, log=None, env=None, command=()) -> DaemonProcess:
    """`kvmesh --data-dir DATA_DIR daemon ARGS`, returned once it serves (its log: `log`, else
    DATA_DIR/daemon.log); in ENV (offline) unless `env` is given; `command` wraps it (`ip netns exec NS`)."""
    return control.start_daemon(data_dir, args, log=log, env=ENV if env is None else env, command=command)


def loopback_daemon(data_dir, *args, discovery=False, log=None, env=None) -> DaemonProcess:
    """A daemon on 127.0.0.1 at a free port, without mDNS unless `discovery`; ARGS follow those."""
    switches = [*LOOPBACK, *([] if discovery else ["--no-discovery"])]
    return start_daemon(data_dir, *switches, *args, log=log, env=env)


class Daemons:
    """The loopback daemons of one test (the `daemons` fixture): `start` takes loopback_daemon's
    arguments; `stop_all` stops every one still running (SIGTERM to all, then the wait)."""

    def __init__(self):
        self.started: list[DaemonProcess] = []

    def start(self, data_dir, *args, **options) -> DaemonProcess:
        daemon = loopback_daemon(data_dir, *args, **options)
        self.started.append(daemon)
        return daemon

    def stop_all(self, timeout: float = 30.0) -> None:
        for daemon in self.started:
            if daemon.process.poll() is None:
                daemon.process.terminate()
        for daemon in self.started:
            daemon.process.wait(timeout=timeout)


@dataclass
class ServerProcess:
    """A `kvmesh serve` process and the base URL of its OpenAI API."""

    process: subprocess.Popen
    url: str
    log: Path

    def stop(self, timeout: float = 30.0) -> int:
        """SIGCONT (a test may have frozen it), SIGTERM, then the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
        return self.process.wait(timeout=timeout)


def start_server(data_dir, model_dir, *args, log, env=None) -> ServerProcess:
    """`kvmesh --data-dir DATA_DIR serve MODEL_DIR --port 0 ARGS`, returned once it serves: its
    banner's first line is the moment, its state file (DATA_DIR/servers/PID.json) says where. Its stderr
    goes to `log`. In ENV unless `env` is given."""
    command = [KVMESH, "--data-dir", str(data_dir), "serve", str(model_dir), "--port", "0", *map(str, args)]
    with open(log, "w") as out:  # the server keeps its own copy
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=out, text=True, env=ENV if env is None else env
        )
    line = process.stdout.readline() if process.stdout else ""  # written after the state file
    try:
        state = read_serve_state(data_dir, process.pid)
    except KvmeshError:
        state = None
    if not line or state is None or state.pid != process.pid:
        process.kill()
        process.wait()
        raise AssertionError(f"the server did not start: {line!r}; see {log}")
    return ServerProcess(process, state.url, Path(log))
