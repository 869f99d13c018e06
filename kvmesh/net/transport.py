"""How kvmesh talks gRPC: service names, message limits, channel and server options, channels.

The lowest layer of the network and free of MLX, so discovery, the control client and the light
CLI commands (`status`, `peers`) start fast.
"""

import grpc
from google.protobuf.message import Message

from kvmesh.codec.limits import MAX_CHUNK_SIZE, max_encoded_length
from kvmesh.net.mesh.credentials import Membership
from kvmesh.net.mesh.pki import SERVER_NAME, node_name
from kvmesh.net.timeouts import TIMEOUTS

SERVICE_NAME = "kvmesh.v1.KvMesh"
# The largest message either side accepts: one chunk of the largest allowed size, plus framing.
MAX_MESSAGE_BYTES = max_encoded_length(MAX_CHUNK_SIZE) + (1 << 20)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive pings (Timeouts.keepalive); peers accept them as often as every keepalive_ack.
    ("grpc.keepalive_time_ms", int(TIMEOUTS.keepalive * 1000)),
    ("grpc.keepalive_timeout_ms", int(TIMEOUTS.keepalive_ack * 1000)),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(TIMEOUTS.keepalive_ack * 1000)),
    ("grpc.http2.max_ping_strikes", 0),
]
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.server_handshake_timeout_ms", int(TIMEOUTS.handshake * 1000)),
    # gRPC sets SO_REUSEPORT by default: a second daemon would bind the same port and take half
    # the clients. One server per port.
    ("grpc.so_reuseport", 0),
    # Old connections go (their calls finish first: the grace is gRPC's default, unbounded), so
    # renewed certificates reach connections that would otherwise live for months.
    ("grpc.max_connection_age_ms", int(TIMEOUTS.connection_age * 1000)),
]


def server_options(*, connection_idle: float, max_connections: int) -> list[tuple[str, int]]:
    """The peer server's options: SERVER_OPTIONS, idle connections closed after `connection_idle`
    seconds, and at most `max_connections` connections at once on each listening address.

    gRPC offers no limit per client address, only this one per listener (a connection over it is
    closed as it is accepted): it keeps the daemon's descriptors from running out, so its store and
    its own health checks go on while a stranger holds hundreds of connections. On a mesh the
    guard in front of gRPC (kvmesh.net.guard) also holds each address to its share, so that a
    stranger takes none of the connections members need.
    """
    return [
        *SERVER_OPTIONS,
        ("grpc.max_connection_idle_ms", int(connection_idle * 1000)),
        ("grpc.max_allowed_incoming_connections", max_connections),
    ]


def open_channel(address: str, credentials: Membership | None = None, node_id: str | None = None) -> grpc.Channel:
    """A channel to a peer: mutual TLS with mesh credentials (the peer must prove it is a member);
    with `node_id`, the peer must prove it is that node (its certificate holds `node_name(node_id)`),
    at every handshake of the channel: gRPC's Python API shows a client no server certificate, so
    only the TLS hostname check can pin who answers."""
    if credentials is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    name = node_name(node_id) if node_id else SERVER_NAME
    return grpc.secure_channel(
        address, credentials.channel_credentials(), options=[*GRPC_OPTIONS, ("grpc.ssl_target_name_override", name)]
    )


def serialize(message: Message | bytes) -> bytes:
    """Protobuf messages serialized; chunk frames and probe data, already bytes, as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def as_bytes(data: bytes) -> bytes:
    """The deserializer of streams whose messages their reader parses itself (chunk frames)."""
    return data


def method(name: str) -> str:
    """The path of one of the peer service's methods."""
    return f"/{SERVICE_NAME}/{name}"
