"""Where a store keeps its files, and what is safe to do with each: entries, staging, quarantine.

Entry files are named by their cache id (32 hex digits); nothing a peer sends becomes a path
otherwise. Entry files are written under `entries/.incoming/` (on the file system of `entries/`,
which may be a link to another disk: a rename cannot cross one), each held under an flock by its
writer until it is indexed, so recovery in another process can tell a live writer's file from a
dead one's.
"""

import fcntl
import logging
import os
import stat
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvmesh.codec.compat import validate_manifest
from kvmesh.codec.manifest import content_id
from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.store import entry_file
from kvmesh.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)
HEX_DIGITS = frozenset("0123456789abcdef")
STAGING = ".incoming"  # under entries/: where entry files are written before their rename
LEGACY_STAGING = "incoming"  # under the root, where kvmesh 0.2 wrote them (its leftovers are removed)


def is_cache_id(name: str) -> bool:
    return len(name) == 32 and all(c in HEX_DIGITS for c in name)


def abandoned(path: Path) -> bool:
    """True when `path` is a regular file no live writer holds the lock of (its writer finished or
    died). Anything else (locked, gone, a directory, a FIFO that would block an open) is left alone."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return False
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except OSError:
        return False


def remove_if_abandoned(path: Path) -> None:
    """Delete a staging file no live writer holds the lock of; anything else is left alone.

    Deleted while this process holds the lock, so that a writer that made the file but had not
    yet locked it finds it gone once it does (`Layout.staging_file`), and makes another.
    """
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
    except OSError:  # locked by a live writer, gone already, or not ours to delete
        return


def foreign(path: Path) -> str | None:
    """Why `path`, found in entries/, is not an entry file to index (None when it is one).

    Checked before the file is opened: a directory, a link loop or a FIFO there must not stop the
    store from opening (or block it), only be skipped."""
    if path.suffix != ".kvc" or not is_cache_id(path.stem):
        return "not an entry file (those are named <32 hex digits>.kvc)"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:  # a dangling link; or evicted since it was listed, which is no problem
        return "a link to a missing file" if path.is_symlink() else None
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "a directory, not an entry file"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return None


def unwritable(path: Path) -> str | None:
    """Why this process cannot write in `path` (a read-only file system, permissions), or None."""
    if not path.exists() or os.access(path, os.W_OK):
        return None
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "it is on a read-only file system"
    except OSError:
        pass
    return "this user may not write to it"


@dataclass(frozen=True)
class Layout:
    """The directories of the store at `root`."""

    root: Path

    @property
    def entries_dir(self) -> Path:
        return self.root / "entries"

    @property
    def incoming_dir(self) -> Path:
        # Beside the entries, so that the rename into entries/ never crosses a file system.
        return self.entries_dir / STAGING

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    def make_dirs(self, index: Path) -> str | None:
        """Make the store's directories; why the store cannot be written here, or None.

        A store that exists but cannot be written (a read-only mount, another user's) still opens:
        its caches are listed and read, only writes refuse.
        """
        try:
            self.entries_dir.mkdir(parents=True, exist_ok=True)
            self.incoming_dir.mkdir(exist_ok=True)
        except OSError as e:
            if not self.root.is_dir():
                raise StoreError(f"cannot open the store at {self.root}: {e.strerror or e}") from e
        for path in (self.root, self.entries_dir, self.incoming_dir, index):
            if reason := unwritable(path):
                return reason
        if not self.incoming_dir.is_dir():  # made by nobody, and not for want of permission
            return f"{self.incoming_dir} cannot be made"
        return None

    def path(self, cache_id: str) -> Path:
        # Ids come from content_id (hex); anything else never becomes a path.
        if not is_cache_id(cache_id):
            raise NotFoundError(f"no cache {cache_id!r} in the store (ids are 32 hex digits)")
        return self.entries_dir / f"{cache_id}.kvc"

    def entry_files(self) -> dict[str, Path]:
        """The entry files in entries/, by cache id. Anything else there (a stray file, a directory,
        a link loop) is skipped with a warning: it must not stop a command or the daemon."""
        found = {}
        try:
            names = sorted(os.listdir(self.entries_dir))
        except OSError as e:
            raise StoreError(f"cannot list the store's entries in {self.entries_dir}: {e.strerror or e}") from e
        for name in names:
            if name.startswith("."):  # the staging directory, and Finder's and editors' own files
                continue
            path = self.entries_dir / name
            if problem := foreign(path):
                log.warning("skipping %s in the store: %s", path, problem)
                continue
            found[path.stem] = path
        return found

    def staging_file(self) -> tuple[Path, BinaryIO]:
        """A new file in the staging directory, open and locked (flock) by this writer until its
        entry is indexed: recovery in another process leaves it alone.

        Recovery deletes staging files nobody has locked, so it may take one between its creation
        and its lock; it deletes under the lock, so such a file is found unlinked here, and another
        is made.
        """
        for _ in range(8):
            tmp = self.incoming_dir / f"{uuid.uuid4().hex}.part"
            f = open(tmp, "xb")  # noqa: SIM115 (the caller closes it)
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_nlink:
                return tmp, f
            f.close()
        raise StoreError(f"cannot write to the store at {self.root}: its staging files keep being deleted")


class VerifiedManifests:
    """`verified_manifest`, each entry file's read and checked once: an entry file never changes in
    place (a writer renames a whole one in), so one whose inode, size and time are those of the read
    is the same file. A daemon serving a cache reads its manifest for the open and again for its
    records: 0.4 ms each (most of it the check), on a fetch's path. The latest reads are kept, up to
    MEMO_BYTES of manifests."""

    MEMO_BYTES = 16 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read: OrderedDict[Path, tuple[tuple[int, int, int], bytes]] = OrderedDict()
        self._bytes = 0

    def get(self, path: Path, cache_id: str) -> pb.CacheManifest:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise NotFoundError(f"no cache {cache_id} in the store") from None
        except OSError as e:
            raise StoreError(f"cache {cache_id}: cannot read its file: {e.strerror or e}") from e
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            read = self._read.get(path)
            if read is not None and read[0] == identity:
                self._read.move_to_end(path)
                return pb.CacheManifest.FromString(read[1])
        manifest = verified_manifest(path, cache_id)
        data = manifest.SerializeToString()
        with self._lock:
            if (old := self._read.pop(path, None)) is not None:
                self._bytes -= len(old[1])
            self._read[path] = (identity, data)
            self._bytes += len(data)
            while self._bytes > self.MEMO_BYTES:
                self._bytes -= len(self._read.popitem(last=False)[1][1])
        return manifest


def verified_manifest(path: Path, cache_id: str) -> pb.CacheManifest:
    """The manifest of the entry file at `path`, which must be consistent and cache `cache_id`.

    A manifest of another schema is left to its receivers to refuse (reason `schema`).
    """
    try:
        with open(path, "rb") as f:
            manifest = entry_file.read_manifest(f, source=cache_id)
    except FileNotFoundError:
        raise NotFoundError(f"no cache {cache_id} in the store") from None
    except OSError as e:
        raise StoreError(f"cache {cache_id}: cannot read its file: {e.strerror or e}") from e
    if rejection := validate_manifest(manifest):
        raise IntegrityError(f"cache {cache_id}: malformed manifest: {rejection.message}")
    if manifest.cache_id != cache_id or content_id(manifest) != cache_id:
        raise IntegrityError(f"the file of cache {cache_id} holds another cache ({manifest.cache_id}): misplaced")
    return manifest
