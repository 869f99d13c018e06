"""Per-model artefacts beside the cache store: transform bases, kept by their sha256.

A transform-coded cache names the basis it was coded with (CacheManifest.artifacts); a receiver
fetches that basis once from the peer that sent the cache and keeps it here, so every later cache of
that model decodes at once. Files are content-addressed (`artifacts/<sha256>`), checked against their
name and for sane numbers (kvmesh.codec.basis_file.read_basis: a true digest of NaNs is still NaNs)
when written and when read, and written atomically (a temporary file in the same directory, then a
rename), so a damaged, poisoned or half-written file is never used, nor served to a peer. One that
arrives from a peer is written to its temporary file as it comes (`Incoming`), never held whole in
memory, and renamed into place only once checked. Each model's own basis, the one this
Mac codes its caches with, is named by `artifacts/models/<model id>` (its sha256).

Artefacts are small next to caches (4.5 MB for SmolLM2-135M, ~130 MB for an 8B model) and shared by
all of a model's caches, so the store's budget and eviction leave them alone.
"""

import hashlib
import os
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING

from kvmesh.codec.basis_file import BasisError, read_basis
from kvmesh.codec.limits import is_sha256_hex
from kvmesh.errors import IntegrityError, StoreError
from kvmesh.files.atomic import write_atomic
from kvmesh.v1 import cache_pb2 as pb

if TYPE_CHECKING:
    from kvmesh.codec.basis import Basis

# Artefacts travel between peers in pieces of this size (the Artifact call's messages): the sender
# cuts them, the receiver judges its rate by them.
ARTIFACT_PIECE_BYTES = 1 << 20


def _check_id(digest: str) -> str:
    if not is_sha256_hex(digest):
        raise StoreError(f"not an artefact id (64 hex digits): {digest[:70]!r}")
    return digest


