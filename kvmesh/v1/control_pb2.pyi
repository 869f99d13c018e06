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

class SpreadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpreadResponse(_message.Message):
    __slots__ = ("version", "sent", "live", "interval_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    sent: int
    live: int
    interval_s: float
    def __init__(self, version: _Optional[int] = ..., sent: _Optional[int] = ..., live: _Optional[int] = ..., interval_s: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerState(_message.Message):
    __slots__ = ("node_id", "addresses", "source", "healthy", "failures", "version", "host_name", "links")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    source: PeerSource
    healthy: bool
    failures: int
    version: str
    host_name: str
    links: _containers.RepeatedCompositeFieldContainer[LinkState]
    def __init__(self, node_id: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., source: _Optional[_Union[PeerSource, str]] = ..., healthy: _Optional[bool] = ..., failures: _Optional[int] = ..., version: _Optional[str] = ..., host_name: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkState, _Mapping]]] = ...) -> None: ...

class LinkState(_message.Message):
    __slots__ = ("address", "answers", "rtt_ms", "bytes_per_s", "checked")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    address: str
    answers: bool
    rtt_ms: float
    bytes_per_s: float
    checked: bool
    def __init__(self, address: _Optional[str] = ..., answers: _Optional[bool] = ..., rtt_ms: _Optional[float] = ..., bytes_per_s: _Optional[float] = ..., checked: _Optional[bool] = ...) -> None: ...

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
