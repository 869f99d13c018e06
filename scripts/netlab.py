"""Two hosts on one machine for benchmarks: network namespaces joined by a veth pair whose sending
side can be limited to a link rate with `tbf` (see shared/docs/multi-host-testing.md).

Needs Linux, root and iproute2. Every name carries the run's prefix, and `down` removes exactly what
`up` made (also after a failure); nothing touches the host's own network.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SERVER_IP, CLIENT_IP = "10.78.0.1", "10.78.0.2"
KVMESH = [sys.executable, "-m", "kvmesh"]


def missing() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    return None


def run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


class Link:
    """A server namespace and a client namespace on one veth pair (eth0 in each)."""

    def __init__(self, prefix: str):
        self.server, self.client = f"{prefix}-s", f"{prefix}-c"

    def in_server(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.server)

    def in_client(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.client)

    def up(self) -> None:
        for ns in (self.server, self.client):
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run(
            "ip", "-n", self.server, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", self.client
        )
        for ns, address in ((self.server, SERVER_IP), (self.client, CLIENT_IP)):
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")

    def shape(self, bits_per_s: float | None) -> None:
        """Limit what the server sends to `bits_per_s` (a token bucket of 4 ms, at least 256 KiB); None: unshaped."""
        if bits_per_s is None:
            subprocess.run(["tc", "-n", self.server, "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            return
        burst = max(256 << 10, int(bits_per_s / 8 / 250))
        run(
            "tc", "-n", self.server, "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "50ms",
        )  # fmt: skip

    def down(self) -> None:
        for ns in (self.server, self.client):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> "Link":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.down()


def make_mesh(server_dir: Path, client_dir: Path) -> None:
    """One mesh, made in `server_dir` and joined from `client_dir`: daemons off loopback need it."""
    subprocess.run([*KVMESH, "--data-dir", str(server_dir), "mesh", "init"], check=True, capture_output=True)
    bundle = subprocess.run(
        [*KVMESH, "--data-dir", str(server_dir), "mesh", "export"], check=True, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run([*KVMESH, "--data-dir", str(client_dir), "mesh", "join", bundle], check=True, capture_output=True)
