from kvmesh.v1 import model_pb2 as _model_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]

class DigestAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIGEST_ALGORITHM_UNSPECIFIED: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_XXH3: _ClassVar[DigestAlgorithm]

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_SPARSE_KV: _ClassVar[CacheKind]
    CACHE_KIND_SPARSE_QUANTIZED_KV: _ClassVar[CacheKind]
    CACHE_KIND_ROTATING_KV: _ClassVar[CacheKind]
    CACHE_KIND_ARRAYS: _ClassVar[CacheKind]
    CACHE_KIND_CHUNKED_KV: _ClassVar[CacheKind]
    CACHE_KIND_LIST: _ClassVar[CacheKind]
    CACHE_KIND_TRANSFORM_KV: _ClassVar[CacheKind]

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_REASON_SCHEMA: _ClassVar[RejectReason]
    REJECT_REASON_MODEL_CONFIG: _ClassVar[RejectReason]
    REJECT_REASON_WEIGHTS: _ClassVar[RejectReason]
    REJECT_REASON_TOKENIZER: _ClassVar[RejectReason]
    REJECT_REASON_CHAT_TEMPLATE: _ClassVar[RejectReason]
    REJECT_REASON_GEOMETRY: _ClassVar[RejectReason]
    REJECT_REASON_PREFIX: _ClassVar[RejectReason]
    REJECT_REASON_CODEC: _ClassVar[RejectReason]
    REJECT_REASON_DTYPE: _ClassVar[RejectReason]
    REJECT_REASON_CACHE_CLASS: _ClassVar[RejectReason]
    REJECT_REASON_SIZE_LIMIT: _ClassVar[RejectReason]
    REJECT_REASON_MALFORMED: _ClassVar[RejectReason]
    REJECT_REASON_POLICY: _ClassVar[RejectReason]
    REJECT_REASON_QUALITY: _ClassVar[RejectReason]
    REJECT_REASON_VERSION: _ClassVar[RejectReason]
    REJECT_REASON_ARTIFACT: _ClassVar[RejectReason]
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_ZSTD: Codec
DIGEST_ALGORITHM_UNSPECIFIED: DigestAlgorithm
DIGEST_ALGORITHM_XXH3: DigestAlgorithm
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_SPARSE_KV: CacheKind
CACHE_KIND_SPARSE_QUANTIZED_KV: CacheKind
CACHE_KIND_ROTATING_KV: CacheKind
CACHE_KIND_ARRAYS: CacheKind
CACHE_KIND_CHUNKED_KV: CacheKind
CACHE_KIND_LIST: CacheKind
CACHE_KIND_TRANSFORM_KV: CacheKind
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_REASON_SCHEMA: RejectReason
REJECT_REASON_MODEL_CONFIG: RejectReason
REJECT_REASON_WEIGHTS: RejectReason
REJECT_REASON_TOKENIZER: RejectReason
REJECT_REASON_CHAT_TEMPLATE: RejectReason
REJECT_REASON_GEOMETRY: RejectReason
REJECT_REASON_PREFIX: RejectReason
REJECT_REASON_CODEC: RejectReason
REJECT_REASON_DTYPE: RejectReason
REJECT_REASON_CACHE_CLASS: RejectReason
REJECT_REASON_SIZE_LIMIT: RejectReason
REJECT_REASON_MALFORMED: RejectReason
REJECT_REASON_POLICY: RejectReason
REJECT_REASON_QUALITY: RejectReason
REJECT_REASON_VERSION: RejectReason
REJECT_REASON_ARTIFACT: RejectReason

class Prefix(_message.Message):
    __slots__ = ("num_tokens", "sha256", "block_size", "block_hashes")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    sha256: bytes
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, num_tokens: _Optional[int] = ..., sha256: _Optional[bytes] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _model_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_model_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("kind", "n_kept", "offset", "bits", "group_size", "tensors", "window", "keep", "chunk_size", "start_position", "parts", "transform")
    KIND_FIELD_NUMBER: _ClassVar[int]
    N_KEPT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFORM_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    n_kept: int
    offset: int
    bits: int
    group_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    window: int
    keep: int
    chunk_size: int
    start_position: int
    parts: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    transform: TransformSpec
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., n_kept: _Optional[int] = ..., offset: _Optional[int] = ..., bits: _Optional[int] = ..., group_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., window: _Optional[int] = ..., keep: _Optional[int] = ..., chunk_size: _Optional[int] = ..., start_position: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., transform: _Optional[_Union[TransformSpec, _Mapping]] = ...) -> None: ...

class Rotary(_message.Message):
    __slots__ = ("dims", "traditional", "base", "scale", "freqs")
    DIMS_FIELD_NUMBER: _ClassVar[int]
    TRADITIONAL_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    FREQS_FIELD_NUMBER: _ClassVar[int]
    dims: int
    traditional: bool
    base: float
    scale: float
    freqs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, dims: _Optional[int] = ..., traditional: _Optional[bool] = ..., base: _Optional[float] = ..., scale: _Optional[float] = ..., freqs: _Optional[_Iterable[float]] = ...) -> None: ...

