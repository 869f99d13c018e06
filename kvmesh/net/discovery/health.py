"""Health checks: mDNS says who is out there but not who is alive (a SIGKILLed peer's record
lingers in browsers for many minutes), so every known peer is checked over gRPC; one that fails a few
checks in a row is dropped from the live table within seconds and checked on, so it comes back when
it answers again (after a partition heals)."""

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.net.discovery.links import LINK_PROBE_BYTES, LINK_PROBE_EVERY, LINK_PROBE_TIMEOUT, Link, dialling_order
from kvmesh.net.discovery.peers import Peer, PeerTable
from kvmesh.net.discovery.proof import Prover, Refuse, RefuseNode, certificate_pems
from kvmesh.net.mesh.credentials import Membership
from kvmesh.net.quiet import Quiet
from kvmesh.net.transport import SERVICE_NAME, as_bytes, method, open_channel, serialize
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc

log = logging.getLogger(__name__)
# A peer that gave no machine name (a version without one, an Info that failed) is asked again after
# this, each time within NAME_TIMEOUT_S (longer than a health check's: Info reads the peer's store).
NAME_RETRY_S = 10.0
NAME_TIMEOUT_S = 2.0
# A peer that refused this node (PERMISSION_DENIED: the authority removed it) is asked again after
# this, not at every check: it refuses each call, and each refusal costs it a call.
REFUSED_RETRY_S = 60.0


def check_health(address: str, timeout: float, credentials: Membership | None = None) -> bool:
    try:
        with open_channel(address, credentials) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout
            )
            return response.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


@dataclass(frozen=True)
class _Dialled:
    """A health-check channel, and who proved to be at its address when it was opened ("" on a
    plaintext mesh)."""

    channel: grpc.Channel
    node_id: str
    expires: float = math.inf  # when the certificate proven at the address ends


