"""The local cache store: entries on disk in their wire encoding, indexed in SQLite.

An entry is one file (`kvmesh.store.entry_file`): the chunks exactly as they travel, then the
manifest. Caches are compressed once, before they enter the store (`kvmesh.codec.encode`), and
served many times by reading the file; the store itself never encodes, decodes or cuts a cache.
Entry files are written under `entries/.incoming/` (on the file system of `entries/`, which may
be a link to another disk: a rename cannot cross one), synced, then renamed into `entries/` and
indexed, under an flock the writer holds until the index commits: a half-written cache is never
visible. The rename and the index rows of an entry change together, in one write transaction of
the index, and so do an eviction's rows and file: writers in several processes take turns there.

The index is a cache of the entry files, never the truth: each file carries its own manifest.
Opening a store deletes what a dead writer left in `incoming/`, re-indexes entry files the index
lacks (a lost, corrupt or older index is rebuilt that way, the corrupt one moved aside), and leaves
alone what a live writer is still working on. An entry found damaged or misplaced (its file holds
another cache: a sync tool restored it under the wrong name) is moved to `quarantine/`, never
served or listed again, and logged; nothing that still verifies is ever deleted, except by the
budget's LRU eviction or `delete`.

Reads work on a full disk: they take no write lock, and recording a use is best effort. A store
this process cannot write (a read-only mount, another user's directory) serves reads all the same;
writes refuse in one line naming it. Anything in `entries/` that is not an entry file (a stray
file, a directory, a broken link) is skipped with a warning.
"""

import fcntl
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from kvmesh import paths
from kvmesh.codec.chunks import DECODE_THREADS, Chunk, ChunkChecker, parse_frame
from kvmesh.codec.compat import loss_rank, validate_manifest
from kvmesh.codec.manifest import content_id, cuttable, lossy, measured_loss, uncuttable_reason
from kvmesh.codec.prefix import BLOCK_SIZE, block_hashes, may_serve, shared_tokens, tokens_served
from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.store import entry_file
from kvmesh.store.budget import AUTO_BUDGET, resolve_budget
from kvmesh.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)
# Raised whenever the index's tables change, or what a column is derived from; an index of another
# version is rebuilt from the files (5: `lossy` reads quantized layers, not only the method, so
# entries of bits alone recorded as `full` lose their lossless mark; 6: transform-coded entries are
# `cuttable`, their shorter prefixes re-coded by kvmesh.codec.cut).
INDEX_VERSION = 6
INDEX = "index.sqlite3"


@dataclass(frozen=True)
class StoredEntry:
    """One row of the index: what lookups and listings need without opening the file."""

    cache_id: str
    model_id: str
    num_tokens: int
    prefix_sha256: bytes
    method: str
    cuttable: bool
    raw_bytes: int
    file_bytes: int
    created_ms: int
    last_used_ms: int
    # A press or a transform codec changed it, and the loss its producer measured (None: not measured).
    lossy: bool = False
    tail_kl: float | None = None


@dataclass(frozen=True)
class PrefixMatch:
    entry: StoredEntry
    # How many of the prompt's tokens the entry can serve.
    tokens: int


@dataclass(frozen=True)
class Problem:
    """An entry that failed verification, and why; it is in quarantine now."""

    cache_id: str
    problem: str


def _now_ms() -> int:
    return int(time.time() * 1000)


HEX_DIGITS = frozenset("0123456789abcdef")
STAGING = ".incoming"  # under entries/: where entry files are written before their rename
LEGACY_STAGING = "incoming"  # under the root, where kvmesh 0.2 wrote them (its leftovers are removed)


def _is_cache_id(name: str) -> bool:
    return len(name) == 32 and all(c in HEX_DIGITS for c in name)


def _abandoned(path: Path) -> bool:
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


def _remove_if_abandoned(path: Path) -> None:
    """Delete a staging file no live writer holds the lock of; anything else is left alone.

    Deleted while this process holds the lock, so that a writer that made the file but had not
    yet locked it finds it gone once it does (`CacheStore._staging_file`), and makes another.
    """
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
    except OSError:  # locked by a live writer, gone already, or not ours to delete
        return