class TransformSpec(_message.Message):
    __slots__ = ("basis_sha256", "basis_layer", "kv_heads", "head_dim", "sinks", "recent", "key_step", "value_step", "key_components", "value_components", "rotary", "tail", "key_tail_step", "value_tail_step", "key_tail_components", "value_tail_components", "predicted")
    BASIS_SHA256_FIELD_NUMBER: _ClassVar[int]
    BASIS_LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SINKS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    KEY_STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ROTARY_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    KEY_TAIL_STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_TAIL_STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_TAIL_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_TAIL_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    basis_sha256: str
    basis_layer: int
    kv_heads: int
    head_dim: int
    sinks: int
    recent: int
    key_step: float
    value_step: float
    key_components: int
    value_components: int
    rotary: Rotary
    tail: int
    key_tail_step: float
    value_tail_step: float
    key_tail_components: int
    value_tail_components: int
    predicted: bool
    def __init__(self, basis_sha256: _Optional[str] = ..., basis_layer: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., sinks: _Optional[int] = ..., recent: _Optional[int] = ..., key_step: _Optional[float] = ..., value_step: _Optional[float] = ..., key_components: _Optional[int] = ..., value_components: _Optional[int] = ..., rotary: _Optional[_Union[Rotary, _Mapping]] = ..., tail: _Optional[int] = ..., key_tail_step: _Optional[float] = ..., value_tail_step: _Optional[float] = ..., key_tail_components: _Optional[int] = ..., value_tail_components: _Optional[int] = ..., predicted: _Optional[bool] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("kind", "sha256", "nbytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    sha256: str
    nbytes: int
    def __init__(self, kind: _Optional[str] = ..., sha256: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PressConfig(_message.Message):
    __slots__ = ("ratio", "budget", "kv_bits", "kv_group_size", "sinks", "window", "kernel")
    RATIO_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SINKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    ratio: float
    budget: int
    kv_bits: int
    kv_group_size: int
    sinks: int
    window: int
    kernel: int
    def __init__(self, ratio: _Optional[float] = ..., budget: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., sinks: _Optional[int] = ..., window: _Optional[int] = ..., kernel: _Optional[int] = ...) -> None: ...

class Compression(_message.Message):
    __slots__ = ("method", "config")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    method: str
    config: PressConfig
    def __init__(self, method: _Optional[str] = ..., config: _Optional[_Union[PressConfig, _Mapping]] = ...) -> None: ...

class Quality(_message.Message):
    __slots__ = ("metric", "value", "tokens")
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    metric: str
    value: float
    tokens: int
    def __init__(self, metric: _Optional[str] = ..., value: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class Encoding(_message.Message):
    __slots__ = ("codec", "level", "byte_shuffle", "chunk_size", "chunk_count", "raw_bytes", "encoded_bytes", "digest_algorithm", "payload_digest", "block_rows")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    BYTE_SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ROWS_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    level: int
    byte_shuffle: bool
    chunk_size: int
    chunk_count: int
    raw_bytes: int
    encoded_bytes: int
    digest_algorithm: DigestAlgorithm
    payload_digest: bytes
    block_rows: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., level: _Optional[int] = ..., byte_shuffle: _Optional[bool] = ..., chunk_size: _Optional[int] = ..., chunk_count: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., encoded_bytes: _Optional[int] = ..., digest_algorithm: _Optional[_Union[DigestAlgorithm, str]] = ..., payload_digest: _Optional[bytes] = ..., block_rows: _Optional[int] = ...) -> None: ...

class HeldPrefix(_message.Message):
    __slots__ = ("num_tokens", "chunk_indices", "raw_lengths", "checksums")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDICES_FIELD_NUMBER: _ClassVar[int]
    RAW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    chunk_indices: _containers.RepeatedScalarFieldContainer[int]
    raw_lengths: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_tokens: _Optional[int] = ..., chunk_indices: _Optional[_Iterable[int]] = ..., raw_lengths: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheManifest(_message.Message):
    __slots__ = ("schema_version", "cache_id", "model", "prefix", "num_layers", "num_kv_heads", "head_dim", "dtype", "layers", "compression", "encoding", "created_unix_ms", "node_id", "quality", "artifacts", "held")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    cache_id: str
    model: _model_pb2.ModelFingerprint
    prefix: Prefix
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: _model_pb2.DType
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    compression: Compression
    encoding: Encoding
    created_unix_ms: int
    node_id: str
    quality: Quality
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    held: HeldPrefix
    def __init__(self, schema_version: _Optional[int] = ..., cache_id: _Optional[str] = ..., model: _Optional[_Union[_model_pb2.ModelFingerprint, _Mapping]] = ..., prefix: _Optional[_Union[Prefix, _Mapping]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[_model_pb2.DType, str]] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., compression: _Optional[_Union[Compression, _Mapping]] = ..., encoding: _Optional[_Union[Encoding, _Mapping]] = ..., created_unix_ms: _Optional[int] = ..., node_id: _Optional[str] = ..., quality: _Optional[_Union[Quality, _Mapping]] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., held: _Optional[_Union[HeldPrefix, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "tensor", "byte_offset", "raw_length", "checksum", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RAW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensor: int
    byte_offset: int
    raw_length: int
    checksum: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., tensor: _Optional[int] = ..., byte_offset: _Optional[int] = ..., raw_length: _Optional[int] = ..., checksum: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
