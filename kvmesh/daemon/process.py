"""The kvmesh daemon: one process serving its store to peers, advertising itself, tracking peers.

It needs no model and no MLX: it only stores and moves caches. The local CLI reaches it through a
Control service on loopback, found through the state file (`kvmesh.daemon.control`).
"""

import fcntl
import ipaddress
import logging
import os
import select
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import TextIO

import grpc

from kvmesh.collector import freeze_startup_objects
from kvmesh.daemon.config import DaemonConfig
from kvmesh.daemon.control import DaemonState, write_state
from kvmesh.daemon.limits import raise_descriptor_limit
from kvmesh.errors import CredentialsError, DaemonAlreadyRunning, ListenError, StoreError
from kvmesh.net.addresses import host_port
from kvmesh.net.discovery.health import HealthChecker
from kvmesh.net.discovery.interfaces import routable_addresses
from kvmesh.net.discovery.links import Link
from kvmesh.net.discovery.mdns import Discovery
from kvmesh.net.discovery.peers import Peer, PeerTable
from kvmesh.net.discovery.proof import Refuse, RefuseNode
from kvmesh.net.mesh.admission import node_refusal, refusal
from kvmesh.net.mesh.enrolment import renew_if_due, renew_if_unnamed
from kvmesh.net.mesh.member import MemberRuntime, join_port_for
from kvmesh.net.mesh.renewing import RenewingCredentials
from kvmesh.net.node_id import node_id
from kvmesh.net.server import RunningServer, start_server
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import GRPC_OPTIONS
from kvmesh.paths import coding_times_file, lock_file, state_file
from kvmesh.store import CacheStore
from kvmesh.v1 import control_pb2 as cpb
from kvmesh.v1 import control_pb2_grpc
from kvmesh.v1 import service_pb2 as spb

log = logging.getLogger(__name__)
PEER_SOURCES = {"mdns": cpb.PEER_SOURCE_MDNS, "static": cpb.PEER_SOURCE_STATIC}


def link_state(address: str, link: Link | None) -> cpb.LinkState:
    """What the health checks measured of one address of a peer (nothing yet: None)."""
    if link is None:
        return cpb.LinkState(address=address)
    return cpb.LinkState(
        address=address, answers=link.ok, rtt_ms=(link.rtt or 0.0) * 1e3, bytes_per_s=link.rate or 0.0, checked=True
    )


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(self, daemon: "Daemon", server: RunningServer):
        self.daemon, self.server = daemon, server

    def Status(self, request: cpb.StatusRequest, context: grpc.ServicerContext) -> cpb.StatusResponse:
        d = self.daemon
        return cpb.StatusResponse(
            info=self.server.service.Info(spb.InfoRequest(), context),
            listen=d.listen,
            peers=[
                cpb.PeerState(
                    node_id=p.node_id,
                    addresses=p.addresses,
                    source=PEER_SOURCES[p.source],
                    healthy=p.healthy,
                    failures=p.failures,
                    version=p.version,
                    host_name=p.host_name,
                    links=[link_state(a, d.health.links.get(a) if d.health else None) for a in p.addresses],
                )
                for p in d.peers.all()
            ],
            data_dir=str(d.config.data_dir),
        )

    def SpreadRevocations(self, request: cpb.SpreadRequest, context: grpc.ServicerContext) -> cpb.SpreadResponse:
        membership = self.daemon.membership
        if membership is None:
            return cpb.SpreadResponse()
        sent, live = membership.spread()
        interval = self.daemon.config.revocation_interval
        return cpb.SpreadResponse(version=membership.revocations.version, sent=sent, live=live, interval_s=interval)


