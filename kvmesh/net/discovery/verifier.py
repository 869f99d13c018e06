"""From adverts to the peer table: an mDNS advert (a `Hint`) binds a node id to an address only once
the peer there proves it (kvmesh.net.discovery.proof), and a goodbye removes a peer only once it no
longer answers. Anyone on the LAN can advertise any node id at any address, or say goodbye in any
node's name."""

import logging
import threading
import time
from dataclasses import dataclass

from kvmesh.net.discovery.health import check_health
from kvmesh.net.discovery.peers import Peer, PeerTable
from kvmesh.net.discovery.proof import Prover, Refuse
from kvmesh.net.mesh.credentials import Membership
from kvmesh.net.quiet import Quiet

log = logging.getLogger(__name__)
# Adverts waiting to be proven, at most: a stranger advertising thousands of ids holds no more.
MAX_PENDING_HINTS = 64
# An advert that could not be proven is tried again after 1 s, then twice as long each time up to
# MAX_RETRY_DELAY, for PENDING_FOR seconds (a peer that advertised during a partition is proven
# once it heals).
MAX_RETRY_DELAY = 60.0
PENDING_FOR = 600.0


@dataclass(frozen=True)
class Hint:
    """What an mDNS advert claims: node `node_id` at `addresses` ("host:port"). Believed once proven."""

    node_id: str
    addresses: tuple[str, ...]
    version: str = ""


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
        table: PeerTable,
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
