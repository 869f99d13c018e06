"""What a daemon shares and takes, and the limits every peer is held to."""

import threading
import time
from dataclasses import dataclass

from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.settings import setting


@dataclass(frozen=True)
class Policy:
    """What this daemon shares with and takes from the mesh's members; settings of its config."""

    share_models: tuple[str, ...] = setting(
        (),
        help="share only caches of this model id; others look absent (default: every model)",
        flag="--share-model",
        metavar="MODEL_ID",
    )
    accept_publish: bool = setting(True, help="take no publishes from peers", flag="--read-only")
    publishers: tuple[str, ...] = setting(
        (),
        help="node id allowed to publish here; others are read-only (default: every member)",
        flag="--publisher",
        metavar="NODE_ID",
    )
    max_publish_bytes: int = setting(8 << 30, help="a publish of more decoded bytes is refused before any chunk")
    code_on_request: bool = setting(
        True,
        help="code no stored full cache at a level a receiver asks for (it costs this Mac's CPU or GPU, "
        "and its store keeps the coded copy)",
        flag="--no-code-on-request",
    )
    # A token bucket per peer (a burst of twice the rate), and transfers it may run at once.
    peer_calls_per_second: float = setting(
        50.0, help="calls per second allowed per peer", flag="--peer-rate", metavar="CALLS"
    )
    peer_transfers: int = setting(2, help="transfers one peer may run at once")
    # Timeouts.peer_stream_idle says why it is what it is.
    idle_timeout: float = setting(
        TIMEOUTS.peer_stream_idle,
        help="seconds a peer's stream may wait for its next message (a decision, a chunk), or for the peer "
        "to take the next chunk it is sent, before it is cut (and its transfer slot freed)",
        metavar="SECONDS",
    )
    connection_idle: float = setting(
        TIMEOUTS.connection_idle,
        help="seconds a connection without a call stays open before the daemon closes it",
        metavar="SECONDS",
    )
    max_connections: int = setting(
        0,
        help="incoming connections held at once: in all on a mesh, else on each address served (0: what the "
        "descriptor limit allows)",
    )
    # A member holds one connection for its health checks and one per request in flight: a stranger
    # at one address holding more takes no connection the members need (kvmesh.net.guard).
    connections_per_address: int = setting(
        16,
        help="incoming connections one address may hold at once on the peer port (at most a quarter of "
        "what the descriptor limit allows); more are closed as they come",
    )

    def shares(self, model_id: str) -> bool:
        return not self.share_models or model_id in self.share_models

    def may_publish(self, peer: str) -> bool:
        return self.accept_publish and (not self.publishers or peer in self.publishers)


class PeerLimits:
    """A token bucket and a transfer count per peer identity."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}
        self._transfers: dict[str, int] = {}

    def allow_call(self, peer: str) -> bool:
        rate, burst = self.policy.peer_calls_per_second, 2 * self.policy.peer_calls_per_second
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(peer, (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            allowed = tokens >= 1
            self._buckets[peer] = (tokens - 1 if allowed else tokens, now)
            return allowed

    def start_transfer(self, peer: str) -> bool:
        with self._lock:
            if self._transfers.get(peer, 0) >= self.policy.peer_transfers:
                return False
            self._transfers[peer] = self._transfers.get(peer, 0) + 1
            return True

    def end_transfer(self, peer: str) -> None:
        with self._lock:
            self._transfers[peer] -= 1
