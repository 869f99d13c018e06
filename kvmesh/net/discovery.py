"""Finding peers: mDNS adverts and browsing (python-zeroconf), static peers, and health checks.

mDNS says who is out there but not who is alive: a SIGKILLed peer's record lingers in browsers for
many minutes. So every known peer is health-checked over gRPC; one that fails a few checks in a row
is dropped from the live table within seconds and probed on, so it comes back when it answers
again (after a partition heals). The advert carries only ids and a port; what a peer holds is asked
over gRPC.

mDNS is unauthenticated: anyone on the LAN can advertise any node id at any address, or send a
goodbye in any node's name. So an advert is a hint only (`Prover`): a node id is bound to an
address once the peer there proves it, with the mesh certificate for that id in a mutual TLS
handshake (on a plaintext, loopback-only mesh: its Info over the real channel). A goodbye makes
the daemon check the peer at once, and only one that no longer answers leaves the table.
"""

import contextlib
import ipaddress
import logging
import math
import os
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import ifaddr
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroconf import DNSQuestionType, IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from kvmesh.net.addresses import host_port
from kvmesh.net.credentials import SERVER_NAME, Membership, MeshCredentials, node_name
from kvmesh.net.quiet import Quiet
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import SERVICE_NAME, as_bytes, method, open_channel, serialize
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc
from kvmesh.versions import PROTOCOL_VERSION, __version__

SERVICE_TYPE = "_kvmesh._tcp.local."
log = logging.getLogger(__name__)
# Adverts waiting to be proven, at most: a stranger advertising thousands of ids holds no more.
MAX_PENDING_HINTS = 64
# An advert that could not be proven is tried again after 1 s, then twice as long each time up to
# MAX_RETRY_DELAY, for PENDING_FOR seconds (a peer that advertised during a partition is proven
# once it heals).
MAX_RETRY_DELAY = 60.0
PENDING_FOR = 600.0
# A peer with several addresses has each link's rate measured with a probe of this size, at most
# this long, this often (and when a link comes back); another link is taken when it is this many
# times faster than the one in use.
LINK_PROBE_BYTES = 1 << 20
LINK_PROBE_TIMEOUT = 5.0
LINK_PROBE_EVERY = 300.0
SWITCH_FACTOR = 1.5
# A peer that gave no machine name (a version without one, an Info that failed) is asked again after
# this, each time within NAME_TIMEOUT_S (longer than a health check's: Info reads the peer's store).
NAME_RETRY_S = 10.0
NAME_TIMEOUT_S = 2.0
# Why a certificate (PEM) the mesh CA signed is refused all the same (a removed node), or None.
Refuse = Callable[[bytes], str | None]
# The same for a node id.
RefuseNode = Callable[[str], str | None]
# A peer that refused this node (PERMISSION_DENIED: the authority removed it) is asked again after
# this, not at every check: it refuses each call, and each refusal costs it a call.
REFUSED_RETRY_S = 60.0


@dataclass(frozen=True)
class Peer:
    node_id: str
    # "host:port" to try in order.
    addresses: tuple[str, ...]
    source: str  # "mdns" or "static"
    version: str = ""
    # What its Info calls its machine, once it answered one ("" before).
    host_name: str = ""
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
            if old is not None and not peer.host_name:
                peer = replace(peer, host_name=old.host_name)
            self._peers[peer.node_id] = peer
            if old is None or old.addresses != peer.addresses:
                log.info("peer %s at %s (%s)", peer.node_id, ", ".join(peer.addresses), peer.source)

    def get(self, node_id: str) -> Peer | None:
        with self._lock:
            return self._peers.get(node_id)

    def remove(self, node_id: str, why: str) -> None:
        with self._lock:
            if self._peers.pop(node_id, None):
                log.info("peer %s removed: %s", node_id, why)

    def checked(self, node_id: str, ok: bool, drop_after: int, order: Sequence[str] = ()) -> None:
        """Record a health check; the peer leaves the live set after `drop_after` failures in a row.
        `order`: its addresses as they should now be dialled, the chosen one first (HealthChecker)."""
        with self._lock:
            peer = self._peers.get(node_id)
            if peer is None:
                return
            if order and tuple(order) != peer.addresses and set(order) == set(peer.addresses):
                peer = replace(peer, addresses=tuple(order))
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

    def named(self, node_id: str, host_name: str) -> None:
        """Record what a peer's Info calls its machine."""
        with self._lock:
            if (peer := self._peers.get(node_id)) is not None:
                self._peers[node_id] = replace(peer, host_name=host_name)

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


@dataclass(frozen=True)
class Hint:
    """What an mDNS advert claims: node `node_id` at `addresses` ("host:port"). Believed once proven."""

    node_id: str
    addresses: tuple[str, ...]
    version: str = ""


