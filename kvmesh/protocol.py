"""What both ends of a kvmesh gRPC connection agree on: limits, and profile/decision messages."""

import grpc

from .compat import CODEC_NAMES, MAX_CHUNK_SIZE, ReceiverProfile, Rejection
from .codec import max_encoded_length
from .credentials import SERVER_NAME, MeshCredentials
from .fingerprint import ModelFingerprint
from .manifest import CODECS
from .v1 import service_pb2 as spb

PROTOCOL_VERSION = 1
SERVICE_NAME = "kvmesh.v1.KvMesh"
# The largest message either side accepts: one chunk of the largest allowed size, plus framing.
MAX_MESSAGE_BYTES = max_encoded_length(MAX_CHUNK_SIZE) + (1 << 20)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A peer that opens a connection and never finishes the TLS handshake is dropped after this.
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.server_handshake_timeout_ms", 10_000)]


def open_channel(address: str, credentials: MeshCredentials | None = None) -> grpc.Channel:
    """A channel to a peer: mutual TLS with mesh credentials (the peer must prove it is a member)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.secure_channel(
        address, credentials.channel_credentials(),
        options=GRPC_OPTIONS + [("grpc.ssl_target_name_override", SERVER_NAME)],
    )


def profile_to_proto(profile: ReceiverProfile) -> spb.ReceiverProfile:
    """The profile as sent to a peer: everything but the prompt, which stays here."""
    return spb.ReceiverProfile(
        model=profile.model.to_proto(),
        codecs=sorted(CODECS[c] for c in profile.codecs),
        max_bytes=profile.max_bytes,
        accept_other_weights=profile.accept_other_weights,
        accept_other_chat_template=profile.accept_other_chat_template,
    )


def profile_from_proto(msg: spb.ReceiverProfile) -> ReceiverProfile:
    return ReceiverProfile(
        model=ModelFingerprint.from_proto(msg.model),
        codecs=frozenset(CODEC_NAMES[c] for c in msg.codecs if c in CODEC_NAMES),
        max_bytes=msg.max_bytes,
        accept_other_weights=msg.accept_other_weights,
        accept_other_chat_template=msg.accept_other_chat_template,
    )


def accept() -> spb.Decision:
    return spb.Decision(accept=True)


def reject(rejection: Rejection) -> spb.Decision:
    return spb.Decision(accept=False, reason=rejection.reason, message=rejection.message)


def rejection_of(decision: spb.Decision) -> Rejection:
    return Rejection(decision.reason, decision.message)