class ArtifactStore:
    """The artefacts under `root` (the store's `artifacts/` directory)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.models_dir = self.root / "models"

    def path(self, digest: str) -> Path:
        return self.root / _check_id(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def get(self, digest: str) -> bytes | None:
        """The artefact's bytes, None when it is not here; IntegrityError when its file is damaged
        (it is removed, so the next fetch brings a good copy) or not a sane basis (kept by an older
        version: removed too, so that it is neither used nor served)."""
        path = self.path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read artefact {digest[:12]} at {path}: {e.strerror or e}") from e
        if hashlib.sha256(data).hexdigest() != digest:
            path.unlink(missing_ok=True)
            raise IntegrityError(f"artefact {digest[:12]} at {path} was damaged; removed it (fetch it again)")
        try:
            sane(data, digest)
        except IntegrityError as e:
            path.unlink(missing_ok=True)
            raise IntegrityError(f"{e} (at {path}: removed it)") from None
        return data

    def put(self, data: bytes, digest: str) -> Path:
        """Keep `data`, refused (IntegrityError) unless its sha256 is `digest` and it is a sane basis."""
        path = self.path(digest)
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise IntegrityError(f"artefact bytes do not match their id: sha256 {got[:12]}, expected {digest[:12]}")
        sane(data, digest)
        if path.is_file():
            return path
        _write_atomic(path, data)
        return path

    def receive(self) -> "Incoming":
        """A temporary file for an artefact arriving, in this directory (so `keep` renames it into
        place without a copy)."""
        return Incoming(self.root)

    def keep(self, incoming: "Incoming", digest: str) -> Path:
        """Rename `incoming` into place as `digest`, once `incoming.read(digest)` checked it."""
        if incoming.checked != digest or incoming.path is None:
            raise IntegrityError(f"artefact {digest[:12]} was not checked before it was kept")
        path = self.path(digest)
        try:
            incoming.file.flush()
            os.fsync(incoming.file.fileno())
            os.replace(incoming.path, path)
        except OSError as e:
            raise StoreError(f"cannot write {path}: {e.strerror or e}") from e
        return path

    def model_basis(self, model_id: str) -> str | None:
        """The sha256 of the basis this Mac codes `model_id`'s caches with, if it has one."""
        try:
            digest = (self.models_dir / model_id).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreError(f"cannot read {self.models_dir / model_id}: {e.strerror or e}") from e
        return digest if self.has(digest) else None

    def model_bases(self) -> dict[str, str]:
        """Every model this Mac codes caches of, with the sha256 of its basis (held here)."""
        try:
            models = sorted(p.name for p in self.models_dir.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StoreError(f"cannot list {self.models_dir}: {e.strerror or e}") from e
        return {m: d for m in models if (d := self.model_basis(m)) is not None}

    def set_model_basis(self, model_id: str, digest: str) -> None:
        """Make `digest` (held here) the basis `model_id`'s caches are coded with."""
        if not self.has(digest):
            raise StoreError(f"artefact {digest[:12]} is not in {self.root}")
        if not model_id or "/" in model_id or model_id.startswith("."):
            raise StoreError(f"not a model id: {model_id!r}")
        _write_atomic(self.models_dir / model_id, (digest + "\n").encode())


def sane(data: bytes, digest: str) -> None:
    """IntegrityError unless `data` is a sane basis (kvmesh.codec.basis_file.read_basis)."""
    try:
        read_basis(data)
    except BasisError as e:
        raise IntegrityError(f"artefact {digest[:12]} is no sane basis: {e}") from None


class Incoming:
    """An artefact as it arrives: each piece written to a temporary file and hashed as it comes, so
    memory never holds what a peer sends beyond one piece; read back only once its digest is right,
    and removed when closed unless `ArtifactStore.keep` renamed it into place."""

    def __init__(self, directory: Path | None = None):
        """A temporary file in `directory`, or a nameless one (a receiver without a store)."""
        self.path: Path | None = None
        try:
            if directory is None:
                self.file: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close)
            else:
                directory.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(dir=directory, prefix=".incoming-")
                self.path, self.file = Path(name), os.fdopen(fd, "w+b")
        except OSError as e:
            raise StoreError(f"cannot make a file for an artefact in {directory}: {e.strerror or e}") from e
        self._hash = hashlib.sha256()
        # The digest `read` found the bytes to have, and sane.
        self.checked: str | None = None

    def write(self, piece: bytes) -> None:
        try:
            self.file.write(piece)
        except OSError as e:
            raise StoreError(f"cannot write an arriving artefact: {e.strerror or e}") from e
        self._hash.update(piece)

    def read(self, digest: str) -> bytes:
        """All the bytes, refused (IntegrityError) unless their sha256 (hashed as they came: wrong
        bytes are never read back) is `digest` and they are a sane basis."""
        got = self._hash.hexdigest()
        if got != digest:
            raise IntegrityError(f"artefact bytes do not match their id: sha256 {got[:12]}, expected {digest[:12]}")
        self.file.seek(0)
        data = self.file.read()
        sane(data, digest)
        self.checked = digest
        return data

    def close(self) -> None:
        self.file.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)  # (gone when it was kept)

    def __enter__(self) -> "Incoming":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _write_atomic(path: Path, data: bytes) -> None:
    """`write_atomic`, synced (a basis costs a fetch to get back), failing as a StoreError."""
    try:
        write_atomic(path, data, durable=True)
    except OSError as e:
        raise StoreError(f"cannot write {path}: {e.strerror or e}") from e


def artifact_store(store_root: Path) -> ArtifactStore:
    """The artefacts of the store at `store_root`."""
    return ArtifactStore(Path(store_root) / "artifacts")


def stored_bases(store_root: Path, manifest: pb.CacheManifest) -> dict[str, "Basis"]:
    """The transform bases a stored cache needs, from the artefacts of the store at `store_root`
    (StoreError when one is missing or does not parse)."""
    from kvmesh.codec.basis import BasisError  # (bases are MLX arrays: the store itself loads no MLX)
    from kvmesh.codec.coded import bases_for

    try:
        return bases_for(manifest, artifact_store(store_root).get)
    except BasisError as e:
        raise StoreError(str(e)) from None
