"""The live peer table: every known peer, and whether it answers its health checks."""

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

log = logging.getLogger(__name__)


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