@dataclass(frozen=True)
class Proof:
    """Who the peer at an address proved to be (`node_id`), or why it could not (`why`; `answered`:
    something answered there); `named`: its certificate holds its node's own name, so a channel can
    be pinned to it (`open_channel`)."""

    node_id: str | None
    why: str = ""
    named: bool = False
    answered: bool = True
    # When the certificate it proved itself with ends (seconds since the epoch): a channel opened
    # before then stays open after it, and gRPC does not check the certificate again on it.
    expires: float = math.inf


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a "host:port" as gRPC dials it (an IPv6 host in brackets)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def certificate_name(certificate: dict[str, Any]) -> str | None:
    """The common name (a node id) in the subject of a certificate as `ssl` gives it."""
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def certificate_pems(credentials: Membership | None) -> MeshCredentials | None:
    """The PEMs behind this node's credentials (a RenewingCredentials' current ones), if any."""
    current = getattr(credentials, "current", credentials)
    return current if isinstance(current, MeshCredentials) else None


class Prover:
    """Proves who is at an address: over mutual TLS, the node id in the mesh certificate the peer
    presents (the CA's signature and the peer's key checked by the handshake); without credentials,
    the node id the peer's Info answers. Never logs through gRPC: a stranger costs one log line."""

    def __init__(self, credentials: Membership | None, timeout: float = TIMEOUTS.prove, refuse: Refuse | None = None):
        """`refuse`: why a certificate the CA signed is refused all the same (a removed node), or None."""
        self.credentials, self.timeout, self.refuse = credentials, timeout, refuse
        self._context: tuple[bytes, ssl.SSLContext] | None = None

    def prove(self, address: str) -> Proof:
        pems = certificate_pems(self.credentials)
        if pems is not None:
            return self._by_certificate(address, pems)
        return self._by_info(address)

    def _tls(self, pems: MeshCredentials) -> ssl.SSLContext:
        """A TLS client context with this node's certificate, trusting the mesh CA only (made again
        when the certificate was renewed)."""
        if self._context is not None and self._context[0] == pems.cert_pem:
            return self._context[1]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=pems.trust_pem.decode())
        context.set_alpn_protocols(["h2"])  # gRPC servers expect HTTP/2
        # ssl loads a key only from a file: a private one, removed at once.
        fd, path = tempfile.mkstemp(prefix="kvmesh-prove-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pems.key_pem + pems.cert_pem)
            context.load_cert_chain(path)
        finally:
            os.unlink(path)
        self._context = (pems.cert_pem, context)
        return context

    def _by_certificate(self, address: str, pems: MeshCredentials) -> Proof:
        host, port = split_address(address)
        try:
            with socket.create_connection((host, port), timeout=self.timeout) as raw:
                with self._tls(pems).wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
                    certificate = tls.getpeercert() or {}
                    presented = tls.getpeercert(binary_form=True)
        except ssl.SSLCertVerificationError:
            return Proof(None, "is not a member of this mesh")
        except ssl.SSLError as e:
            if e.reason == "WRONG_VERSION_NUMBER":  # it answered, in plain text: a daemon of no mesh
                return Proof(None, "answers without TLS: it has not joined this mesh (`kvmesh mesh join` there)")
            return Proof(None, f"does not answer ({e})", answered=False)
        except OSError as e:
            return Proof(None, f"does not answer ({getattr(e, 'strerror', None) or e})", answered=False)
        common_name = certificate_name(certificate)
        if not common_name:
            return Proof(None, "presents a certificate without a node id")
        if self.refuse and presented and (why := self.refuse(ssl.DER_cert_to_PEM_cert(presented).encode())):
            return Proof(None, f"is refused: {why}")
        named = ("DNS", node_name(common_name)) in certificate.get("subjectAltName", ())
        ends = certificate.get("notAfter")
        expires = ssl.cert_time_to_seconds(ends) if isinstance(ends, str) else math.inf
        return Proof(common_name, named=named, expires=expires)

    def _by_info(self, address: str) -> Proof:
        try:
            with open_channel(address) as channel:
                info = service_pb2_grpc.KvMeshStub(channel).Info(spb.InfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            return Proof(None, f"does not answer ({e.code().name.lower() if hasattr(e, 'code') else e})")
        return Proof(info.node_id or None, "" if info.node_id else "answers without a node id")


@dataclass
class _Pending:
    hint: Hint
    due: float
    delay: float
    since: float


class Verifier:
    """Turns adverts (hints) and goodbyes into changes of the PeerTable, on its own thread, only
    once they are proven: a node id is bound to the addresses where the peer proved it (`Prover`);
    a goodbye removes a peer only if it no longer answers its health check.

    Unproven hints are retried with backoff for PENDING_FOR seconds (a peer that advertised during
    a partition), at most MAX_PENDING_HINTS at once."""

    def __init__(
        self,
        table: "PeerTable",
        credentials: Membership | None,
        *,
        check_timeout: float = 2.0,
        refuse: Refuse | None = None,
    ):
        self.table, self.credentials, self.check_timeout = table, credentials, check_timeout
        self.prover = Prover(credentials, refuse=refuse)
        self.quiet = Quiet()
        self._pending: dict[str, _Pending] = {}
        self._goodbyes: set[str] = set()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-verify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    def hint(self, hint: Hint) -> None:
        """An advert was heard: prove it unless it says what the table already holds."""
        known = self.table.get(hint.node_id)
        if known is not None and known.healthy and set(hint.addresses) <= set(known.addresses):
            return
        now = time.monotonic()
        with self._wake:
            if hint.node_id not in self._pending and len(self._pending) >= MAX_PENDING_HINTS:
                oldest = min(self._pending, key=lambda k: self._pending[k].since)
                del self._pending[oldest]
            self._pending[hint.node_id] = _Pending(hint, now, 1.0, now)
            self._wake.notify()

    def goodbye(self, node_id: str) -> None:
        """A goodbye was heard in `node_id`'s name: check that peer now."""
        with self._wake:
            self._goodbyes.add(node_id)
            self._pending.pop(node_id, None)
            self._wake.notify()

    def _next(self) -> tuple[list[str], list[Hint]] | None:
        """The goodbyes and the hints due now, waiting for one; None once stopped."""
        with self._wake:
            while not self._stopped:
                now = time.monotonic()
                due = [p.hint for p in self._pending.values() if p.due <= now]
                if self._goodbyes or due:
                    goodbyes, self._goodbyes = sorted(self._goodbyes), set()
                    return goodbyes, due
                soonest = min((p.due for p in self._pending.values()), default=now + 3600)
                self._wake.wait(max(0.01, soonest - now))
        return None

    def _run(self) -> None:
        while (work := self._next()) is not None:
            goodbyes, hints = work
            for node_id in goodbyes:
                self._check_goodbye(node_id)
            for hint in hints:
                self._prove(hint)

    def _check_goodbye(self, node_id: str) -> None:
        peer = self.table.get(node_id)
        if peer is None or peer.source != "mdns":
            return
        answering = [a for a in peer.addresses if check_health(a, self.check_timeout, self.credentials)]
        if not answering:
            self.table.remove(node_id, "said goodbye")
        elif self.quiet.due(("goodbye", node_id)):
            log.warning(
                "a goodbye in the name of peer %s, which still answers at %s: ignored (spoofed?)",
                node_id,
                ", ".join(answering),
            )

    def _prove(self, hint: Hint) -> None:
        proven = []
        for address in hint.addresses:
            proof = self.prover.prove(address)
            if proof.node_id == hint.node_id:
                proven.append(address)
            elif self.quiet.due((hint.node_id, address)):
                why = proof.why or f"proves to be node {proof.node_id}"
                log.warning("node %s at %s %s; ignored", hint.node_id, address, why)
        with self._wake:
            pending = self._pending.get(hint.node_id)
            if pending is None or pending.hint != hint:
                return  # a newer advert (or a goodbye) came meanwhile: that one counts
            if proven:
                del self._pending[hint.node_id]
            elif time.monotonic() - pending.since > PENDING_FOR:
                del self._pending[hint.node_id]
                return
            else:
                pending.due, pending.delay = time.monotonic() + pending.delay, min(MAX_RETRY_DELAY, 2 * pending.delay)
                return
        self.table.upsert(Peer(hint.node_id, tuple(proven), "mdns", hint.version))


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
        """`refuse`: why a peer's certificate is refused though the CA signed it (kvmesh.net.admission)."""
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


@dataclass
class Link:
    """What the health checks measured of one address of a peer: whether it answers, its round
    trip, and (for a peer with several addresses) the rate of a short probe over it."""

    ok: bool = False
    rtt: float | None = None
    rate: float | None = None
    probed_at: float = float("-inf")


def faster(a: Link, b: Link) -> bool:
    """Whether link `a` beats `b` by enough to switch to it (measurements wobble: no flapping)."""
    if a.rate is not None and b.rate is not None:
        return a.rate > SWITCH_FACTOR * b.rate
    return a.rate is not None and b.rate is None


def dialling_order(addresses: Sequence[str], links: dict[str, Link]) -> tuple[str, ...]:
    """A peer's addresses as they should be dialled: the fastest answering one first (the current
    first unless another is clearly faster), then the other answering ones, then the rest."""
    answering = [a for a in addresses if links.get(a, Link()).ok]
    if not answering:
        return tuple(addresses)
    best = answering[0]
    for address in answering[1:]:
        if faster(links[address], links[best]):
            best = address
    rest = [a for a in answering if a != best] + [a for a in addresses if a not in answering]
    return (best, *rest)


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
