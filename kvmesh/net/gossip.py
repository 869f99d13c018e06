"""Spreading the revocation list: each daemon asks its live peers for a newer one, now and then.

The authority writes a new list when it removes a member (`kvmesh mesh remove`); its daemon takes it
from its data dir, and every other member gets it from whichever peer has it, over the peers' mutual
TLS (the Revocations call of kvmesh/v1/membership.proto). A list is adopted only if the mesh CA signed
it and it is newer (kvmesh.net.revocation), so asking any peer, even the removed one, is safe: a
member can withhold a list but never forge or roll one back. A mesh of N members learns a removal
within a few `interval`s, however it is connected.
"""

import logging
import threading
from collections.abc import Callable

import grpc

from kvmesh.net.credentials import Membership
from kvmesh.net.revocation import Revocations
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import open_channel
from kvmesh.v1 import membership_pb2 as mpb
from kvmesh.v1 import membership_pb2_grpc

log = logging.getLogger(__name__)


def ask_peer(address: str, credentials: Membership, version: int, timeout: float = TIMEOUTS.call) -> bytes:
    """The peer's revocation list if it is newer than `version` (b"" if not, or if it cannot answer)."""
    try:
        with open_channel(address, credentials) as channel:
            stub = membership_pb2_grpc.MembershipStub(channel)
            return stub.Revocations(mpb.RevocationsRequest(version=version), timeout=timeout).revocations
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code != grpc.StatusCode.UNAVAILABLE:
            log.debug("peer %s gave no revocation list: %s", address, e)
        return b""


class Gossip:
    """A thread that keeps `revocations` up to date: from this node's data dir, then from each peer
    `peers()` names (their addresses), every `interval` seconds."""

    def __init__(
        self,
        revocations: Revocations,
        peers: Callable[[], list[str]],
        credentials: Membership,
        *,
        interval: float,
    ):
        self.revocations, self.peers, self.credentials, self.interval = revocations, peers, credentials, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-revocations", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def round(self) -> None:
        """One round: the data dir, then every peer (each asked for a list newer than the one held)."""
        self.revocations.reload()
        for address in self.peers():
            if self._stop.is_set():
                return
            data = ask_peer(address, self.credentials, self.revocations.version, timeout=max(1.0, self.interval))
            self.revocations.adopt(data, source=f"peer {address}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.round()
            except Exception:  # one bad round must not end the gossip for the daemon's life
                log.exception("revocation gossip round failed; trying again in %.0f s", self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