class Daemon:
    """The daemon of one data directory: `start`, serve, `stop` (or `run` for all three)."""

    def __init__(self, config: DaemonConfig, serve_command: list[str] | None = None):
        """With `serve_command`, the daemon also runs `kvmesh serve` (the config's [serve] table) and
        stops it when it stops."""
        self.config = config
        self.serve_command = serve_command
        self.serve_process: subprocess.Popen[bytes] | None = None
        self.peers = PeerTable()
        self.server: RunningServer | None = None
        self.control: grpc.Server | None = None
        self.discovery: Discovery | None = None
        self.health: HealthChecker | None = None
        self.membership: MemberRuntime | None = None
        self.listen: list[str] = []
        self.lock: TextIO | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Take the data directory, open the store, serve, advertise, and write the state file.

        Raises DaemonAlreadyRunning when another daemon holds the data directory, ListenError
        when an address is taken; whatever started is stopped again then.
        """
        try:
            self._start()
        except BaseException:
            self.stop(grace=0)
            raise

    def _start(self) -> None:
        config = self.config
        data_dir = Path(config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.lock = take_data_dir(data_dir)
        self.node_id = node_id(data_dir)
        raise_descriptor_limit()  # before the server sizes its connection limit to it
        self.store = CacheStore(config.store_dir, max_bytes=config.store_budget)
        days, before = config.certificate_days, config.renew_before_days
        current = renew_if_due(data_dir, self.node_id, days=days, renew_before_days=before)
        if current:
            current = renew_if_unnamed(data_dir, self.node_id, current, days=days)
        self.credentials = (
            RenewingCredentials(data_dir, self.node_id, current, days=days, renew_before_days=before)
            if current
            else None
        )
        if current:
            max_days = config.max_certificate_days
            self.membership = MemberRuntime.prepare(
                data_dir, current.trust_pem, max_days=max_days, issue_days=days, own_id=self.node_id
            )
        interfaces = list(config.interfaces) or routable_addresses(None)
        if self.credentials is None:
            lan = [a for a in interfaces if not ipaddress.ip_address(a).is_loopback]
            if lan:
                log.warning(
                    "no mesh credentials: serving loopback only, not %s; run `kvmesh mesh init` "
                    "(first Mac) or `kvmesh mesh join` (the others) to serve the network",
                    ", ".join(lan),
                )
            interfaces = [a for a in interfaces if a not in lan] or ["127.0.0.1"]
        self.mode = "mutual TLS" if self.credentials else "loopback only, no mesh credentials"
        try:
            self.server = start_server(
                self.store,
                self.node_id,
                [host_port(ip, config.port) for ip in interfaces],
                max_transfers=config.max_transfers,
                policy=config.policy,
                credentials=self.credentials.server_credentials if self.credentials else None,
                interceptors=self.membership.interceptors if self.membership else (),
                services=[self.membership.add_to] if self.membership else (),
                guarded=self.credentials is not None,
                coding_times=coding_times_file(data_dir),
            )
        except ListenError as e:
            if holder := port_holder(e.port):
                raise ListenError(f"{e}: port {e.port} is held by {holder}", e.port) from None
            raise
        self.listen = [host_port(ip, self.server.port) for ip in interfaces]

        self.control = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        control_pb2_grpc.add_ControlServicer_to_server(ControlService(self, self.server), self.control)
        control_port = self.control.add_insecure_port("127.0.0.1:0")
        self.control.start()

        for address in config.peers:
            self.peers.upsert(Peer(f"static:{address}", (address,), "static", healthy=False))
        if config.discovery:
            self.discovery = Discovery(
                self.node_id,
                self.server.port,
                interfaces,
                self.peers,
                tls=self.credentials is not None,
                credentials=self.credentials,
                refuse=self._refusal(),
            )
            self.discovery.start()
        self.health = HealthChecker(
            self.peers,
            interval=config.health_interval,
            credentials=self.credentials,
            refuse=self._refusal(),
            refuse_node=self._node_refusal(),
        )
        self.health.start()
        if self.membership and self.credentials:
            joins = self.membership.start(
                interfaces,
                join_port_for(config.join_port, config.port),
                lambda: [p.addresses[0] for p in self.peers.all() if p.healthy and p.addresses],
                self.credentials,
                interval=config.revocation_interval,
            )
            if joins:
                log.info("this node is the mesh's authority: joins and renewals on %s", ", ".join(joins))
        if self.credentials:
            threading.Thread(target=self._keep_renewing, args=(self.credentials,), name="renew", daemon=True).start()

        write_state(
            data_dir,
            DaemonState(
                os.getpid(),
                self.node_id,
                host_port("127.0.0.1", control_port),
                self.listen,
                str(self.store.root),
                self.mode,
                self.store.max_bytes or 0,
            ),
        )
        threading.Thread(target=self._keep_within_budget, name="budget", daemon=True).start()
        if self.serve_command:
            self.serve_process = subprocess.Popen(self.serve_command)
            log.info("started kvmesh serve (pid %d) from the config's [serve] table", self.serve_process.pid)
        log.info(
            "node %s serving %s on %s, %s (control 127.0.0.1:%d)",
            self.node_id,
            self.store.root,
            ", ".join(self.listen),
            self.mode,
            control_port,
        )

    def _keep_within_budget(self) -> None:
        """Bring the store back within its budget every `budget_interval` seconds: writers that kept
        to another budget (a library user, an older kvmesh) may have filled it past the daemon's."""
        while not self._stopping.wait(self.config.budget_interval):
            try:
                self.store.enforce_budget()
            except StoreError as e:
                log.warning("cannot keep the store within its budget: %s", e)

    def _refusal(self) -> Refuse | None:
        """Why a peer that proves its node id with a certificate of this mesh is refused all the same
        (a removed node), for discovery to ask before it binds the id to an address."""
        if self.membership is None:
            return None
        return partial(refusal, revocations=self.membership.revocations, max_days=self.config.max_certificate_days)

    def _node_refusal(self) -> RefuseNode | None:
        """Why a peer's node id may not be dialled (a removed node), for the health checks to ask at
        every check: the revocation list changes while their channels stay open."""
        if self.membership is None:
            return None
        return partial(node_refusal, revocations=self.membership.revocations)

    def _keep_renewing(self, credentials: RenewingCredentials) -> None:
        """Renew this node's certificate before it ends, for as long as the daemon runs: checked
        four times within the renewal margin (at most hourly), so a month of uptime never outlives it."""
        every = min(3600.0, credentials.renew_before_days * 86400 / 4)
        while not self._stopping.wait(every):
            try:
                if credentials.renew_if_due():
                    log.info(
                        "renewed this node's certificate; it now runs to %s",
                        f"{credentials.expires:%Y-%m-%d %H:%M:%S} UTC",
                    )
            except (CredentialsError, OSError) as e:  # the next check tries again; the old one still holds
                log.warning(
                    "cannot renew this node's certificate (it runs to %s): %s",
                    f"{credentials.expires:%Y-%m-%d %H:%M} UTC",
                    e,
                )

    def stop(self, grace: float = TIMEOUTS.shutdown_grace) -> None:
        """Goodbye to the mesh first, then let transfers in flight finish for `grace` seconds."""
        if self.lock is None:
            return  # never took the data directory: its state file is another daemon's
        self._stopping.set()
        state_file(self.config.data_dir).unlink(missing_ok=True)
        if self.serve_process:
            self.serve_process.terminate()
            try:
                self.serve_process.wait(timeout=grace + 5)
            except subprocess.TimeoutExpired:
                self.serve_process.kill()
                self.serve_process.wait()
        if self.server:  # peers that hear the goodbye check on us: they must find us stopping
            self.server.health.enter_graceful_shutdown()
        if self.discovery:
            self.discovery.stop()
        if self.health:
            self.health.stop()
        if self.membership:
            self.membership.stop()
        if self.server:
            self.server.stop(grace)
        if self.control:
            self.control.stop(1).wait()
        self.lock.close()
        self.lock = None
        if self.server:
            log.info("stopped")

    def run(self, grace: float = TIMEOUTS.shutdown_grace) -> None:
        """Start, serve until SIGTERM or SIGINT, then stop gracefully."""
        with stop_signals() as stopped:  # (noted until the stop is done: another signal must not cut it)
            self.start()
            freeze_startup_objects()  # what starting made: full collections walk less from now on
            print(f"kvmesh: node {self.node_id} ({self.mode}) serving on {', '.join(self.listen)}", flush=True)
            stopped()
            log.info("shutting down")
            self.stop(grace)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_signals(poll: float = 0.5) -> Iterator[Callable[[], None]]:
    """While in it, SIGTERM and SIGINT are noted; it gives the wait for the first.

    The handler only appends to a list. Python runs a handler in the main thread between any two of
    its bytecodes, also while that thread holds a lock: one that set a threading.Event deadlocked
    daemons that got a second signal while the first one's handler held the Event's lock (two were
    found stuck after a test's terminate-then-stop under load). The signal's byte on a wakeup fd
    (signal.set_wakeup_fd) ends the wait at once; the wait is still timed, as a signal may land on
    one of gRPC's threads (after a SIGSTOP/SIGCONT, say), and Python runs its handler only when the
    main thread wakes up.
    """
    received: list[int] = []
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous = {sig: signal.signal(sig, lambda signum, _: received.append(signum)) for sig in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def wait() -> None:
        while not received:
            select.select([reader], [], [], poll)
            with suppress(BlockingIOError):
                reader.recv(4096)

    try:
        yield wait
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reader.close()
        writer.close()


def take_data_dir(data_dir: Path) -> TextIO:
    """Hold the data directory's lock for the daemon's life (released when the process ends)."""
    path = lock_file(data_dir)
    f = open(path, "a+")  # noqa: SIM115 (held open for the daemon's life)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise DaemonAlreadyRunning(
            f"another kvmesh daemon (pid {pid}) already runs for {data_dir}; stop it first, or give this one "
            "its own --data-dir"
        ) from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def port_holder(port: int) -> str | None:
    """Which process listens on TCP `port` ("pid 123 (python3 -m kvmesh ...)"), where Linux says so."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            return None
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            sockets = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            if any(f"socket:[{inode}]" in sockets for inode in inodes):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {proc.name} ({command[:80]})"
        except OSError:
            continue
    return None
