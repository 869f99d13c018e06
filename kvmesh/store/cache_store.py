"""The local cache store: entries on disk in their wire encoding, indexed in SQLite.

An entry is one file (`kvmesh.store.entry_file`): the chunks exactly as they travel, then the
manifest. Caches are compressed once, before they enter the store (`kvmesh.codec.encode`), and
served many times by reading the file; the store itself never encodes, decodes or cuts a cache.
Entry files are written under `incoming/`, synced, then renamed into `entries/` and indexed, under
an flock the writer holds until the index commits: a half-written cache is never visible.

The index is a cache of the entry files, never the truth: each file carries its own manifest.
Opening a store deletes what a dead writer left in `incoming/`, re-indexes entry files the index
lacks (a lost, corrupt or older index is rebuilt that way, the corrupt one moved aside), and leaves
alone what a live writer is still working on. An entry found damaged or misplaced (its file holds
another cache: a sync tool restored it under the wrong name) is moved to `quarantine/`, never
served or listed again, and logged; nothing that still verifies is ever deleted, except by the
budget's LRU eviction or `delete`.

Reads work on a full disk: they take no write lock, and recording a use is best effort.
"""

import fcntl
import logging
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvmesh import paths
from kvmesh.codec.chunks import DECODE_THREADS, Chunk, ChunkChecker, parse_frame
from kvmesh.codec.compat import validate_manifest
from kvmesh.codec.manifest import content_id, cuttable
from kvmesh.codec.prefix import BLOCK_SIZE, block_hashes, may_serve, shared_tokens, tokens_served
from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.store import entry_file
from kvmesh.store.budget import AUTO_BUDGET, resolve_budget
from kvmesh.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)
# Raised whenever the index's tables change; an index of another version is rebuilt from the files.
INDEX_VERSION = 3
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


