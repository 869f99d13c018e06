"""The local cache store: entries on disk in their wire encoding, indexed in SQLite.

An entry is one file (`kvmesh.store.entry_file`): the chunks exactly as they travel, then the
manifest. Caches are compressed once, before they enter the store (`kvmesh.codec.encode`), and
served many times by reading the file; the store itself never encodes, decodes or cuts a cache.
Entry files are written under `incoming/`, synced, then renamed into `entries/` and indexed, under
an flock the writer holds until the index commits. Opening a store deletes whatever a dead writer
left (temp files, files never indexed, index rows whose file is gone) and nothing a live writer
(the daemon, say, while the CLI opens the same store) is still working on: a half-written cache is
never visible.
"""

import fcntl
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol

from kvmesh import paths
from kvmesh.codec.chunks import ChunkChecker
from kvmesh.codec.compat import validate_manifest
from kvmesh.codec.manifest import content_id, evicts_nothing
from kvmesh.codec.prefix import BLOCK_SIZE, block_hashes, prefix_sha256
from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.store import entry_file
from kvmesh.v1 import cache_pb2 as pb

# Raised whenever the index's tables change; an index of another version is rebuilt.
INDEX_VERSION = 2


class ChunkDecoder(Protocol):
    """What `receive` needs of a decoder (kvmesh.codec.decode.CacheDecoder) to decode as it stores."""

    checker: ChunkChecker

    def feed_iter(self, chunks: Iterable[pb.Chunk], threads: int = 1) -> Iterator[pb.Chunk]: ...


@dataclass(frozen=True)
class StoredEntry:
    """One row of the index: what lookups and listings need without opening the file."""

    cache_id: str
    model_id: str
    num_tokens: int
    prefix_sha256: bytes
    method: str
    evicts_nothing: bool
    raw_bytes: int
    file_bytes: int
    created_ms: int
    last_used_ms: int


@dataclass(frozen=True)
class PrefixMatch:
    entry: StoredEntry
    # How many of the prompt's tokens the entry can serve.
    tokens: int


def _now_ms() -> int:
    return int(time.time() * 1000)