class HealthChecker:
    """Checks every address of every known peer each `interval` seconds, on its own thread.

    Each address keeps one channel while it answers: a check is then a call on a connection already
    open, which holds while a stranger uses up the peer's connections (and costs no handshake each
    second). A failed check closes its channel; the next one dials afresh. A peer with several
    addresses (Wi-Fi and a Thunderbolt bridge, say) is probed on each now and then, and the fastest
    answering one is dialled first (`dialling_order`): a fetch takes the fast link, and the next
    one when that fails.

    Over mutual TLS a channel is opened only to the node proven to be at the address (`Prover`:
    an mDNS peer's own id, whoever a static peer is), pinned to it (`open_channel`), and only while
    that node is not refused (`refuse_node`: removed from the mesh): a removed node is neither
    checked nor healthy, so no request fetches from it, and no other node can answer in its place.
    A peer that refuses this node (PERMISSION_DENIED: this node was removed) is asked again only
    every REFUSED_RETRY_S."""

    def __init__(
        self,
        table: PeerTable,
        *,
        interval: float = 1.0,
        drop_after: int = 2,
        forget_after: float = 600.0,
        credentials: Membership | None = None,
        refuse: Refuse | None = None,
        refuse_node: RefuseNode | None = None,
    ):
        """`refuse`: why a certificate the CA signed is refused (a removed node), or None;
        `refuse_node`: the same for a node id (the revocation list changes while channels are open)."""
        self.table, self.interval, self.drop_after, self.forget_after = table, interval, drop_after, forget_after
        self.credentials, self.refuse_node = credentials, refuse_node
        self.prover = Prover(credentials, timeout=max(1.0, interval), refuse=refuse)
        self.quiet = Quiet()
        self._channels: dict[str, _Dialled] = {}
        self._refused_until: dict[str, float] = {}  # address -> when to ask a peer that refused this node
        self.links: dict[str, Link] = {}
        self._named_at: dict[str, float] = {}  # node id -> when its name was last asked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _channel(self, address: str) -> grpc.Channel:
        """The open channel of an address that answered its last check."""
        return self._channels[address].channel

    def _dial(self, peer: Peer, address: str) -> grpc.Channel | None:
        """The channel to check `peer` at `address` on: the one open, or a new one to the node proven
        to be there (None, said once, when none may be dialled)."""
        dialled = self._channels.get(address)
        if dialled is not None and time.time() >= dialled.expires:  # proven again: its handshake now fails
            self._close(address)
            self._say(
                ("expired", dialled.node_id, address),
                "peer %s at %s: its certificate has ended; it is dialled again only once it has renewed it",
                peer.node_id,
                address,
            )
            dialled = None
        if dialled is None:
            node, pinned, expires = self._identify(peer, address)
            if node is None:
                return None
            channel = open_channel(address, self.credentials, pinned)
            dialled = self._channels[address] = _Dialled(channel, node, expires)
        if dialled.node_id and self.refuse_node and (why := self.refuse_node(dialled.node_id)):
            self._close(address)
            self._say(
                ("refused", dialled.node_id, address), "peer %s at %s is not dialled: %s", peer.node_id, address, why
            )
            return None
        return dialled.channel

    def _identify(self, peer: Peer, address: str) -> tuple[str | None, str | None, float]:
        """(who is at `address`, the node id to pin its channel to, when its certificate ends):
        ("", None, inf) on a plaintext mesh; (None, None, inf) when no node may be dialled there."""
        if certificate_pems(self.credentials) is None:
            return "", None, math.inf
        proof = self.prover.prove(address)
        if proof.node_id is None or (peer.source == "mdns" and proof.node_id != peer.node_id):
            why = proof.why or f"proves to be node {proof.node_id}"
            if proof.answered:  # a peer that is down is only that: its checks fail, and it is dropped
                self._say(
                    ("proof", peer.node_id, address, why), "peer %s at %s %s; ignored", peer.node_id, address, why
                )
            return None, None, math.inf
        if not proof.named:
            self._say(
                ("unnamed", proof.node_id),
                "peer %s at %s holds a certificate without its node's name (an older kvmesh issued it): "
                "dialled without pinning its identity until it renews (`kvmesh mesh renew` there)",
                proof.node_id,
                address,
            )
            return proof.node_id, None, proof.expires
        return proof.node_id, proof.node_id, proof.expires

    def _say(self, key: object, message: str, *args: object) -> None:
        if self.quiet.due(key):
            log.warning(message, *args)

    def _close(self, address: str) -> None:
        if (dialled := self._channels.pop(address, None)) is not None:
            dialled.channel.close()

    def _check(self, peer: Peer, address: str) -> bool:
        link = self.links.setdefault(address, Link())
        if time.monotonic() < self._refused_until.get(address, 0.0) or (channel := self._dial(peer, address)) is None:
            link.ok = False
            return False
        start = time.perf_counter()
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=self.interval
            )
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                rtt = time.perf_counter() - start
                link.rtt = rtt if link.rtt is None else 0.8 * link.rtt + 0.2 * rtt
                if not link.ok:
                    link.probed_at = float("-inf")  # back: measure it again
                link.ok = True
                return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                self._refused_until[address] = time.monotonic() + REFUSED_RETRY_S
                self._say(
                    ("refuses us", address), "peer %s at %s refuses this node: %s", peer.node_id, address, e.details()
                )
        link.ok = False
        self._close(address)
        return False

    def _probe(self, address: str) -> None:
        """Measure the rate of one of a multi-homed peer's links with a short Probe."""
        link = self.links[address]
        link.probed_at = time.monotonic()
        probe = self._channel(address).unary_stream(
            method("Probe"), request_serializer=serialize, response_deserializer=as_bytes
        )
        start, received = time.perf_counter(), 0
        try:
            for message in probe(spb.ProbeRequest(bytes=LINK_PROBE_BYTES), timeout=LINK_PROBE_TIMEOUT):
                received += len(message)
        except grpc.RpcError:
            return  # a busy or slow peer: measured again later
        if received:
            link.rate = received / (time.perf_counter() - start)

    def _name(self, peer: Peer, address: str) -> None:
        """Ask a peer that answers for its machine's name (over the checked channel): once, or
        again after NAME_RETRY_S when it gave none (the checks of every peer wait on it: not at
        every check)."""
        if time.monotonic() - self._named_at.get(peer.node_id, float("-inf")) < NAME_RETRY_S:
            return
        self._named_at[peer.node_id] = time.monotonic()
        try:
            info = service_pb2_grpc.KvMeshStub(self._channel(address)).Info(spb.InfoRequest(), timeout=NAME_TIMEOUT_S)
        except grpc.RpcError:
            return
        self.table.named(peer.node_id, info.host_name)

    def _check_peer(self, peer: Peer) -> tuple[bool, tuple[str, ...]]:
        """Whether the peer answers on any address, and its addresses in dialling order."""
        answered = [a for a in peer.addresses if self._check(peer, a)]
        if answered and not peer.host_name:
            self._name(peer, answered[0])
        if len(peer.addresses) > 1:
            for address in answered:
                if time.monotonic() - self.links[address].probed_at > LINK_PROBE_EVERY:
                    self._probe(address)
        return bool(answered), dialling_order(peer.addresses, self.links)

    def _describe(self, addresses: Sequence[str]) -> str:
        """What was measured of each address, for the log."""

        def one(address: str) -> str:
            link = self.links.get(address, Link())
            if not link.ok:
                return f"{address} does not answer"
            return f"{address} {link.rate / 1e6:,.1f} MB/s" if link.rate else f"{address} answers"

        return "; ".join(one(a) for a in addresses)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            peers = self.table.all()
            for peer in peers:
                if peer.source == "mdns" and self.refuse_node and (why := self.refuse_node(peer.node_id)):
                    self.table.remove(peer.node_id, why)
                    continue
                ok, order = self._check_peer(peer)
                if order[0] != peer.addresses[0]:
                    log.info("peer %s: dialled at %s now (%s)", peer.node_id, order[0], self._describe(order))
                self.table.checked(peer.node_id, ok, self.drop_after, order)
                if not ok and peer.source == "mdns" and time.monotonic() - peer.last_ok > self.forget_after:
                    self.table.remove(peer.node_id, f"silent for {self.forget_after:.0f} s")
            known = {a for p in peers for a in p.addresses}
            for address in [a for a in self._channels if a not in known]:
                self._close(address)
            for address in [a for a in self.links if a not in known]:
                del self.links[address]
                self._refused_until.pop(address, None)
            for node in set(self._named_at) - {p.node_id for p in peers}:
                del self._named_at[node]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for address in list(self._channels):
            self._close(address)
