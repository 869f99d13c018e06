"""This node's mDNS advert and the browser of the others' (python-zeroconf). The advert carries only
ids and a port; what a peer holds is asked over gRPC. What the browser hears is a hint, handed to the
Verifier (kvmesh.net.discovery.verifier), which proves it before the peer table believes it."""

import logging
from collections.abc import Sequence

from zeroconf import DNSQuestionType, IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from kvmesh.net.discovery.interfaces import dial_address, routable_addresses
from kvmesh.net.discovery.peers import PeerTable
from kvmesh.net.discovery.proof import Refuse
from kvmesh.net.discovery.verifier import Hint, Verifier
from kvmesh.net.mesh.credentials import Membership
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.versions import PROTOCOL_VERSION, __version__

SERVICE_TYPE = "_kvmesh._tcp.local."
log = logging.getLogger(__name__)


class Discovery:
    """Advertise this node and keep a PeerTable of the others found by mDNS, once each proves it is
    the node its advert names (`Verifier`)."""

    def __init__(
        self,
        node_id: str,
        port: int,
        interfaces: Sequence[str] | None,
        table: PeerTable,
        *,
        tls: bool = False,
        credentials: Membership | None = None,
        refuse: Refuse | None = None,
    ):
        """`refuse`: why a peer's certificate is refused though the CA signed it (kvmesh.net.mesh.admission)."""
        self.node_id, self.port, self.table, self.tls = node_id, port, table, tls
        self.interfaces = list(interfaces) if interfaces else None
        self.zeroconf: Zeroconf | None = None
        self.browser: ServiceBrowser | None = None
        self.verifier = Verifier(table, credentials, refuse=refuse)

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
        self.verifier.start()
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
            self.verifier.goodbye(node_id)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=int(TIMEOUTS.mdns_resolve * 1000))
        if info is None or info.port is None:
            return
        props = {k.decode(): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
        if props.get("pv") != str(PROTOCOL_VERSION):
            if self.verifier.quiet.due(("protocol", node_id)):
                log.warning("ignoring %s: protocol %s, this node speaks %d", node_id, props.get("pv"), PROTOCOL_VERSION)
            return
        dialable = (dial_address(a, info.port) for a in info.parsed_scoped_addresses())
        addresses = tuple(a for a in dialable if a is not None)
        claimed = props.get("id", node_id)
        if not addresses or claimed == self.node_id:
            return
        self.verifier.hint(Hint(claimed, addresses, props.get("v", "")))

    def stop(self) -> None:
        """Say goodbye (browsers check on us at once) and close."""
        if self.zeroconf is not None:
            if self.browser is not None:
                self.browser.cancel()
            self.zeroconf.unregister_all_services()
            self.zeroconf.close()
            self.zeroconf = None
        self.verifier.stop()
