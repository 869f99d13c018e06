from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_UINT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_UINT32: DType
DTYPE_UINT8: DType

class ModelFingerprint(_message.Message):
    __slots__ = ("model_id", "model_type", "config_sha256", "weights_sha256", "tokenizer_sha256", "chat_template_sha256", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "dtype", "rope_theta", "rope_scaling_json", "sliding_window", "repo_id", "revision", "mlx_version", "mlx_lm_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_JSON_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    REPO_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    MLX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MLX_LM_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_type: str
    config_sha256: bytes
    weights_sha256: bytes
    tokenizer_sha256: bytes
    chat_template_sha256: bytes
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    rope_theta: float
    rope_scaling_json: str
    sliding_window: int
    repo_id: str
    revision: str
    mlx_version: str
    mlx_lm_version: str
    def __init__(self, model_id: _Optional[str] = ..., model_type: _Optional[str] = ..., config_sha256: _Optional[bytes] = ..., weights_sha256: _Optional[bytes] = ..., tokenizer_sha256: _Optional[bytes] = ..., chat_template_sha256: _Optional[bytes] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., rope_theta: _Optional[float] = ..., rope_scaling_json: _Optional[str] = ..., sliding_window: _Optional[int] = ..., repo_id: _Optional[str] = ..., revision: _Optional[str] = ..., mlx_version: _Optional[str] = ..., mlx_lm_version: _Optional[str] = ...) -> None: ...
