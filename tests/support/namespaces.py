"""Hosts on one machine in network namespaces: two joined by a veth pair whose sending side can be
limited to a link rate with `tbf` (the benchmarks: each namespace has its own network stack, so
traffic between them crosses a real link, TLS and all, as between two hosts), or several on one
bridge (tests/scenario/test_netns.py).

Needs Linux, root and iproute2. Every name carries the caller's prefix, and `down` removes exactly
what `up` made (also after a failure); nothing touches the host's own network.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SERVER_IP, CLIENT_IP = "10.78.0.1", "10.78.0.2"


def missing(*tools: str) -> str | None:
    """Why namespaces cannot be made here with these tools (default: ip and tc), or None."""
    tools = tools or ("ip", "tc")
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if not all(shutil.which(tool) for tool in tools):
        return f"needs iproute2 ({', '.join(tools)})"
    return None


def run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


def ip(*args: str) -> None:
    run("ip", *args)


def inside(namespace: str) -> tuple[str, ...]:
    """The prefix that runs a command in `namespace`."""
    return ("ip", "netns", "exec", namespace)


def remove(*namespaces: str) -> None:
    """Kill every process in these namespaces, then delete them; missing ones are left alone."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Namespaces:
    """Namespaces made by `up` and removed by `down`; as a context manager, both (down also when up fails)."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def up(self) -> None:
        raise NotImplementedError

    def down(self) -> None:
        remove(*self.names())

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.down()


class Link(Namespaces):
    """A server namespace and a client namespace on one veth pair (eth0 in each)."""

    def __init__(self, prefix: str):
        self.server, self.client = f"{prefix}-s", f"{prefix}-c"

    def names(self) -> list[str]:
        return [self.server, self.client]

    def in_server(self) -> tuple[str, ...]:
        return inside(self.server)

    def in_client(self) -> tuple[str, ...]:
        return inside(self.client)

    def up(self) -> None:
        for ns in (self.server, self.client):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.server, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", self.client)
        for ns, address in ((self.server, SERVER_IP), (self.client, CLIENT_IP)):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

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


class Bridge(Namespaces):
    """`size` hosts (eth0 at 10.77.0.i/24, i from 1) on one bridge (br0, multicast snooping off, so
    mDNS reaches every host) in a hub namespace; host i's veth at the hub is veth{i}."""

    def __init__(self, prefix: str, size: int):
        self.hub = f"{prefix}-hub"
        self.nodes = {i: f"{prefix}-n{i}" for i in range(1, size + 1)}

    def names(self) -> list[str]:
        return [*self.nodes.values(), self.hub]

    def address(self, i: int) -> str:
        return f"10.77.0.{i}"

    def in_node(self, i: int) -> tuple[str, ...]:
        return inside(self.nodes[i])

    def up(self) -> None:
        ip("netns", "add", self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in self.nodes.items():
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "add", f"veth{i}", "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.hub, "link", "set", f"veth{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")


@contextlib.contextmanager
def member_daemon_across_a_link(root: Path, store: Path, prefix: str, port: int) -> Iterator[tuple[Link, Path]]:
    """A mesh of two (root/server, root/client), the server's daemon serving `store` at SERVER_IP:port
    in the server's namespace of a fresh Link, stopped at the end: (the link, the client's data dir),
    for benches that fetch across a shaped link."""
    from support.daemons import start_daemon
    from support.mesh import make_mesh

    server_dir, client_dir = root / "server", root / "client"
    make_mesh(server_dir, client_dir)
    with Link(prefix) as link:
        daemon = start_daemon(
            server_dir,
            *("--store", store, "--interface", SERVER_IP, "--port", port, "--no-discovery"),
            command=link.in_server(),
        )
        try:
            yield link, client_dir
        finally:
            daemon.stop()
