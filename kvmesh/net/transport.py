"""How kvmesh talks gRPC: service names, message limits, channel and server options, channels.

The lowest layer of the network and free of MLX, so discovery, the control client and the light
CLI commands (`status`, `peers`) start fast.
"""

import grpc

from kvmesh.codec.limits import MAX_CHUNK_SIZE, max_encoded_length
from kvmesh.net.credentials import SERVER_NAME, MeshCredentials

SERVICE_NAME = "kvmesh.v1.KvMesh"
CONTROL_SERVICE_NAME = "kvmesh.v1.Control"
# The largest message either side accepts: one chunk of the largest allowed size, plus framing.
MAX_MESSAGE_BYTES = max_encoded_length(MAX_CHUNK_SIZE) + (1 << 20)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A peer that opens a connection and never finishes the TLS handshake is dropped after this.
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.server_handshake_timeout_ms", 10_000)]


def open_channel(address: str, credentials: MeshCredentials | None = None) -> grpc.Channel:
    """A channel to a peer: mutual TLS with mesh credentials (the peer must prove it is a member)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.secure_channel(
        address,
        credentials.channel_credentials(),
        options=[*GRPC_OPTIONS, ("grpc.ssl_target_name_override", SERVER_NAME)],
    )
