"""Every error kvmesh raises on purpose, in one place. Each message names what went wrong and what
the user can do about it; the CLI prints any of them as one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.v1 import cache_pb2 as pb

if TYPE_CHECKING:
    import grpc


class KvmeshError(Exception):
    """Base of every error kvmesh raises on purpose; the CLI prints these as one line."""


class ModelDirError(KvmeshError):
    """A model directory is missing, incomplete or unreadable."""

    def __init__(self, path: Path | str, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedCacheError(KvmeshError):
    """A cache of a kind kvmesh cannot share (e.g. mlx-lm's CacheList or ChunkedKVCache)."""


class PressConfigError(KvmeshError):
    """An unknown compression method or a bad value in its config."""


class IntegrityError(KvmeshError):
    """A chunk or payload that is not what the manifest promised: nothing of it may be used."""


class StoreError(KvmeshError):
    """The store cannot do what was asked (full, unreadable entry, bad id)."""


class NotFoundError(StoreError):
    """No such cache in the store."""


class CredentialsError(KvmeshError):
    """Mesh credentials are missing, unreadable or cannot be renewed."""


class ConfigError(KvmeshError):
    """A setting in the config file, the environment or a flag is wrong."""


class DaemonNotRunning(KvmeshError):
    """No daemon runs for a data directory, or it does not answer."""


class DaemonAlreadyRunning(KvmeshError):
    """Another daemon holds this data directory."""


class ListenError(KvmeshError):
    """An address cannot be served (not this machine's, or its port is taken)."""

    def __init__(self, message: str, port: int):
        self.port = port
        super().__init__(message)


class PromptMismatch(KvmeshError):
    """A cache file holds another number of tokens than the prompt given for it."""

    def __init__(self, message: str, held: int, given: int):
        super().__init__(message)
        self.held, self.given = held, given


class PeerError(KvmeshError):
    """A peer could not be reached, failed, or went away mid-transfer."""

    def __init__(self, address: str, message: str, code: grpc.StatusCode | None = None):
        self.address, self.code = address, code
        super().__init__(f"peer {address}: {message}")


@dataclass(frozen=True)
class Rejection:
    """Why a receiver refuses a cache: a typed reason (a pb.RejectReason) and a sentence for people."""

    reason: pb.RejectReason
    message: str

    @property
    def reason_name(self) -> str:
        """`weights`, `chat_template`, ...: the enum name without its prefix, for people."""
        return pb.RejectReason.Name(self.reason).removeprefix("REJECT_REASON_").lower()

    def __str__(self) -> str:
        return f"{self.reason_name}: {self.message}"


class CacheRejected(KvmeshError):
    """The receiver (this process or a peer) refused a cache; `.rejection` says why."""

    def __init__(self, rejection: Rejection):
        self.rejection = rejection
        super().__init__(f"cache rejected ({rejection})")