def _abandoned(path: Path) -> bool:
    """True when no live writer holds the file's lock (its writer finished or died)."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except (BlockingIOError, FileNotFoundError):
        return False


def _prefix_range(prefix: str) -> tuple[str, str]:
    """The ids that start with a hex `prefix` lie in [prefix, prefix + "g"): an index range, not a scan."""
    return prefix, prefix + "g"


ENTRY_COLUMNS = (
    "cache_id, model_id, num_tokens, prefix_sha256, method, cuttable, raw_bytes, file_bytes, created_ms, last_used_ms"
)
SCHEMA_SQL = """
    CREATE TABLE IF NOT EXISTS entries (
        cache_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, num_tokens INTEGER NOT NULL,
        prefix_sha256 BLOB NOT NULL, block_size INTEGER NOT NULL, method TEXT NOT NULL,
        cuttable INTEGER NOT NULL, raw_bytes INTEGER NOT NULL,
        file_bytes INTEGER NOT NULL, created_ms INTEGER NOT NULL, last_used_ms INTEGER NOT NULL);
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
        self.incoming_dir = self.root / "incoming"
        self.quarantine_dir = self.root / "quarantine"
        try:
            self.entries_dir.mkdir(parents=True, exist_ok=True)
            self.incoming_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot open the store at {self.root}: {e.strerror or e}") from e
        self.max_bytes = resolve_budget(max_bytes, self.root)
        self._lock = threading.Lock()
        self._connections = threading.local()
        self._open_index()
        self.recover()

    # The index

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
            db = sqlite3.connect(self.root / INDEX, timeout=30, isolation_level=None)
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
        if len(cache_id) != 32 or not all(c in "0123456789abcdef" for c in cache_id):
            raise NotFoundError(f"no cache {cache_id!r} in the store (ids are 32 hex digits)")
        return self.entries_dir / f"{cache_id}.kvc"

    def recover(self) -> None:
        """Make the index agree with the files; called on open.

        Removes what dead writers left in incoming/ and index rows whose file is gone; indexes entry
        files the index lacks when their manifest verifies (a lost or rebuilt index), and
        quarantines those that do not. Files a live writer holds are left alone.
        """
        for leftover in self.incoming_dir.iterdir():
            if _abandoned(leftover):
                leftover.unlink(missing_ok=True)
        with self._read() as db:
            indexed = {row[0] for row in db.execute("SELECT cache_id FROM entries")}
        on_disk = {p.stem: p for p in self.entries_dir.iterdir() if p.suffix == ".kvc"}
        gone = indexed - set(on_disk)
        unindexed = [path for name, path in on_disk.items() if name not in indexed and _abandoned(path)]
        try:
            if gone:
                with self._db() as db:
                    for cache_id in gone:
                        self._unindex(db, cache_id)
                log.warning("forgot %d index entries whose files are gone", len(gone))
            for path in unindexed:
                try:
                    manifest = self._verified_manifest(path, path.stem)
                except (IntegrityError, StoreError) as e:
                    self._quarantine(path, str(e))
                    continue
                with self._lock:
                    self._index_file(manifest, path)
            if unindexed:
                log.info("indexed %d entry files the index lacked", len(unindexed))
        except (sqlite3.Error, StoreError) as e:
            # A full or read-only disk: reads still work; the next open finishes the repair.
            log.warning("the store index could not be repaired now (%s); reading on", e)

    def _index_file(self, manifest: pb.CacheManifest, path: Path, now: int | None = None) -> None:
        now = now or _now_ms()
        try:
            with self._db() as db:
                self._unindex(db, manifest.cache_id)
                db.execute(
                    "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    ),
                )
                db.executemany(
                    "INSERT INTO blocks VALUES (?, ?, ?)",
                    [(manifest.cache_id, i, h) for i, h in enumerate(manifest.prefix.block_hashes)],
                )
        except sqlite3.Error as e:
            raise StoreError(f"cannot update the store index at {self.root}: {e}") from e

    @staticmethod
    def _unindex(db: sqlite3.Connection, cache_id: str) -> None:
        db.execute("DELETE FROM entries WHERE cache_id = ?", (cache_id,))
        db.execute("DELETE FROM blocks WHERE cache_id = ?", (cache_id,))

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
        """Take a damaged or misplaced entry out of service: out of the index, its file aside."""
        cache_id = path.stem
        try:
            with self._db() as db:
                self._unindex(db, cache_id)
        except sqlite3.Error as e:
            log.error("cannot unindex %s: %s", cache_id, e)
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            path.replace(self.quarantine_dir / f"{cache_id}.{_now_ms()}.kvc")
        except FileNotFoundError:
            pass
        except OSError as e:  # a full or read-only disk: at least stop serving it
            log.error("cannot move %s to quarantine (%s): deleting it", path, e.strerror or e)
            path.unlink(missing_ok=True)
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
        """Why `nbytes` more cannot be written here (the disk is too full), or None."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return None
        # Entries the budget would evict to make room free their space too.
        reclaimable = self.total_bytes() if self.max_bytes is not None else 0
        if nbytes > free + reclaimable:
            return (
                f"the disk holding the store at {self.root} has {free:,} bytes free, the cache needs about {nbytes:,}"
            )
        return None

    def _write(self, manifest: pb.CacheManifest, chunks: Iterable[Chunk]) -> pb.CacheManifest:
        tmp = self.incoming_dir / f"{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                # Held until the entry is indexed: recovery in another process leaves it alone.
                fcntl.flock(f, fcntl.LOCK_EX)
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
                with self._lock:
                    path = self._path(manifest.cache_id)
                    os.replace(tmp, path)
                    try:
                        self._index_file(manifest, path)
                    except StoreError:
                        path.unlink(missing_ok=True)
                        raise
                    self._evict(keep=manifest.cache_id)
        except OSError as e:
            raise StoreError(f"cannot write to the store at {self.root}: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        return manifest

    def _evict(self, keep: str) -> None:
        """Drop least-recently used entries until the store fits its byte budget."""
        if self.max_bytes is None:
            return
        with self._read() as db:
            rows = db.execute(
                "SELECT cache_id, file_bytes FROM entries ORDER BY last_used_ms DESC, created_ms DESC"
            ).fetchall()
        total = sum(size for _, size in rows)
        for cache_id, size in reversed(rows):
            if total <= self.max_bytes:
                break
            if cache_id != keep:
                self.delete(cache_id)
                total -= size
                log.info(
                    "evicted cache %s (%s bytes, least recently used) to keep the store within %s bytes",
                    cache_id,
                    f"{size:,}",
                    f"{self.max_bytes:,}",
                )

    def delete(self, cache_id: str) -> None:
        """Remove an entry (its index rows, then its file); NotFoundError if there is none."""
        path = self._path(cache_id)
        with self._db() as db:
            found = db.execute("DELETE FROM entries WHERE cache_id = ?", (cache_id,)).rowcount
            db.execute("DELETE FROM blocks WHERE cache_id = ?", (cache_id,))
        if not found and not path.exists():
            raise NotFoundError(f"no cache {cache_id} in the store")
        path.unlink(missing_ok=True)

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

    def resolve(self, given: str) -> str:
        """The id of the one cache whose id starts with `given` (as git takes a commit's prefix): a
        person types `46f0c5a6`, not 32 digits. None or several matching is a NotFoundError saying so."""
        prefix = given.strip().lower()
        if not prefix or not all(c in "0123456789abcdef" for c in prefix) or len(prefix) > 32:
            raise NotFoundError(f"no cache {given!r} in the store (ids are hex digits: `kvmesh cache list`)")
        matches = [e.cache_id for e in self._select("WHERE cache_id >= ? AND cache_id < ?", _prefix_range(prefix))]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFoundError(f"no cache {given} in the store")
        shown = ", ".join(matches[:4]) + (", ..." if len(matches) > 4 else "")
        raise NotFoundError(f"{given} names {len(matches)} caches ({shown}): give more of the id")

    def _select(self, clause: str, args: tuple = ()) -> list[StoredEntry]:
        with self._read() as db:
            rows = db.execute(f"SELECT {ENTRY_COLUMNS} FROM entries {clause}", args).fetchall()
        return [StoredEntry(**{**dict(row), "cuttable": bool(row["cuttable"])}) for row in rows]

    def touch(self, cache_id: str) -> None:
        """Record a use (for LRU eviction); skipped, not failed, when the disk is full."""
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
        On a tie, the entry of exactly that prefix wins (nothing to cut).
        """
        best: PrefixMatch | None = None
        hashes = block_hashes(tokens, BLOCK_SIZE)
        shared = self.blocks_matched(model_id, hashes)
        for e in self.entries(model_id):
            blocks = shared.get(e.cache_id, 0)
            if not may_serve(e.num_tokens, e.cuttable, blocks):
                continue
            usable = tokens_served(
                tokens, e.num_tokens, e.prefix_sha256, e.cuttable, shared_tokens(blocks, e.num_tokens)
            )
            if usable and (best is None or usable > best.tokens or (usable == best.tokens and e.num_tokens == usable)):
                best = PrefixMatch(e, usable)
        return best

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
