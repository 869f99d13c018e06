"""A stranger on the LAN (no certificate of the mesh): real mDNS adverts in any node's name, real
goodbyes in any node's name, and TCP connections held open. Used by the tests and the soak."""

import contextlib
import secrets
import socket
import threading

from zeroconf import DNSOutgoing, DNSPointer, ServiceInfo, Zeroconf, const

from kvmesh.net.addresses import split_host_port
from kvmesh.net.discovery.mdns import SERVICE_TYPE
from kvmesh.versions import PROTOCOL_VERSION


class Stranger:
    """An mDNS responder on `interface` (an IP address: never the default, all interfaces) that says
    what it likes; `close` unregisters what it advertised and closes every connection it holds."""

    def __init__(self, interface: str = "127.0.0.1"):
        self.zeroconf = Zeroconf(interfaces=[interface])
        self.adverts: list[ServiceInfo] = []
        self.connections: list[socket.socket] = []
        self.opened = 0
        self._lock = threading.Lock()

    def advertise(self, claimed_id: str, address: str, port: int) -> ServiceInfo:
        """An advert of its own instance that claims to be node `claimed_id` at `address:port`."""
        instance = f"x{secrets.token_hex(7)}"
        info = ServiceInfo(
            SERVICE_TYPE,
            f"{instance}.{SERVICE_TYPE}",
            port=port,
            properties={"id": claimed_id, "pv": str(PROTOCOL_VERSION), "v": "0", "tls": "1"},
            server=f"{instance}.local.",
            parsed_addresses=[address],
        )
        self.zeroconf.register_service(info, cooperating_responders=True)
        self.adverts.append(info)
        return info

    def goodbye(self, node_id: str) -> None:
        """A goodbye (the service's PTR record with TTL 0) in the name of node `node_id`'s instance."""
        out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
        record = DNSPointer(SERVICE_TYPE, const._TYPE_PTR, const._CLASS_IN, 0, f"{node_id}.{SERVICE_TYPE}")
        out.add_answer_at_time(record, 0)
        self.zeroconf.send(out)

    def connect(self, address: str, opening: bytes = b"\x16\x03", source: str = "") -> bool:
        """One more TCP connection to `address` (from `source`, an address of this machine, if
        given), sending `opening` (the start of a TLS record) and then nothing; False when it cannot
        connect."""
        try:
            s = socket.create_connection(split_host_port(address), timeout=2, source_address=(source, 0))
            s.sendall(opening)
        except OSError:
            return False
        with self._lock:
            self.connections.append(s)
        return True

    def hold(
        self, address: str, count: int, stop: threading.Event, openings: tuple[bytes, ...] = (b"\x16\x03",), source=""
    ) -> int:
        """Keep `count` connections to `address` open until `stop` (opening new ones for those the
        peer closes), each sending the next of `openings` first, from `source` if given; the
        connections opened in all (also counted in `opened` as it goes)."""
        while not stop.is_set():
            self._drop_closed()
            with self._lock:
                missing = count - len(self.connections)
            for _ in range(missing):
                self.opened += self.connect(address, openings[self.opened % len(openings)], source)
            stop.wait(0.2)
        return self.opened

    def _drop_closed(self) -> None:
        with self._lock:
            kept = []
            for s in self.connections:
                try:
                    s.setblocking(False)
                    closed = s.recv(1024) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    s.close()
                else:
                    kept.append(s)
            self.connections = kept

    def close(self) -> None:
        with self._lock:
            for s in self.connections:
                with contextlib.suppress(OSError):
                    s.close()
            self.connections = []
        self.zeroconf.unregister_all_services()
        self.zeroconf.close()
