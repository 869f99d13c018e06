"""Converters between kvmesh's Python types and the peer service's messages: profiles, decisions,
trailers."""

from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.manifest import CODEC_NAMES, CODECS
from kvmesh.errors import IntegrityError, Rejection
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PROTOCOL_VERSION


def profile_to_proto(profile: ReceiverProfile) -> spb.ReceiverProfile:
    """The profile as sent to a peer: everything but the prompt, which stays here."""
    return spb.ReceiverProfile(
        model=profile.model.to_proto(),
        codecs=sorted(CODECS[c] for c in profile.codecs),
        max_bytes=profile.max_bytes,
        accept_other_weights=profile.accept_other_weights,
        accept_other_chat_template=profile.accept_other_chat_template,
        max_kl=profile.max_kl,
    )


def profile_from_proto(msg: spb.ReceiverProfile) -> ReceiverProfile:
    return ReceiverProfile(
        model=ModelFingerprint.from_proto(msg.model),
        codecs=frozenset(CODEC_NAMES[c] for c in msg.codecs if c in CODEC_NAMES),
        max_bytes=msg.max_bytes,
        accept_other_weights=msg.accept_other_weights,
        accept_other_chat_template=msg.accept_other_chat_template,
        max_kl=msg.max_kl if msg.HasField("max_kl") else None,
    )


def accept() -> spb.Decision:
    return spb.Decision(accept=True)


def reject(rejection: Rejection) -> spb.Decision:
    return spb.Decision(accept=False, reason=rejection.reason, message=rejection.message)


def rejection_of(decision: spb.Decision) -> Rejection:
    return Rejection(decision.reason, decision.message)


def older_protocol(version: int, who: str) -> Rejection | None:
    """Why `who` (the peer, the requester) of protocol `version` is refused before any chunk moves,
    or None when it speaks this one. Before protocol 3, chunks travelled as protobuf messages, and
    the version was not stated at all (0)."""
    if version >= PROTOCOL_VERSION:
        return None
    return Rejection(
        pb.REJECT_REASON_VERSION,
        f"{who} speaks protocol {version or '2 or older'} (chunks as protobuf messages), this peer "
        f"{PROTOCOL_VERSION} (chunks as raw frames): update kvmesh on the older machine",
    )


def trailer(manifest: pb.CacheManifest) -> spb.Trailer:
    """What a sender states after a transfer's last chunk (Fetch and Publish alike)."""
    return spb.Trailer(payload_digest=manifest.encoding.payload_digest, chunk_count=manifest.encoding.chunk_count)


def check_trailer(message: spb.FetchResponse | spb.PublishRequest, manifest: pb.CacheManifest) -> None:
    """The message after a transfer's announced chunks must be a trailer stating the manifest's digest
    and count, else IntegrityError: the sender sent other than it announced. (The receiver's own
    digest of what arrived is checked against the manifest as the chunks are.)"""
    kind = message.WhichOneof("msg")
    if kind != "trailer":
        raise IntegrityError(f"{kind or 'nothing'} where the trailer was due (more chunks than announced?)")
    if message.trailer.payload_digest != manifest.encoding.payload_digest:
        raise IntegrityError("the trailer's digest differs from the manifest's")
    if message.trailer.chunk_count != manifest.encoding.chunk_count:
        raise IntegrityError("the trailer's chunk count differs from the manifest's")
