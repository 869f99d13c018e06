"""The kvmesh daemon: one process serving its store to peers, advertising itself, tracking peers.

It needs no model: it only stores and moves caches. The local CLI reaches it through a Control
service on loopback, found through `daemon.json` in the data directory.
"""

import ipaddress
import json
import logging
import os
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from .config import DaemonConfig
from .credentials import load_credentials
from .discovery import Discovery, HealthChecker, Peer, PeerTable, routable_addresses
from .errors import KvmeshError
from .node import node_id
from .protocol import GRPC_OPTIONS
from .server import RunningServer, start_server
from .store import CacheStore
from .v1 import service_pb2 as spb
from .v1 import service_pb2_grpc

log = logging.getLogger("kvmesh.daemon")
STATE_FILE = "daemon.json"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(config: DaemonConfig) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if config.log_format == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler], force=True)


class ControlService(service_pb2_grpc.ControlServicer):
    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon

    def Status(self, request, context):
        d = self.daemon
        return spb.StatusResponse(
            info=d.server.service.Info(spb.InfoRequest(), context),
            listen=d.listen,
            peers=[
                spb.PeerState(node_id=p.node_id, addresses=p.addresses, source=p.source, healthy=p.healthy,
                              failures=p.failures, version=p.version)
                for p in d.peers.all()
            ],
            data_dir=str(d.config.data_dir),
        )


@dataclass
class DaemonState:
    """What daemon.json says: how the CLI reaches a running daemon."""

    pid: int
    node_id: str
    control: str
    listen: list[str]
    store: str


def read_state(data_dir: Path) -> DaemonState:
    path = Path(data_dir) / STATE_FILE
    try:
        state = DaemonState(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise KvmeshError(f"no kvmesh daemon is running for {data_dir} (start one with `kvmesh daemon`)") from None
    except (ValueError, TypeError) as e:
        raise KvmeshError(f"{path}: unreadable daemon state: {e}") from e
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        raise KvmeshError(f"the kvmesh daemon of {data_dir} (pid {state.pid}) is gone; start it again") from None
    except PermissionError:
        pass
    return state


def control_status(data_dir: Path, timeout: float = 5.0) -> spb.StatusResponse:
    state = read_state(data_dir)
    with grpc.insecure_channel(state.control) as channel:
        try:
            return service_pb2_grpc.ControlStub(channel).Status(spb.StatusRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise KvmeshError(f"the daemon at {state.control} does not answer: {e.details()}") from None


class Daemon:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.peers = PeerTable()
        self.server: RunningServer | None = None
        self.control: grpc.Server | None = None
        self.discovery: Discovery | None = None
        self.health: HealthChecker | None = None
        self.listen: list[str] = []

    def start(self) -> None:
        config = self.config
        data_dir = Path(config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.node_id = node_id(data_dir)
        self.store = CacheStore(config.store_dir, max_bytes=config.store_budget or None)
        self.credentials = load_credentials(data_dir, self.node_id)
        interfaces = list(config.interfaces) or routable_addresses(None)
        if self.credentials is None:
            lan = [a for a in interfaces if not ipaddress.ip_address(a).is_loopback]
            if lan:
                log.warning("no mesh credentials: serving loopback only, not %s; run `kvmesh mesh init` "
                            "(first Mac) or `kvmesh mesh join` (the others) to serve the network", ", ".join(lan))
            interfaces = [a for a in interfaces if a not in lan] or ["127.0.0.1"]
        self.mode = "mutual TLS" if self.credentials else "loopback only, no mesh credentials"
        self.server = start_server(
            self.store, self.node_id, [_host_port(ip, config.port) for ip in interfaces], config.max_transfers,
            policy=config.policy, credentials=self.credentials.server_credentials() if self.credentials else None,
        )
        self.listen = [_host_port(ip, self.server.port) for ip in interfaces]

        self.control = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        service_pb2_grpc.add_ControlServicer_to_server(ControlService(self), self.control)
        control_port = self.control.add_insecure_port("127.0.0.1:0")
        self.control.start()

        for address in config.peers:
            self.peers.upsert(Peer(f"static:{address}", (address,), "static", healthy=False))
        if config.discovery:
            self.discovery = Discovery(self.node_id, self.server.port, interfaces, self.peers, tls=self.credentials is not None)
            self.discovery.start()
        self.health = HealthChecker(self.peers, config.health_interval, credentials=self.credentials)
        self.health.start()

        state = DaemonState(os.getpid(), self.node_id, f"127.0.0.1:{control_port}", self.listen, str(self.store.root))
        tmp = data_dir / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(vars(state)))
        tmp.replace(data_dir / STATE_FILE)
        log.info("node %s serving %s on %s, %s (control 127.0.0.1:%d)", self.node_id, self.store.root,
                 ", ".join(self.listen), self.mode, control_port)

    def stop(self, grace: float = 10.0) -> None:
        """Goodbye to the mesh first, then let transfers in flight finish for `grace` seconds."""
        (Path(self.config.data_dir) / STATE_FILE).unlink(missing_ok=True)
        if self.discovery:
            self.discovery.stop()
        if self.health:
            self.health.stop()
        if self.server:
            self.server.stop(grace)
        if self.control:
            self.control.stop(1).wait()
        log.info("stopped")

    def run(self, grace: float = 10.0) -> None:
        """Start, serve until SIGTERM or SIGINT, then stop gracefully."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        print(f"kvmesh: node {self.node_id} ({self.mode}) serving on {', '.join(self.listen)}", flush=True)
        stop.wait()
        log.info("shutting down")
        self.stop(grace)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
