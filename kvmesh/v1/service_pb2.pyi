from kvmesh.v1 import cache_pb2 as _cache_pb2
from kvmesh.v1 import model_pb2 as _model_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("entries", "bytes", "budget_bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    budget_bytes: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("fetches_started", "fetches_completed", "fetches_rejected", "fetches_failed", "chunk_bytes_sent", "transfers_active", "transfers_max_seen", "transfers_cap", "publishes_accepted", "publishes_rejected")
    FETCHES_STARTED_FIELD_NUMBER: _ClassVar[int]
    FETCHES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FETCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FAILED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_MAX_SEEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_CAP_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    fetches_started: int
    fetches_completed: int
    fetches_rejected: int
    fetches_failed: int
    chunk_bytes_sent: int
    transfers_active: int
    transfers_max_seen: int
    transfers_cap: int
    publishes_accepted: int
    publishes_rejected: int
    def __init__(self, fetches_started: _Optional[int] = ..., fetches_completed: _Optional[int] = ..., fetches_rejected: _Optional[int] = ..., fetches_failed: _Optional[int] = ..., chunk_bytes_sent: _Optional[int] = ..., transfers_active: _Optional[int] = ..., transfers_max_seen: _Optional[int] = ..., transfers_cap: _Optional[int] = ..., publishes_accepted: _Optional[int] = ..., publishes_rejected: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("node_id", "version", "protocol_version", "model_ids", "store", "transfers", "host_name")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    protocol_version: int
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    store: StoreStats
    transfers: TransferStats
    host_name: str
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., model_ids: _Optional[_Iterable[str]] = ..., store: _Optional[_Union[StoreStats, _Mapping]] = ..., transfers: _Optional[_Union[TransferStats, _Mapping]] = ..., host_name: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_id", "block_size", "block_hashes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("cache_id", "num_tokens", "prefix_sha256", "matched_tokens", "cuttable", "method", "raw_bytes", "stored_bytes", "lossy", "quality", "on_request", "predicted")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHA256_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CUTTABLE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    ON_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    num_tokens: int
    prefix_sha256: bytes
    matched_tokens: int
    cuttable: bool
    method: str
    raw_bytes: int
    stored_bytes: int
    lossy: bool
    quality: _cache_pb2.Quality
    on_request: OnRequest
    predicted: bool
    def __init__(self, cache_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., prefix_sha256: _Optional[bytes] = ..., matched_tokens: _Optional[int] = ..., cuttable: _Optional[bool] = ..., method: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., lossy: _Optional[bool] = ..., quality: _Optional[_Union[_cache_pb2.Quality, _Mapping]] = ..., on_request: _Optional[_Union[OnRequest, _Mapping]] = ..., predicted: _Optional[bool] = ...) -> None: ...

class OnRequest(_message.Message):
    __slots__ = ("basis_sha256", "basis_bytes", "fp16_bytes", "coded_bytes", "encode_s", "encode_fixed_s", "unpredicted")
    BASIS_SHA256_FIELD_NUMBER: _ClassVar[int]
    BASIS_BYTES_FIELD_NUMBER: _ClassVar[int]
    FP16_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    UNPREDICTED_FIELD_NUMBER: _ClassVar[int]
    basis_sha256: str
    basis_bytes: int
    fp16_bytes: int
    coded_bytes: int
    encode_s: float
    encode_fixed_s: float
    unpredicted: bool
    def __init__(self, basis_sha256: _Optional[str] = ..., basis_bytes: _Optional[int] = ..., fp16_bytes: _Optional[int] = ..., coded_bytes: _Optional[int] = ..., encode_s: _Optional[float] = ..., encode_fixed_s: _Optional[float] = ..., unpredicted: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class ReceiverProfile(_message.Message):
    __slots__ = ("model", "codecs", "max_bytes", "accept_other_weights", "accept_other_chat_template", "max_kl")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_OTHER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_OTHER_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_KL_FIELD_NUMBER: _ClassVar[int]
    model: _model_pb2.ModelFingerprint
    codecs: _containers.RepeatedScalarFieldContainer[_cache_pb2.Codec]
    max_bytes: int
    accept_other_weights: bool
    accept_other_chat_template: bool
    max_kl: float
    def __init__(self, model: _Optional[_Union[_model_pb2.ModelFingerprint, _Mapping]] = ..., codecs: _Optional[_Iterable[_Union[_cache_pb2.Codec, str]]] = ..., max_bytes: _Optional[int] = ..., accept_other_weights: _Optional[bool] = ..., accept_other_chat_template: _Optional[bool] = ..., max_kl: _Optional[float] = ...) -> None: ...

class FetchOpen(_message.Message):
    __slots__ = ("cache_id", "num_tokens", "profile", "protocol_version", "held_tokens", "frame_batches", "code")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FRAME_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    num_tokens: int
    profile: ReceiverProfile
    protocol_version: int
    held_tokens: int
    frame_batches: bool
    code: CodeRequest
    def __init__(self, cache_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., profile: _Optional[_Union[ReceiverProfile, _Mapping]] = ..., protocol_version: _Optional[int] = ..., held_tokens: _Optional[int] = ..., frame_batches: _Optional[bool] = ..., code: _Optional[_Union[CodeRequest, _Mapping]] = ...) -> None: ...

class CodeRequest(_message.Message):
    __slots__ = ("level", "link_bytes_per_s")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    level: str
    link_bytes_per_s: float
    def __init__(self, level: _Optional[str] = ..., link_bytes_per_s: _Optional[float] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("accept", "reason", "message")
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accept: bool
    reason: _cache_pb2.RejectReason
    message: str
    def __init__(self, accept: _Optional[bool] = ..., reason: _Optional[_Union[_cache_pb2.RejectReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("payload_digest", "chunk_count")
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    payload_digest: bytes
    chunk_count: int
    def __init__(self, payload_digest: _Optional[bytes] = ..., chunk_count: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("open", "decision")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    open: FetchOpen
    decision: Decision
    def __init__(self, open: _Optional[_Union[FetchOpen, _Mapping]] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("manifest", "trailer", "refused", "protocol_version")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    manifest: _cache_pb2.CacheManifest
    trailer: Trailer
    refused: Decision
    protocol_version: int
    def __init__(self, manifest: _Optional[_Union[_cache_pb2.CacheManifest, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., refused: _Optional[_Union[Decision, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("manifest", "trailer", "protocol_version")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    manifest: _cache_pb2.CacheManifest
    trailer: Trailer
    protocol_version: int
    def __init__(self, manifest: _Optional[_Union[_cache_pb2.CacheManifest, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("cache_id",)
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    def __init__(self, cache_id: _Optional[str] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("decision", "result", "protocol_version", "frame_batches")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FRAME_BATCHES_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    result: PublishResult
    protocol_version: int
    frame_batches: bool
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ..., result: _Optional[_Union[PublishResult, _Mapping]] = ..., protocol_version: _Optional[int] = ..., frame_batches: _Optional[bool] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class ProbeData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ArtifactRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class ArtifactData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
