"""Start a real kvmesh daemon process on 127.0.0.1 for a test."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@dataclass
class DaemonProcess:
    process: subprocess.Popen
    # The line it printed once listening, and the address at its end.
    line: str
    address: str
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=30)


def start_daemon(data_dir, *args, log, env=None) -> DaemonProcess:
    """`kvmesh --data-dir DATA_DIR daemon --interface 127.0.0.1 --port 0 ARGS`, its stderr in `log`."""
    with open(log, "a") as out:  # the daemon keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "--data-dir", str(data_dir), "daemon",
             "--interface", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=out, text=True, env=env or ENV,
        )
    line = process.stdout.readline()
    if "serving on" not in line:
        process.kill()
        process.wait()
        raise AssertionError(f"the daemon did not start: {line!r}; see {log}")
    return DaemonProcess(process, line, line.split()[-1], Path(log))
