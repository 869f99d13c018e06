"""What a daemon runs for its mesh membership, beside its peer service.

Every member enforces the revocation list at each call (kvmesh.net.mesh.admission, an interceptor of the
peer server), serves it to its peers and asks them for newer ones (kvmesh.net.mesh.gossip). The authority
(the node holding the CA key) also serves its join port, where new Macs join and members renew
(kvmesh.net.mesh.membership), and says where in `<data dir>/mesh/join.json` for `kvmesh mesh token`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvmesh.net.addresses import DEFAULT_JOIN_PORT, host_port
from kvmesh.net.mesh import authority
from kvmesh.net.mesh.admission import Admission
from kvmesh.net.mesh.credentials import Membership
from kvmesh.net.mesh.gossip import Gossip
from kvmesh.net.mesh.layout import MeshDir
from kvmesh.net.mesh.membership import JoinPort, MembershipService, serve_join_port
from kvmesh.net.mesh.revocation import Revocations
from kvmesh.v1 import membership_pb2_grpc


def join_port_for(setting: int, peer_port: int) -> int:
    """The join port a `join_port` setting means: -1 is the peer port's neighbour (7078 beside
    7077), or any free port when the peer port is any free port (0), as tests and demos run."""
    if setting >= 0:
        return setting
    return 0 if peer_port == 0 else (DEFAULT_JOIN_PORT if peer_port == DEFAULT_JOIN_PORT - 1 else peer_port + 1)


@dataclass
class MemberRuntime:
    """A daemon's membership: made before its peer server (`interceptors`, `add_to`), started
    after it (`start`), stopped with it."""

    data_dir: Path
    revocations: Revocations
    admission: Admission
    service: MembershipService
    join_port: JoinPort | None = None
    gossip: Gossip | None = None
    _listening: list[str] = field(default_factory=list)

    @staticmethod
    def prepare(
        data_dir: Path, trust_pem: bytes, *, max_days: float, issue_days: float, own_id: str = ""
    ) -> "MemberRuntime":
        """`max_days`: the longest peer certificate accepted; `issue_days`: the longest this node
        issues, if it is the authority; `own_id`: this node's id."""
        revocations = Revocations(data_dir, trust_pem, own_id)
        return MemberRuntime(
            data_dir,
            revocations,
            Admission(revocations, max_days),
            MembershipService(data_dir, revocations, days=min(issue_days, max_days)),
        )

    @property
    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [self.admission]

    def add_to(self, server: grpc.Server) -> None:
        """Serve Revocations (and, on the authority, Join and Renew) on the peer port too."""
        membership_pb2_grpc.add_MembershipServicer_to_server(self.service, server)

    def start(
        self,
        hosts: list[str],
        join_port: int,
        peers: Callable[[], list[str]],
        credentials: Membership,
        *,
        interval: float,
    ) -> list[str]:
        """Gossip with `peers()`; on the authority, serve the join port on `hosts`. Returns the join
        addresses (none on a member)."""
        if authority.is_authority(self.data_dir):
            self.join_port = serve_join_port(self.service, hosts, join_port)
            self._listening = [host_port(h, self.join_port.port) for h in hosts]
            MeshDir.of(self.data_dir).write_join_addresses(self._listening)
        self.gossip = Gossip(self.revocations, peers, credentials, interval=interval)
        self.gossip.start()
        return self._listening

    def spread(self) -> tuple[int, int]:
        """Take the list in the data dir (`kvmesh mesh remove` wrote it) and push it to the live
        peers now: (peers that took it, live peers)."""
        self.revocations.reload()
        return self.gossip.spread() if self.gossip else (0, 0)

    def stop(self) -> None:
        if self.gossip:
            self.gossip.stop()
        if self.join_port:
            MeshDir.of(self.data_dir).join.unlink(missing_ok=True)
            self.join_port.stop()
