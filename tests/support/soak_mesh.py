"""A mesh of real daemons with mutual TLS for the soak (scripts/soak.py), beside its plaintext ones:
the authority A, a member B, and members joined and removed as the soak goes. Removed members
keep running with their old certificates (as a Mac someone removed but never switched off), and
strangers squat A's join port. Static peers only (no mDNS), so the plaintext daemons never meet it.

Joins and removals go through the `kvmesh` command as a user types them; renewals through
kvmesh.net.mesh.enrolment.renew, as the daemon renews."""

import contextlib
import itertools
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.daemon.control import DaemonProcess, control_status
from kvmesh.errors import KvmeshError
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.net.mesh.enrolment import init_mesh, renew
from kvmesh.net.node_id import node_id
from support.daemons import start_daemon
from support.idle_calls import IdleCalls
from support.membership import credentials, join_address
from support.processes import cli

HEALTH = 0.5
REVOCATION = 1.0
# A removed member is no member's live peer after this many health intervals (once the list has
# reached it: pushed, or asked for every REVOCATION seconds).
REMOVAL_INTERVALS = 20


@dataclass
class Member:
    data: Path
    store: Path
    log: Path
    daemon: DaemonProcess | None = None

    @property
    def node_id(self) -> str:
        return node_id(self.data)

    @property
    def address(self) -> str:
        assert self.daemon is not None
        return self.daemon.address

    def start(self, peers: list[str], port: int = 0) -> None:
        args: list[object] = ["--interface", "127.0.0.1", "--port", port, "--no-discovery", "--store", self.store]
        args += ["--health-interval", HEALTH, "--revocation-interval", REVOCATION]
        for peer in peers:
            args += ["--peer", peer]
        self.daemon = start_daemon(self.data, *args, log=self.log)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.process.poll() is None:
            try:
                self.daemon.stop(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.process.kill()
                self.daemon.process.wait()

    def live_peers(self) -> set[str]:
        """The addresses of the peers this member's daemon takes for live (its sources)."""
        return {a for p in control_status(self.data).peers if p.healthy for a in p.addresses}

    def credentials(self) -> MeshCredentials:
        return credentials(self.data)


class SoakMesh:
    """A (the authority) and B (a member, which dials A and the member to be removed next)."""

    def __init__(self, root: Path):
        self.root = root
        self._names = itertools.count()
        self.a = self._member("a")
        init_mesh(self.a.data, self.a.node_id)
        self.a.start([])
        self.b = self.joined("b")
        self.b.start([self.a.address])
        self.spares: list[Member] = []  # joined, not started yet
        self.removed: list[Member] = []  # removed and still running, the newest last

    def _member(self, name: str) -> Member:
        data = self.root / name
        return Member(data, data / "store", self.root / f"{name}.log")

    def joined(self, name: str | None = None) -> Member:
        """A new member, joined with a fresh token as a user joins (`mesh token` on A, `mesh join`);
        KvmeshError naming the failure when the join fails."""
        member = self._member(name or f"x{next(self._names)}")
        token = cli("mesh", "token", data_dir=self.a.data, check=False, timeout=60)
        if token.returncode:
            raise KvmeshError(f"mesh token failed: {token.stderr.strip()}")
        address = join_address(self.a.data)
        joined = cli("mesh", "join", token.stdout.strip(), address, data_dir=member.data, check=False, timeout=60)
        if joined.returncode:
            shutil.rmtree(member.data, ignore_errors=True)
            raise KvmeshError(f"mesh join failed: {joined.stderr.strip()}")
        return member

    def restart_b(self, *peers: str) -> None:
        """B again, on its port, dialling A and `peers`."""
        port = int(self.b.address.rsplit(":", 1)[1])
        self.b.stop()
        self.b.start([self.a.address, *peers], port=port)

    def remove(self, member: Member) -> str:
        """`kvmesh mesh remove NODE` on A; its output."""
        removed = cli("mesh", "remove", member.node_id, data_dir=self.a.data, check=False, timeout=60)
        if removed.returncode:
            raise KvmeshError(f"mesh remove failed: {removed.stderr.strip()}")
        return removed.stdout

    def squat(self, joins: int = 8, renewals: int = 8) -> IdleCalls:
        """A stranger on 127.0.0.2 holding Join and Renew calls on A's join port without their
        request. The caller closes it."""
        host, port = join_address(self.a.data).rsplit(":", 1)
        squatter = IdleCalls(host, int(port), source="127.0.0.2")
        squatter.open("/kvmesh.v1.Membership/Join", joins)
        squatter.open("/kvmesh.v1.Membership/Renew", renewals)
        return squatter

    @staticmethod
    def renew(member: Member) -> None:
        """A renewal of `member`'s certificate through the authority's join port."""
        renew(member.data, member.node_id)

    def running(self) -> list[Member]:
        return [self.a, self.b, *self.removed]

    def close(self) -> None:
        for member in self.running():
            with contextlib.suppress(Exception):
                member.stop()


def wait_until(condition, seconds: float, every: float = 0.1) -> float | None:
    """Seconds until `condition()` held, or None if it did not within `seconds`."""
    began = time.monotonic()
    while True:
        with contextlib.suppress(KvmeshError):
            if condition():
                return time.monotonic() - began
        if time.monotonic() - began > seconds:
            return None
        time.sleep(every)
