"""Spreading the revocation list: pushed to the live peers as soon as a daemon takes a newer one,
and asked of them now and then, for whoever a push missed.

The authority writes a new list when it removes a member (`kvmesh mesh remove`, which then asks its
daemon to take it: the Control service's SpreadRevocations); every daemon that takes a newer list,
from its data dir or from a peer, pushes it to its live peers at once (the Revocations call of
kvmesh/v1/membership.proto, carrying the list), so a removal crosses the mesh in a few round trips.
A member that was offline, or that a push did not reach, gets it from whichever peer has it when it
next asks (every `interval`). A list is adopted only if the mesh CA signed it and it is newer
(kvmesh.net.mesh.revocation), so taking a list from any peer, even the removed one, is safe: a member can
withhold a list but never forge or roll one back. Each daemon pushes each new version once.
"""

import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

from kvmesh.net.mesh.credentials import Membership
from kvmesh.net.mesh.revocation import RevocationList, Revocations
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import open_channel
from kvmesh.v1 import membership_pb2 as mpb
from kvmesh.v1 import membership_pb2_grpc

log = logging.getLogger(__name__)
# Peers pushed to at once: a mesh is a user's Macs, so this is all of them in one round trip.
PUSHES_AT_ONCE = 16


def ask_peer(
    address: str, credentials: Membership, version: int, timeout: float = TIMEOUTS.call, push: bytes = b""
) -> bytes | None:
    """The peer's revocation list if it is newer than `version` (b"" if not), None if it cannot
    answer; with `push`, this node's list goes with the call for the peer to adopt."""
    try:
        with open_channel(address, credentials) as channel:
            stub = membership_pb2_grpc.MembershipStub(channel)
            request = mpb.RevocationsRequest(version=version, revocations=push)
            return stub.Revocations(request, timeout=timeout).revocations
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code != grpc.StatusCode.UNAVAILABLE:
            log.debug("peer %s gave no revocation list: %s", address, e)
        return None


class Gossip:
    """A thread that keeps `revocations` up to date: from this node's data dir, then from each peer
    `peers()` names (their addresses), every `interval` seconds; and pushes each newer list it takes
    to those peers at once (`spread`)."""

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
        self._pushes = futures.ThreadPoolExecutor(PUSHES_AT_ONCE, thread_name_prefix="kvmesh-revocations-push")
        # One push at a time, each version once: the newest version's push, started as it was taken.
        self._pusher = futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-revocations-spread")
        self._push_lock = threading.Lock()
        self._pushed: tuple[int, futures.Future[tuple[int, int]]] | None = None

    def start(self) -> None:
        self.revocations.on_adopting = self.spread_soon
        self._thread.start()

    def round(self) -> None:
        """One round: the data dir, then every peer (each asked for a list newer than the one held)."""
        self.revocations.reload()
        for address in self.peers():
            if self._stop.is_set():
                return
            data = ask_peer(address, self.credentials, self.revocations.version, timeout=max(1.0, self.interval))
            self.revocations.adopt(data or b"", source=f"peer {address}")

    def spread_soon(self, revocations: RevocationList) -> None:
        """Push `revocations` to the peers live now, on a thread of its own: called as the list is
        taken, maybe inside a peer's call, before this node enforces it, so that the push reaches the
        nodes it removes too (once enforced, the health checks drop them: they would never learn it)."""
        if self.revocations.own_id in revocations.node_ids or self._stop.is_set():
            return  # its peers refuse this node's calls: they learn it from the authority instead
        addresses = self.peers()
        with self._push_lock:
            if self._pushed is None or self._pushed[0] < revocations.version:
                self._pushed = (revocations.version, self._pusher.submit(self._push, revocations, addresses))

    def spread(self) -> tuple[int, int]:
        """Wait for the push of the list held (`kvmesh mesh remove` asks for the push its adoption
        started): (peers that took it, peers live when it was taken)."""
        with self._push_lock:
            pushed = self._pushed
        if pushed is None or pushed[0] != self.revocations.version:
            return 0, len(self.peers())
        return pushed[1].result()

    def _push(self, revocations: RevocationList, addresses: list[str]) -> tuple[int, int]:
        data = revocations.to_bytes()
        try:
            calls = [
                self._pushes.submit(ask_peer, a, self.credentials, revocations.version, TIMEOUTS.prove, data)
                for a in addresses
            ]
            answered = sum(call.result() is not None for call in calls)
        except Exception:  # a failed push leaves the periodic asking to carry the list
            log.exception("pushing the revocation list failed; peers get it when they next ask")
            return 0, len(addresses)
        log.info(
            "revocation list version %d pushed to %d of %d live peers", revocations.version, answered, len(addresses)
        )
        return answered, len(addresses)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.round()
            except Exception:  # one bad round must not end the gossip for the daemon's life
                log.exception("revocation gossip round failed; trying again in %.0f s", self.interval)

    def stop(self) -> None:
        self._stop.set()
        self.revocations.on_adopting = None
        if self._thread.is_alive():
            self._thread.join()
        self._pusher.shutdown(wait=True, cancel_futures=True)
        self._pushes.shutdown(wait=True, cancel_futures=True)
