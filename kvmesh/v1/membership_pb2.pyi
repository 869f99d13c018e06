from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("token_id", "csr", "proof")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    csr: bytes
    proof: bytes
    def __init__(self, token_id: _Optional[str] = ..., csr: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("certificate", "trust", "authority_node_id", "revocations", "proof")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    AUTHORITY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    certificate: bytes
    trust: bytes
    authority_node_id: str
    revocations: bytes
    proof: bytes
    def __init__(self, certificate: _Optional[bytes] = ..., trust: _Optional[bytes] = ..., authority_node_id: _Optional[str] = ..., revocations: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("certificate", "csr", "signature", "days")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CSR_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DAYS_FIELD_NUMBER: _ClassVar[int]
    certificate: bytes
    csr: bytes
    signature: bytes
    days: float
    def __init__(self, certificate: _Optional[bytes] = ..., csr: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., days: _Optional[float] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("certificate", "trust", "revocations")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    certificate: bytes
    trust: bytes
    revocations: bytes
    def __init__(self, certificate: _Optional[bytes] = ..., trust: _Optional[bytes] = ..., revocations: _Optional[bytes] = ...) -> None: ...

class RevocationsRequest(_message.Message):
    __slots__ = ("version", "revocations")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    revocations: bytes
    def __init__(self, version: _Optional[int] = ..., revocations: _Optional[bytes] = ...) -> None: ...

class RevocationsResponse(_message.Message):
    __slots__ = ("revocations",)
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    revocations: bytes
    def __init__(self, revocations: _Optional[bytes] = ...) -> None: ...
