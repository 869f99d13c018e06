"""What a daemon shares and takes, and the limits every peer is held to."""

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    # Model ids whose caches this daemon lists and serves; empty: all.
    share_models: tuple[str, ...] = ()
    accept_publish: bool = True
    # Node ids that may publish; empty: every mesh member. Others are read-only.
    publishers: tuple[str, ...] = ()
    # A publish announcing more decoded bytes than this is refused before any chunk.
    max_publish_bytes: int = 8 << 30
    # Calls a peer may make per second (burst of twice that), and transfers it may run at once.
    peer_calls_per_second: float = 50.0
    peer_transfers: int = 2
    # Seconds a stream may wait for the peer's next message (a decision, a chunk) before it is cut.
    idle_timeout: float = 30.0

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
