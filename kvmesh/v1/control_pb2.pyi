from kvmesh.v1 import service_pb2 as _service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_SOURCE_UNSPECIFIED: _ClassVar[PeerSource]
    PEER_SOURCE_MDNS: _ClassVar[PeerSource]
    PEER_SOURCE_STATIC: _ClassVar[PeerSource]
PEER_SOURCE_UNSPECIFIED: PeerSource
PEER_SOURCE_MDNS: PeerSource
PEER_SOURCE_STATIC: PeerSource

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerState(_message.Message):
    __slots__ = ("node_id", "addresses", "source", "healthy", "failures", "version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    source: PeerSource
    healthy: bool
    failures: int
    version: str
    def __init__(self, node_id: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., source: _Optional[_Union[PeerSource, str]] = ..., healthy: _Optional[bool] = ..., failures: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("info", "listen", "peers", "data_dir")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    info: _service_pb2.InfoResponse
    listen: _containers.RepeatedScalarFieldContainer[str]
    peers: _containers.RepeatedCompositeFieldContainer[PeerState]
    data_dir: str
    def __init__(self, info: _Optional[_Union[_service_pb2.InfoResponse, _Mapping]] = ..., listen: _Optional[_Iterable[str]] = ..., peers: _Optional[_Iterable[_Union[PeerState, _Mapping]]] = ..., data_dir: _Optional[str] = ...) -> None: ...