def _foreign(path: Path) -> str | None:
    """Why `path`, found in entries/, is not an entry file to index (None when it is one).

    Checked before the file is opened: a directory, a link loop or a FIFO there must not stop the
    store from opening (or block it), only be skipped."""
    if path.suffix != ".kvc" or not _is_cache_id(path.stem):
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


def _unwritable(path: Path) -> str | None:
    """Why this process cannot write in `path` (a read-only file system, permissions), or None."""
    if not path.exists() or os.access(path, os.W_OK):
        return None
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "it is on a read-only file system"
    except OSError:
        pass
    return "this user may not write to it"


def _prefix_range(prefix: str) -> tuple[str, str]:
    """The ids that start with a hex `prefix` lie in [prefix, prefix + "g"): an index range, not a scan."""
    return prefix, prefix + "g"


ENTRY_COLUMNS = (
    "cache_id, model_id, num_tokens, prefix_sha256, method, cuttable, raw_bytes, file_bytes, created_ms, "
    "last_used_ms, lossy, tail_kl"
)
SCHEMA_SQL = """
    CREATE TABLE IF NOT EXISTS entries (
        cache_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, num_tokens INTEGER NOT NULL,
        prefix_sha256 BLOB NOT NULL, block_size INTEGER NOT NULL, method TEXT NOT NULL,
        cuttable INTEGER NOT NULL, raw_bytes INTEGER NOT NULL,
        file_bytes INTEGER NOT NULL, created_ms INTEGER NOT NULL, last_used_ms INTEGER NOT NULL,
        lossy INTEGER NOT NULL, tail_kl REAL);
    CREATE INDEX IF NOT EXISTS entries_model ON entries (model_id);
    CREATE TABLE IF NOT EXISTS blocks (
        cache_id TEXT NOT NULL, idx INTEGER NOT NULL, hash BLOB NOT NULL, PRIMARY KEY (cache_id, idx));
    CREATE INDEX IF NOT EXISTS blocks_hash ON blocks (hash);
"""


