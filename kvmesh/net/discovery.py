"""Finding peers: mDNS adverts and browsing (python-zeroconf), static peers, and health checks.

mDNS says who is out there but not who is alive: a SIGKILLed peer's record lingers in browsers for
many minutes. So every known peer is health-checked over gRPC; one that fails a few checks in a row
is dropped from the live table within seconds and probed on, so it comes back when it answers
again (after a partition heals). The advert carries only ids and a port; what a peer holds is asked
over gRPC.
"""

import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
import ifaddr
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroconf import DNSQuestionType, IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from kvmesh.net.addresses import host_port
from kvmesh.net.credentials import Membership
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import SERVICE_NAME, open_channel
from kvmesh.versions import PROTOCOL_VERSION, __version__

SERVICE_TYPE = "_kvmesh._tcp.local."
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    node_id: str
    # "host:port" to try in order.
    addresses: tuple[str, ...]
    source: str  # "mdns" or "static"
    version: str = ""
    healthy: bool = True
    failures: int = 0
    last_ok: float = field(default_factory=time.monotonic)


class PeerTable:
    """Known peers, each marked healthy while it answers its health checks."""

    def __init__(self):
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    def upsert(self, peer: Peer) -> None:
        with self._lock:
            old = self._peers.get(peer.node_id)
            self._peers[peer.node_id] = peer
            if old is None or old.addresses != peer.addresses:
                log.info("peer %s at %s (%s)", peer.node_id, ", ".join(peer.addresses), peer.source)

    def remove(self, node_id: str, why: str) -> None:
        with self._lock:
            if self._peers.pop(node_id, None):
                log.info("peer %s removed: %s", node_id, why)

    def checked(self, node_id: str, ok: bool, drop_after: int) -> None:
        """Record a health check; the peer leaves the live set after `drop_after` failures in a row."""
        with self._lock:
            peer = self._peers.get(node_id)
            if peer is None:
                return
            if ok:
                updated = replace(peer, healthy=True, failures=0, last_ok=time.monotonic())
                if not peer.healthy:
                    log.info("peer %s answers again", node_id)
            else:
                failures = peer.failures + 1
                updated = replace(peer, failures=failures, healthy=peer.healthy and failures < drop_after)
                if peer.healthy and not updated.healthy:
                    log.warning("peer %s dropped: %d health checks failed", node_id, failures)
            self._peers[node_id] = updated

    def all(self) -> list[Peer]:
        with self._lock:
            return sorted(self._peers.values(), key=lambda p: p.node_id)


def routable_addresses(interfaces: Sequence[str] | None) -> list[str]:
    """The addresses to advertise: the served interfaces' own, never loopback on a LAN.

    Loopback is advertised only when it is explicitly the (only) interface served: tests and demos.
    """
    if interfaces:
        return list(interfaces)
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and ip.is_IPv4 and not ip.ip.startswith(("127.", "169.254.")):
                found.append(ip.ip)
    return found


def dial_address(address: str, port: int) -> str | None:
    """The `host:port` to dial an address a peer advertised, or None when it cannot be dialled.

    An IPv6 link-local address (fe80::/10) exists on every link at once, so it means something only
    with its scope, the interface it was heard on: zeroconf appends that as `%<interface index>`
    when it knows it, and the interface's name is put there (gRPC takes either; names read better
    in logs). Without a scope it is left out.
    """
    host, _, scope = address.partition("%")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6 and ip.is_link_local:
        if not scope:
            return None
        if scope.isdigit():
            with contextlib.suppress(OSError):
                scope = socket.if_indextoname(int(scope))
        return host_port(f"{host}%{scope}", port)
    return host_port(host, port)


class Discovery:
    """Advertise this node and keep a PeerTable of the others found by mDNS."""

    def __init__(
        self, node_id: str, port: int, interfaces: Sequence[str] | None, table: PeerTable, *, tls: bool = False
    ):
        self.node_id, self.port, self.table, self.tls = node_id, port, table, tls
        self.interfaces = list(interfaces) if interfaces else None
        self.zeroconf: Zeroconf | None = None
        self.browser: ServiceBrowser | None = None

    def start(self) -> None:
        addresses = routable_addresses(self.interfaces)
        ipv6 = any(":" in a for a in addresses)
        # Explicit interfaces only where given: the default would multicast on every interface.
        self.zeroconf = Zeroconf(
            interfaces=self.interfaces or [a for a in addresses],
            ip_version=IPVersion.All if ipv6 else IPVersion.V4Only,
        )
        info = ServiceInfo(
            SERVICE_TYPE,
            f"{self.node_id}.{SERVICE_TYPE}",
            port=self.port,
            properties={
                "id": self.node_id,
                "pv": str(PROTOCOL_VERSION),
                "v": __version__,
                "tls": "1" if self.tls else "0",
            },
            server=f"{self.node_id}.local.",
            parsed_addresses=addresses,
        )
        self.zeroconf.register_service(info, allow_name_change=True)
        self.browser = ServiceBrowser(
            self.zeroconf, SERVICE_TYPE, handlers=[self._on_change], question_type=DNSQuestionType.QM
        )
        log.info("advertising %s on %s port %d", self.node_id, ", ".join(addresses), self.port)

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        node_id = name.removesuffix(f".{SERVICE_TYPE}")
        if node_id == self.node_id:
            return
        if state_change is ServiceStateChange.Removed:
            self.table.remove(node_id, "said goodbye")
            return
        info = zeroconf.get_service_info(service_type, name, timeout=int(TIMEOUTS.mdns_resolve * 1000))
        if info is None or info.port is None:
            return
        props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
        if props.get("pv") != str(PROTOCOL_VERSION):
            log.warning("ignoring %s: protocol %s, this node speaks %d", node_id, props.get("pv"), PROTOCOL_VERSION)
            return
        dialable = (dial_address(a, info.port) for a in info.parsed_scoped_addresses())
        addresses = tuple(a for a in dialable if a is not None)
        if not addresses:
            log.warning("ignoring %s: none of its addresses can be dialled", node_id)
            return
        self.table.upsert(Peer(props.get("id", node_id), addresses, "mdns", props.get("v", "")))

    def stop(self) -> None:
        """Say goodbye (browsers drop us at once) and close."""
        if self.zeroconf is not None:
            if self.browser is not None:
                self.browser.cancel()
            self.zeroconf.unregister_all_services()
            self.zeroconf.close()
            self.zeroconf = None


def check_health(address: str, timeout: float, credentials: Membership | None = None) -> bool:
    try:
        with open_channel(address, credentials) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout
            )
            return response.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class HealthChecker:
    """Checks every known peer each `interval` seconds, on its own thread."""

    def __init__(
        self,
        table: PeerTable,
        *,
        interval: float = 1.0,
        drop_after: int = 2,
        forget_after: float = 600.0,
        credentials: Membership | None = None,
    ):
        self.table, self.interval, self.drop_after, self.forget_after = table, interval, drop_after, forget_after
        self.credentials = credentials
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for peer in self.table.all():
                ok = any(check_health(a, self.interval, self.credentials) for a in peer.addresses)
                self.table.checked(peer.node_id, ok, self.drop_after)
                if not ok and peer.source == "mdns" and time.monotonic() - peer.last_ok > self.forget_after:
                    self.table.remove(peer.node_id, f"silent for {self.forget_after:.0f} s")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