def _abandoned(path: Path) -> bool:
    """True when no live writer holds the file's lock (its writer finished or died)."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except BlockingIOError:
        return False
    except FileNotFoundError:
        return False


ENTRY_COLUMNS = (
    "cache_id, model_id, num_tokens, prefix_sha256, method, evicts_nothing, raw_bytes, file_bytes, "
    "created_ms, last_used_ms"
)


class CacheStore:
    """Caches on disk, one file each, found through an SQLite index of their prefixes.

    Safe to share between threads and processes (the daemon and the CLI open the same store).
    With `max_bytes`, least-recently used entries go when a new one would exceed it.
    """

    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root else paths.store_dir()
        self.max_bytes = max_bytes
        self.entries_dir = self.root / "entries"
        self.incoming_dir = self.root / "incoming"
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        self.incoming_dir.mkdir(exist_ok=True)
        self._lock = threading.Lock()
        with closing(sqlite3.connect(self.root / "index.sqlite3", timeout=30)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            if db.execute("PRAGMA user_version").fetchone()[0] != INDEX_VERSION:
                # An index of another kvmesh version: its entries are of a schema this one cannot
                # serve. Dropping the tables makes recovery remove their files.
                db.executescript("DROP TABLE IF EXISTS entries; DROP TABLE IF EXISTS blocks;")
                db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
            db.executescript(
                """
                CREATE TABLE IF NOT EXISTS entries (
                    cache_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, num_tokens INTEGER NOT NULL,
                    prefix_sha256 BLOB NOT NULL, block_size INTEGER NOT NULL, method TEXT NOT NULL,
                    evicts_nothing INTEGER NOT NULL, raw_bytes INTEGER NOT NULL,
                    file_bytes INTEGER NOT NULL, created_ms INTEGER NOT NULL, last_used_ms INTEGER NOT NULL);
                CREATE INDEX IF NOT EXISTS entries_model ON entries (model_id);
                CREATE TABLE IF NOT EXISTS blocks (
                    cache_id TEXT NOT NULL, idx INTEGER NOT NULL, hash BLOB NOT NULL,
                    PRIMARY KEY (cache_id, idx));
                CREATE INDEX IF NOT EXISTS blocks_hash ON blocks (hash);
                """
            )
        self.recover()

    def _db(self) -> "_Transaction":
        return _Transaction(sqlite3.connect(self.root / "index.sqlite3", timeout=30, isolation_level=None))

    def _path(self, cache_id: str) -> Path:
        # Ids come from content_id (hex); anything else never becomes a path.
        if len(cache_id) != 32 or not all(c in "0123456789abcdef" for c in cache_id):
            raise NotFoundError(f"no cache {cache_id!r} in the store (ids are 32 hex digits)")
        return self.entries_dir / f"{cache_id}.kvc"

    def recover(self) -> None:
        """Remove what dead writers left behind; called on open."""
        for leftover in self.incoming_dir.iterdir():
            if _abandoned(leftover):
                leftover.unlink(missing_ok=True)
        with self._db() as db:
            indexed = {row[0] for row in db.execute("SELECT cache_id FROM entries")}
            on_disk = {p.stem for p in self.entries_dir.glob("*.kvc")}
            for cache_id in indexed - on_disk:
                db.execute("DELETE FROM entries WHERE cache_id = ?", (cache_id,))
                db.execute("DELETE FROM blocks WHERE cache_id = ?", (cache_id,))
            # Renamed but not (yet) indexed: gone only if its writer is.
            for cache_id in on_disk - indexed:
                path = self.entries_dir / f"{cache_id}.kvc"
                if _abandoned(path):
                    path.unlink(missing_ok=True)

    # Writing

    def add(self, manifest: pb.CacheManifest, chunks: Iterable[pb.Chunk]) -> pb.CacheManifest:
        """Store a cache this process encoded: `store.add(*kvmesh.codec.encode.encode_cache(...))`.

        The chunks are written as they come; the manifest, completed by the encoder once the last
        chunk is out, gets its id and goes last. Returns it.
        """
        return self._write(manifest, chunks)

    def receive(
        self,
        manifest: pb.CacheManifest,
        chunks: Iterable[pb.Chunk],
        trailer_digest: bytes | None = None,
        decoder: ChunkDecoder | None = None,
    ) -> pb.CacheManifest:
        """Store a cache that arrives as chunks (from a peer or a file), checking every one.

        With a `decoder`, each chunk is also decoded into it (one pass for fetch-and-keep).
        A bad chunk raises IntegrityError and leaves nothing in the store.
        """
        if rejection := validate_manifest(manifest):
            raise IntegrityError(f"malformed manifest: {rejection.message}")
        checker = decoder.checker if decoder else ChunkChecker(manifest)

        def checked() -> Iterator[pb.Chunk]:
            if decoder:
                yield from decoder.feed_iter(chunks, threads=2)
            else:
                for chunk, _ in checker.check_all(chunks, threads=2):
                    yield chunk
            checker.finish(trailer_digest)

        return self._write(manifest, checked())

    def _write(self, manifest: pb.CacheManifest, chunks: Iterable[pb.Chunk]) -> pb.CacheManifest:
        tmp = self.incoming_dir / f"{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                # Held until the entry is indexed: recovery in another process leaves it alone.
                fcntl.flock(f, fcntl.LOCK_EX)
                entry_file.write_header(f)
                for chunk in chunks:
                    entry_file.write_record(f, chunk.SerializeToString())
                # The encoder fills in sizes and digest as the last chunk goes out: id it now.
                manifest.cache_id = content_id(manifest)
                entry_file.write_footer(f, manifest)
                f.flush()
                os.fsync(f.fileno())
                with self._lock:
                    self._index(manifest, tmp)
        except OSError as e:
            raise StoreError(f"cannot write to the store at {self.root}: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        return manifest

    def _index(self, manifest: pb.CacheManifest, tmp: Path) -> None:
        path = self._path(manifest.cache_id)
        file_bytes = tmp.stat().st_size
        if self.max_bytes is not None and file_bytes > self.max_bytes:
            raise StoreError(
                f"the cache takes {file_bytes:,} bytes, more than the store's budget of {self.max_bytes:,}"
            )
        os.replace(tmp, path)
        now = _now_ms()
        with self._db() as db:
            db.execute("DELETE FROM blocks WHERE cache_id = ?", (manifest.cache_id,))
            db.execute(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    manifest.cache_id,
                    manifest.model.model_id,
                    manifest.prefix.num_tokens,
                    manifest.prefix.sha256,
                    manifest.prefix.block_size,
                    manifest.compression.method,
                    evicts_nothing(manifest),
                    manifest.encoding.raw_bytes,
                    file_bytes,
                    now,
                    now,
                ),
            )
            db.executemany(
                "INSERT INTO blocks VALUES (?, ?, ?)",
                [(manifest.cache_id, i, h) for i, h in enumerate(manifest.prefix.block_hashes)],
            )
        self._evict(keep=manifest.cache_id)

    def _evict(self, keep: str) -> None:
        """Drop least-recently used entries until the store fits its byte budget."""
        if self.max_bytes is None:
            return
        with self._db() as db:
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

    def delete(self, cache_id: str) -> None:
        """Remove an entry (its index rows, then its file)."""
        path = self._path(cache_id)
        with self._db() as db:
            db.execute("DELETE FROM entries WHERE cache_id = ?", (cache_id,))
            db.execute("DELETE FROM blocks WHERE cache_id = ?", (cache_id,))
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

    def _select(self, clause: str, args: tuple = ()) -> list[StoredEntry]:
        with self._db() as db:
            db.row_factory = sqlite3.Row
            rows = db.execute(f"SELECT {ENTRY_COLUMNS} FROM entries {clause}", args).fetchall()
        return [StoredEntry(**{**dict(row), "evicts_nothing": bool(row["evicts_nothing"])}) for row in rows]

    def touch(self, cache_id: str) -> None:
        with self._db() as db:
            db.execute("UPDATE entries SET last_used_ms = ? WHERE cache_id = ?", (_now_ms(), cache_id))

    def total_bytes(self) -> int:
        with self._db() as db:
            return db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM entries").fetchone()[0]

    def manifest(self, cache_id: str) -> pb.CacheManifest:
        with self._open(cache_id) as f:
            return entry_file.read_manifest(f, source=cache_id)

    def chunks(self, cache_id: str) -> Iterator[pb.Chunk]:
        """The stored chunks, exactly as they were encoded (no recompression)."""
        return map(pb.Chunk.FromString, self.chunk_records(cache_id))

    def chunk_records(self, cache_id: str) -> Iterator[bytes]:
        """The stored chunks as serialized Chunk messages, checked against their record checksums."""
        f = self._open(cache_id)
        with f:
            manifest = entry_file.read_manifest(f, source=cache_id)
            yield from entry_file.read_records(f, manifest, source=cache_id)
        self.touch(cache_id)

    def _open(self, cache_id: str) -> BinaryIO:
        try:
            return open(self._path(cache_id), "rb")
        except FileNotFoundError:
            raise NotFoundError(f"no cache {cache_id} in the store") from None

    # Finding caches

    def lookup(self, model_id: str, tokens: Sequence[int]) -> PrefixMatch | None:
        """The entry serving the longest prefix of `tokens` for this model, if any.

        An entry serves its exact prefix; one that evicted nothing also serves any block-aligned
        shorter prefix of itself (cut by `kvmesh.codec.cut`).
        """
        best: PrefixMatch | None = None
        hashes = block_hashes(tokens, BLOCK_SIZE)
        shared = self.blocks_matched(model_id, hashes)
        for e in self.entries(model_id):
            usable = 0
            if e.num_tokens <= len(tokens) and prefix_sha256(tokens[: e.num_tokens]) == e.prefix_sha256:
                usable = e.num_tokens
            elif e.evicts_nothing:
                usable = min(shared.get(e.cache_id, 0) * BLOCK_SIZE, e.num_tokens)
            if usable and (best is None or usable > best.tokens or (usable == best.tokens and e.num_tokens == usable)):
                best = PrefixMatch(e, usable)
        return best

    def blocks_matched(self, model_id: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each entry of the model: how many leading blocks it shares with these hashes.

        Hashes are chained, so a match at block i means blocks 0..i all match.
        """
        matched: dict[str, int] = {}
        with self._db() as db:
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
        """Copy an entry to one file that `import_file` (here or on another Mac) takes back."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            with self._open(cache_id) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            os.replace(tmp, path)
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
    """`with store._db() as db:` runs the block in one transaction and closes the connection."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.db.close()
