"""Peers served in the test process: the real gRPC server (kvmesh.net.server) over the real store,
on 127.0.0.1 at a free port, without a daemon process.

A test of what a peer answers (lookups, fetches, publishes, budgets, damaged stores, busy slots)
needs the server and the store, not the daemon around them: starting one in process takes a tenth
of a second, a daemon process about two (Python, gRPC and the store imported again, then polled
for). Tests of the daemon itself (signals, its log, sockets it holds, restarts, discovery, mesh
credentials) start `kvmesh daemon` processes (support.daemons).
"""

from dataclasses import dataclass
from pathlib import Path

from kvmesh.net.node_id import node_id
from kvmesh.net.policy import Policy
from kvmesh.net.server import RunningServer, start_server
from kvmesh.store import CacheStore
from kvmesh.store.budget import AUTO_BUDGET


@dataclass
class GrpcPeer:
    """One served store: its address (host:port), the store the server holds, the running server."""

    address: str
    store: CacheStore
    server: RunningServer


class GrpcPeers:
    """The in-process peers of one test (the `grpc_peer` fixture): `start` serves a store as a
    daemon would (its node id from `<store>.data`, the store opened with the daemon's budget
    setting); `stop_all` stops every one, calls in flight cut at once."""

    def __init__(self) -> None:
        self.started: list[GrpcPeer] = []

    def start(
        self,
        store_root: Path | str,
        *,
        store_budget: int | None = AUTO_BUDGET,
        max_transfers: int = 4,
        policy: Policy | None = None,
    ) -> GrpcPeer:
        """Serve `store_root` on 127.0.0.1 at a free port; `store_budget` as `--store-budget`
        (-1: a share of its disk, 0: no limit), `max_transfers` as `--max-transfers`."""
        store = CacheStore(store_root, max_bytes=store_budget)
        identity = node_id(Path(f"{store_root}.data"))
        server = start_server(store, identity, "127.0.0.1:0", max_transfers=max_transfers, policy=policy)
        peer = GrpcPeer(f"127.0.0.1:{server.port}", store, server)
        self.started.append(peer)
        return peer

    def stop_all(self) -> None:
        for peer in self.started:
            peer.server.stop(grace=0)
        self.started.clear()