class CacheStore:
    """Caches on disk, one file each, found through an SQLite index of their prefixes.

    Safe to share between threads and processes (the daemon and the CLI open the same store).
    `max_bytes` is the budget: AUTO_BUDGET (the default) is 10% of the disk the store is on, None
    no limit. Every writer keeps to it, least-recently used entries going first.
    """

    def __init__(self, root: Path | str | None = None, *, max_bytes: int | None = AUTO_BUDGET):
        self.root = Path(root) if root else paths.store_dir()
        self.entries_dir = self.root / "entries"
        # Beside the entries, so that the rename into entries/ never crosses a file system.
        self.incoming_dir = self.entries_dir / STAGING
        self.quarantine_dir = self.root / "quarantine"
        # Why this process cannot write the store (None: it can); reads work either way.
        self.read_only_reason = self._make_dirs()
        # The disk the entries are on (entries/ may be a link to another one).
        self.max_bytes = resolve_budget(max_bytes, self.entries_dir if self.entries_dir.is_dir() else self.root)
        self._connections = threading.local()
        self._index_uri = (self.root / INDEX).absolute().as_uri()
        self._memory_index: sqlite3.Connection | None = None  # keeps an in-memory index alive
        if self.read_only_reason:
            self._open_index_read_only()
        else:
            self._open_index()
            self.recover()

    @property
    def read_only(self) -> bool:
        return self.read_only_reason is not None

    def _make_dirs(self) -> str | None:
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
        for path in (self.root, self.entries_dir, self.incoming_dir, self.root / INDEX):
            if reason := _unwritable(path):
                return reason
        if not self.incoming_dir.is_dir():  # made by nobody, and not for want of permission
            return f"{self.incoming_dir} cannot be made"
        return None

    def _refuse_writes(self) -> None:
        if self.read_only_reason:
            raise StoreError(self._read_only_message())

    def _read_only_message(self) -> str:
        return (
            f"the store at {self.root} cannot be written ({self.read_only_reason}): its caches can be listed "
            "and read, not added or deleted (give a writable one with --store)"
        )

    # The index

    def _open_index_read_only(self) -> None:
        """Read the index of a store this process cannot write, as it is.

        SQLite opens a WAL index read-only only while its -shm file exists; a cleanly closed one
        has none, and nothing can change it here, so it is read as immutable. An index that is
        missing, damaged or of another version cannot be rebuilt on the disk: it is built in
        memory from the entry files, for this process.
        """
        problem = "there is none"
        uris = (f"{self._index_uri}?mode=ro", f"{self._index_uri}?immutable=1")
        for uri in uris if (self.root / INDEX).exists() else ():
            try:
                with closing(sqlite3.connect(uri, uri=True, timeout=30)) as db:
                    version = db.execute("PRAGMA user_version").fetchone()[0]
                    usable = version == INDEX_VERSION and db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            except sqlite3.Error as e:
                problem = str(e)
                continue
            if usable:
                self._index_uri = uri
                return
            problem = f"an index of version {version}, not {INDEX_VERSION}, or damaged"
            break
        log.warning(
            "the store at %s cannot be written (%s) and its index is unusable (%s): indexing its files in memory",
            self.root,
            self.read_only_reason,
            problem,
        )
        self._index_uri = f"file:kvmesh-store-{uuid.uuid4().hex}?mode=memory&cache=shared"
        self._memory_index = sqlite3.connect(self._index_uri, uri=True, check_same_thread=False)
        self._memory_index.executescript(SCHEMA_SQL)
        self._index_unindexed(set(), self._entry_files())

    def _open_index(self) -> None:
        """Open (or make) the index; one that is corrupt is moved aside and rebuilt from the files."""
        path = self.root / INDEX
        try:
            self._init_index(path)
        except sqlite3.DatabaseError as e:
            aside = path.with_name(f"{INDEX}.corrupt-{_now_ms()}")
            log.warning("the store index %s is unreadable (%s): moved to %s, rebuilding it", path, e, aside.name)
            path.replace(aside)
            for suffix in ("-wal", "-shm"):
                path.with_name(INDEX + suffix).unlink(missing_ok=True)
            self._init_index(path)
        except OSError as e:
            raise StoreError(f"cannot open the store index at {path}: {e.strerror or e}") from e

    def _init_index(self, path: Path) -> None:
        with closing(sqlite3.connect(path, timeout=30)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != INDEX_VERSION:
                # Another version's index: forget it; recovery indexes the entry files this one reads.
                db.executescript("DROP TABLE IF EXISTS entries; DROP TABLE IF EXISTS blocks;")
                db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
            db.executescript(SCHEMA_SQL)
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection to the index, kept open for the store's life.

        Kept open because SQLite removes the WAL when its last connection closes and must create it
        again on the next open: on a full disk that fails, and reads would fail with it.
        """
        db = getattr(self._connections, "db", None)
        if db is None:
            db = sqlite3.connect(self._index_uri, uri=True, timeout=30, isolation_level=None)
            db.row_factory = sqlite3.Row
            self._connections.db = db
        return db

    def _db(self) -> "_Transaction":
        """A write transaction (`with store._db() as db:`)."""
        return _Transaction(self._connection())

    def _read(self) -> "nullcontext[sqlite3.Connection]":
        """The connection, for reading: no write lock, so reads work on a full disk."""
        return nullcontext(self._connection())

    def _path(self, cache_id: str) -> Path:
        # Ids come from content_id (hex); anything else never becomes a path.
        if not _is_cache_id(cache_id):
            raise NotFoundError(f"no cache {cache_id!r} in the store (ids are 32 hex digits)")
        return self.entries_dir / f"{cache_id}.kvc"

    def recover(self) -> None:
        """Make the index agree with the files; called on open (of a store this process can write).

        Removes what dead writers left in the staging directory and index rows whose file is gone;
        indexes entry files the index lacks when their manifest verifies (a lost or rebuilt index),
        and quarantines those that do not. Files a live writer holds are left alone, and so is
        anything in entries/ that is no entry file (skipped with a warning).
        """
        if self.read_only_reason:
            return
        for staging in (self.incoming_dir, self.root / LEGACY_STAGING):
            for leftover in staging.iterdir() if staging.is_dir() else ():
                _remove_if_abandoned(leftover)
        with self._read() as db:
            indexed = {row[0] for row in db.execute("SELECT cache_id FROM entries")}
        try:
            on_disk = self._entry_files()
            self._forget_missing(indexed, on_disk)
            self._index_unindexed(indexed, on_disk)
        except (sqlite3.Error, StoreError, OSError) as e:
            # A full disk: reads still work; the next open finishes the repair.
            log.warning("the store index could not be repaired now (%s); reading on", e)

    def _entry_files(self) -> dict[str, Path]:
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
            if problem := _foreign(path):
                log.warning("skipping %s in the store: %s", path, problem)
                continue
            found[path.stem] = path
        return found

    def _forget_missing(self, indexed: set[str], on_disk: dict[str, Path]) -> None:
        """Drop index rows whose entry file is gone (deleted by hand, lost with a disk).

        Checked again inside the write transaction: a writer renames and indexes in one, so a file
        that appeared since `indexed` was read is seen, and its row kept.
        """
        missing = indexed - set(on_disk)
        if not missing:
            return
        forgotten = 0
        with self._db() as db:
            for cache_id in missing:
                if not self._path(cache_id).exists():  # (a link there to nothing stays: not ours)
                    forgotten += self._unindex(db, cache_id)
        if forgotten:
            log.warning("forgot %d index entries whose files are gone", forgotten)

    def _index_unindexed(self, indexed: set[str], on_disk: dict[str, Path]) -> None:
        """Index the entry files not in `indexed` whose manifests verify; quarantine the others."""
        added = 0
        for cache_id, path in on_disk.items():
            if cache_id in indexed or not _abandoned(path):
                continue
            try:
                manifest = self._verified_manifest(path, cache_id)
            except NotFoundError:  # evicted or deleted since it was listed
                continue
            except (IntegrityError, StoreError) as e:
                self._quarantine(path, str(e))
                continue
            added += self._index_file(manifest, path, only_new=True)
        if added:
            log.info("indexed %d entry files the index lacked", added)

    def _index_file(
        self, manifest: pb.CacheManifest, path: Path, *, source: Path | None = None, only_new: bool = False
    ) -> bool:
        """Index the entry file at `path`, first renaming `source` there; True when it was indexed.

        The rename and the rows are one write transaction: another process's eviction (rows and
        file, also one) comes wholly before or after, never between. `only_new` (recovery) indexes
        a file only while it still exists and has no row: another process may have evicted or
        indexed it since it was listed.
        """
        now = _now_ms()
        try:
            with self._db() as db:
                if source is not None:
                    os.replace(source, path)
                elif only_new and (
                    not path.is_file()
                    or db.execute("SELECT 1 FROM entries WHERE cache_id = ?", (manifest.cache_id,)).fetchone()
                ):
                    return False
                self._unindex(db, manifest.cache_id)
                db.execute(
                    "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        manifest.cache_id,
                        manifest.model.model_id,
                        manifest.prefix.num_tokens,
                        manifest.prefix.sha256,
                        manifest.prefix.block_size,
                        manifest.compression.method,
                        cuttable(manifest),
                        manifest.encoding.raw_bytes,
                        path.stat().st_size,
                        now,
                        now,
                        lossy(manifest),
                        measured_loss(manifest),
                    ),
                )
                db.executemany(
                    "INSERT INTO blocks VALUES (?, ?, ?)",
                    [(manifest.cache_id, i, h) for i, h in enumerate(manifest.prefix.block_hashes)],
                )
        except sqlite3.Error as e:
            raise StoreError(f"cannot update the store index at {self.root}: {e}") from e
        return True

    @staticmethod
    def _unindex(db: sqlite3.Connection, cache_id: str) -> bool:
        """Drop an entry's rows (in `db`'s transaction); True when it had any."""
        found = db.execute("DELETE FROM entries WHERE cache_id = ?", (cache_id,)).rowcount > 0
        db.execute("DELETE FROM blocks WHERE cache_id = ?", (cache_id,))
        return found

    def _verified_manifest(self, path: Path, cache_id: str) -> pb.CacheManifest:
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

    def _quarantine(self, path: Path, problem: str) -> None:
        """Take a damaged or misplaced entry out of service: out of the index, its file aside.

        In a store this process cannot write, nothing can move: the problem is logged, and the
        caller's error stands."""
        cache_id = path.stem
        if self.read_only_reason and self._memory_index is None:
            log.warning(
                "cache %s is damaged (%s); the store at %s cannot be written, so it stays", cache_id, problem, self.root
            )
            return
        try:
            with self._db() as db:
                self._unindex(db, cache_id)
        except sqlite3.Error as e:
            log.error("cannot unindex %s: %s", cache_id, e)
        if self.read_only_reason:
            log.warning("not serving damaged cache %s: %s", cache_id, problem)
            return
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            # A move, not a rename: entries/ may be on another file system than quarantine/.
            shutil.move(path, self.quarantine_dir / f"{cache_id}.{_now_ms()}.kvc")
        except FileNotFoundError:
            pass
        except OSError as e:  # a full disk: at least stop serving it
            log.error("cannot move %s to quarantine (%s): deleting it", path, e.strerror or e)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                log.error("cannot delete %s either (%s)", path, e.strerror or e)
        log.warning("quarantined cache %s: %s", cache_id, problem)

    # Writing

    def add(self, manifest: pb.CacheManifest, chunks: Iterable[Chunk]) -> pb.CacheManifest:
        """Store a cache whose chunks this process made or checked: `store.add(*encode_cache(...))`,
        or a fetched cache as its decoder checks it (`kvmesh.codec.decode.CacheDecoder.feed_iter`).

        The chunks are written as they come; the manifest, completed by the encoder once the last
        chunk is out, gets its id and goes last. Returns it. Whatever `chunks` raises (a chunk or
        digest that fails its decoder's checks) leaves nothing in the store.
        """
        return self._write(manifest, chunks)

    def receive(self, manifest: pb.CacheManifest, chunks: Iterable[Chunk]) -> pb.CacheManifest:
        """Store a cache that arrives as chunks nobody here checked (a peer's publish, a file),
        checking every one and the digest.

        A bad chunk raises IntegrityError and leaves nothing in the store; a cache the budget
        cannot hold raises StoreError before any chunk is read.
        """
        if rejection := validate_manifest(manifest):
            raise IntegrityError(f"malformed manifest: {rejection.message}")
        if problem := self.cannot_hold(manifest):
            raise StoreError(problem)
        return self._write(manifest, ChunkChecker(manifest).verified(chunks, threads=DECODE_THREADS))

    def cannot_hold(self, manifest: pb.CacheManifest) -> str | None:
        """Why this store cannot take the cache (its budget, its free disk), known from the manifest alone."""
        size = entry_file.estimated_size(manifest)
        if self.max_bytes is not None and size > self.max_bytes:
            return f"the cache takes about {size:,} bytes, more than the store's budget of {self.max_bytes:,}"
        return self.lacks_space(size)

    def lacks_space(self, nbytes: int) -> str | None:
        """Why `nbytes` more cannot be written here (the disk is too full, or the store cannot be
        written at all), or None: asked before the work (a prefill), so that it is not lost."""
        if self.read_only_reason:
            return self._read_only_message()
        try:
            free = shutil.disk_usage(self.entries_dir).free
        except OSError:
            return None
        # Entries the budget would evict to make room free their space too.
        reclaimable = self.total_bytes() if self.max_bytes is not None else 0
        if nbytes > free + reclaimable:
            return (
                f"the disk holding the store at {self.root} has {free:,} bytes free, the cache needs about {nbytes:,}"
            )
        return None

    def _staging_file(self) -> tuple[Path, BinaryIO]:
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

    def _write(self, manifest: pb.CacheManifest, chunks: Iterable[Chunk]) -> pb.CacheManifest:
        self._refuse_writes()
        try:
            tmp, f = self._staging_file()
        except OSError as e:
            raise StoreError(f"cannot write to the store at {self.root}: {e.strerror or e}") from e
        try:
            with f:
                entry_file.write_header(f)
                for chunk in chunks:
                    entry_file.write_chunk(f, chunk)
                # The encoder fills in sizes and digest as the last chunk goes out: id it now.
                manifest.cache_id = content_id(manifest)
                entry_file.write_footer(f, manifest)
                f.flush()
                os.fsync(f.fileno())
                file_bytes = tmp.stat().st_size
                if self.max_bytes is not None and file_bytes > self.max_bytes:
                    raise StoreError(
                        f"the cache takes {file_bytes:,} bytes, more than the store's budget of {self.max_bytes:,}"
                    )
                path = self._path(manifest.cache_id)
                try:
                    self._index_file(manifest, path, source=tmp)
                except StoreError:
                    path.unlink(missing_ok=True)
                    raise
        except OSError as e:
            raise StoreError(f"cannot write to the store at {self.root}: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        self._evict(keep=manifest.cache_id)
        return manifest

    def enforce_budget(self) -> None:
        """Evict least-recently used entries until the store fits its budget (what each write does
        for itself; the daemon calls it for writers that kept to another budget)."""
        self._evict(keep="")

    def _evict(self, keep: str) -> None:
        """Drop least-recently used entries until the store fits its byte budget.

        One write transaction chooses and removes them (rows and files), so writers evicting at
        the same moment take turns: each sees what the others left, none is told of a cache that
        another removed first, and together they evict no more than the budget asks. `keep` is
        stored by then: an eviction that fails is logged, not that write's failure.
        """
        if self.max_bytes is None:
            return
        evicted = []
        try:
            with self._db() as db:
                rows = db.execute(
                    "SELECT cache_id, file_bytes FROM entries ORDER BY last_used_ms DESC, created_ms DESC"
                ).fetchall()
                total = sum(size for _, size in rows)
                for cache_id, size in reversed(rows):
                    if total <= self.max_bytes:
                        break
                    if cache_id != keep:
                        self._remove(db, cache_id)
                        evicted.append((cache_id, size))
                        total -= size
        except (sqlite3.Error, OSError) as e:
            log.warning(
                "could not evict to keep the store within %s bytes%s: %s",
                f"{self.max_bytes:,}",
                f" (stored {keep})" if keep else "",
                e,
            )
            return
        for cache_id, size in evicted:
            log.info(
                "evicted cache %s (%s bytes, least recently used) to keep the store within %s bytes",
                cache_id,
                f"{size:,}",
                f"{self.max_bytes:,}",
            )

    def _remove(self, db: sqlite3.Connection, cache_id: str) -> bool:
        """In `db`'s write transaction: an entry's rows and file; True when it had either."""
        found = self._unindex(db, cache_id)
        path = self._path(cache_id)
        try:
            path.unlink()
        except FileNotFoundError:
            return found
        return True

    def delete(self, cache_id: str) -> None:
        """Remove an entry (its index rows and its file, together); NotFoundError if there is none."""
        self._refuse_writes()
        self._path(cache_id)  # a bad id is NotFoundError before anything is touched
        try:
            with self._db() as db:
                found = self._remove(db, cache_id)
        except sqlite3.Error as e:
            raise StoreError(f"cannot update the store index at {self.root}: {e}") from e
        except OSError as e:
            raise StoreError(f"cannot delete cache {cache_id} from the store at {self.root}: {e.strerror or e}") from e
        if not found:
            raise NotFoundError(f"no cache {cache_id} in the store")

    # Reading

    def entries(self, model_id: str | None = None) -> list[StoredEntry]:
        """Every entry (of one model, if given), oldest first."""
        if model_id is None:
            return self._select("ORDER BY created_ms")
        return self._select("WHERE model_id = ? ORDER BY created_ms", (model_id,))

    def entry(self, cache_id: str) -> StoredEntry:
        found = self._select("WHERE cache_id = ?", (cache_id,))
        if not found:
            raise NotFoundError(f"no cache {cache_id} in the store")
        return found[0]

    def resolve(self, given: str, shared: Callable[[str], bool] | None = None) -> str:
        """The id of the one cache whose id starts with `given` (as git takes a commit's prefix): a
        person types `46f0c5a6`, not 32 digits. None or several matching is a NotFoundError saying so.
        `shared`: which models' caches count (a daemon's share_models: the others look absent)."""
        prefix = given.strip().lower()
        if not prefix or not all(c in "0123456789abcdef" for c in prefix) or len(prefix) > 32:
            raise NotFoundError(f"no cache {given!r} in the store (ids are hex digits: `kvmesh cache list`)")
        found = self._select("WHERE cache_id >= ? AND cache_id < ?", _prefix_range(prefix))
        matches = [e.cache_id for e in found if shared is None or shared(e.model_id)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFoundError(f"no cache {given} in the store")
        shown = ", ".join(matches[:4]) + (", ..." if len(matches) > 4 else "")
        raise NotFoundError(f"{given} names {len(matches)} caches ({shown}): give more of the id")

    def _select(self, clause: str, args: tuple = ()) -> list[StoredEntry]:
        with self._read() as db:
            rows = db.execute(f"SELECT {ENTRY_COLUMNS} FROM entries {clause}", args).fetchall()
        return [
            StoredEntry(**{**dict(row), "cuttable": bool(row["cuttable"]), "lossy": bool(row["lossy"])}) for row in rows
        ]

    def touch(self, cache_id: str) -> None:
        """Record a use (for LRU eviction); skipped, not failed, when the disk is full or read-only."""
        if self.read_only_reason:
            return
        try:
            with self._db() as db:
                db.execute("UPDATE entries SET last_used_ms = ? WHERE cache_id = ?", (_now_ms(), cache_id))
        except sqlite3.Error as e:
            log.debug("could not record a use of %s: %s", cache_id, e)

    def total_bytes(self) -> int:
        with self._read() as db:
            return db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM entries").fetchone()[0]

    def manifest(self, cache_id: str) -> pb.CacheManifest:
        """The entry's manifest, checked to be that entry's (a damaged or misplaced file is quarantined)."""
        path = self._path(cache_id)
        try:
            return self._verified_manifest(path, cache_id)
        except IntegrityError as e:
            self._quarantine(path, str(e))
            raise

    def chunks(self, cache_id: str) -> Iterator[Chunk]:
        """The stored chunks, exactly as they were encoded (no recompression)."""
        return map(parse_frame, self.chunk_records(cache_id))

    def chunk_records(self, cache_id: str) -> Iterator[bytes]:
        """The stored chunks as frames, as a peer sends them, each checked against its record checksum.

        Damage found on the way quarantines the entry and raises IntegrityError.
        """
        manifest = self.manifest(cache_id)
        path = self._path(cache_id)
        try:
            with open(path, "rb") as f:
                yield from entry_file.read_records(f, manifest, source=f"cache {cache_id}")
        except FileNotFoundError:
            raise NotFoundError(f"no cache {cache_id} in the store") from None
        except IntegrityError as e:
            self._quarantine(path, str(e))
            raise
        self.touch(cache_id)

    def verify(self, cache_id: str) -> None:
        """Check every chunk of an entry (decoded and checksummed) and its payload digest.

        A damaged entry is quarantined and raises IntegrityError.
        """
        manifest = self.manifest(cache_id)
        try:
            for _ in ChunkChecker(manifest).verified(self.chunks(cache_id), threads=DECODE_THREADS):
                pass
        except IntegrityError as e:
            self._quarantine(self._path(cache_id), str(e))
            raise

    def verify_all(self) -> list[Problem]:
        """`verify` every entry; the damaged ones, now quarantined."""
        problems = []
        for entry in self.entries():
            try:
                self.verify(entry.cache_id)
            except (IntegrityError, NotFoundError) as e:
                problems.append(Problem(entry.cache_id, str(e)))
        return problems

    # Finding caches

    def lookup(self, model_id: str, tokens: Sequence[int]) -> PrefixMatch | None:
        """The entry serving the longest prefix of `tokens` for this model, if any.

        An entry serves its exact prefix; one that evicted nothing also serves any block-aligned
        shorter prefix of itself (cut by `kvmesh.codec.cut`): `kvmesh.codec.prefix.tokens_served`.
        On a tie, the less lossy entry wins (`loss_rank`: a 3-bit cache whose loss nobody measured
        never beats an 8-bit one of the same length), then the entry of exactly that prefix (nothing
        to cut).
        """
        best: PrefixMatch | None = None
        best_key: tuple = ()
        hashes = block_hashes(tokens, BLOCK_SIZE)
        shared = self.blocks_matched(model_id, hashes)
        for e in self.entries(model_id):
            blocks = shared.get(e.cache_id, 0)
            if not may_serve(e.num_tokens, e.cuttable, blocks):
                continue
            usable = tokens_served(
                tokens, e.num_tokens, e.prefix_sha256, e.cuttable, shared_tokens(blocks, e.num_tokens)
            )
            # Longest first; then the least lossy (kvmesh.codec.compat.loss_rank), then one of exactly that prefix.
            key = (usable, -loss_rank(e.lossy, e.tail_kl), e.num_tokens == usable)
            if usable and (best is None or key > best_key):
                best, best_key = PrefixMatch(e, usable), key
        return best

    def exact_only(self, model_id: str, tokens: Sequence[int], beyond: int = 0) -> tuple[PrefixMatch, str] | None:
        """The entry that shares the most block-aligned tokens of `tokens` (more than `beyond`) yet
        serves none of them, and why (`kvmesh.codec.manifest.uncuttable_reason`): it serves only its
        exact prefix (a press evicted positions, a window dropped some, a layer is recurrent state),
        which `tokens` does not extend. Its `tokens` are those it shares. So a lookup that finds
        nothing can say what it passed over."""
        shared = self.blocks_matched(model_id, block_hashes(tokens, BLOCK_SIZE))
        missed = [
            PrefixMatch(e, n)
            for e in self.entries(model_id)
            if not e.cuttable
            and (n := shared_tokens(shared.get(e.cache_id, 0), e.num_tokens)) > beyond
            and not tokens_served(tokens, e.num_tokens, e.prefix_sha256, False, n)
        ]
        if not missed:
            return None
        best = max(missed, key=lambda m: m.tokens)
        try:
            why = uncuttable_reason(self.manifest(best.entry.cache_id)) or "its index says so"
        except (IntegrityError, NotFoundError) as e:
            why = str(e)
        return best, why

    def blocks_matched(self, model_id: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each entry of the model: how many leading blocks it shares with these hashes.

        Hashes are chained, so a match at block i means blocks 0..i all match.
        """
        matched: dict[str, int] = {}
        with self._read() as db:
            for start in range(0, len(hashes), 500):
                part = hashes[start : start + 500]
                rows = db.execute(
                    f"SELECT b.cache_id, MAX(b.idx) + 1 FROM blocks b JOIN entries e USING (cache_id) "
                    f"WHERE e.model_id = ? AND b.hash IN ({','.join('?' * len(part))}) GROUP BY b.cache_id",
                    (model_id, *part),
                )
                for cache_id, n in rows:
                    matched[cache_id] = max(n, matched.get(cache_id, 0))
        return matched

    # Files

    def export(self, cache_id: str, path: Path | str) -> Path:
        """Write an entry to one file that `import_file` (here or on another Mac) takes back.

        Every record is checked on the way: a damaged entry is refused (and quarantined), and no
        file is left behind.
        """
        path = Path(path)
        manifest = self.manifest(cache_id)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            with open(tmp, "wb") as out:
                entry_file.write_header(out)
                for record in self.chunk_records(cache_id):
                    entry_file.write_record(out, record)
                entry_file.write_footer(out, manifest)
            os.replace(tmp, path)
        except OSError as e:
            raise StoreError(f"{path}: cannot write: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def import_file(self, path: Path | str) -> pb.CacheManifest:
        """Import an exported entry, verifying every chunk; a bad file leaves nothing behind."""
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed below; only opening failures are read errors)
        except OSError as e:
            raise StoreError(f"{path}: cannot read: {e.strerror or e}") from e
        with f:
            manifest = entry_file.read_manifest(f, source=str(path))
            return self.receive(manifest, entry_file.read_chunks(f, manifest, source=str(path)))


class _Transaction:
    """`with store._db() as db:` runs the block in one write transaction."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The connection lives on: leave no transaction open (SQLite may have rolled back already,
        # as it does when a commit finds the disk full).
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
