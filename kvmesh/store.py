"""The local cache store: entries on disk in their wire encoding, indexed in SQLite.

An entry is one file: the chunks exactly as they travel, then the manifest. Caches are compressed
once, when they enter the store, and served many times by reading the file. Entry files are
written under `incoming/`, synced, then renamed into `entries/` and indexed, under an flock the
writer holds until the index commits. Opening a store deletes whatever a dead writer left (temp
files, files never indexed, index rows whose file is gone) and nothing a live writer (the daemon,
say, while the CLI opens the same store) is still working on: a half-written cache is never visible.

Entry file layout (also the export format):
    b"KVMESHC1"
    per chunk: u32 length | u64 xxh3-64 of the record | serialized Chunk
    serialized CacheManifest | u32 its length | u64 its xxh3-64 | b"KVMESHF1"
"""

import fcntl
import os
import shutil
import sqlite3
import struct
import threading
import time
import uuid
from contextlib import closing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import xxhash

from .codec import CacheDecoder, ChunkChecker, IntegrityError, decode_chunks, encode_chunks, max_encoded_length
from .compat import CODEC_NAMES, validate_manifest
from .errors import KvmeshError
from .fingerprint import ModelFingerprint
from .manifest import build_manifest, content_id, evicts_nothing, press_config
from .prefix import BLOCK_SIZE, PrefixKey, block_hashes, prefix_sha256
from .presses import Press, make_press
from .sparse_cache import truncate
from .v1 import cache_pb2 as pb

MAGIC, FOOTER_MAGIC = b"KVMESHC1", b"KVMESHF1"
RECORD_HEADER = struct.Struct("<IQ")
FOOTER = struct.Struct("<IQ8s")
MAX_MANIFEST_BYTES = 16 << 20


class StoreError(KvmeshError):
    """The store cannot do what was asked (not found, full, unreadable entry)."""


class NotFoundError(StoreError):
    pass


@dataclass(frozen=True)
class StoredEntry:
    cache_id: str
    model_id: str
    num_tokens: int
    prefix_sha256: str
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


def default_store_dir() -> Path:
    return Path(os.environ.get("KVMESH_DATA_DIR") or platformdirs.user_data_dir("kvmesh")) / "store"


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


def _write_record(f, data: bytes) -> None:
    f.write(RECORD_HEADER.pack(len(data), xxhash.xxh3_64_intdigest(data)))
    f.write(data)


class CacheStore:
    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root else default_store_dir()
        self.max_bytes = max_bytes
        self.entries_dir = self.root / "entries"
        self.incoming_dir = self.root / "incoming"
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        self.incoming_dir.mkdir(exist_ok=True)
        self._lock = threading.Lock()
        with closing(sqlite3.connect(self.root / "index.sqlite3", timeout=30)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(
                """
                CREATE TABLE IF NOT EXISTS entries (
                    cache_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, num_tokens INTEGER NOT NULL,
                    prefix_sha256 TEXT NOT NULL, block_size INTEGER NOT NULL, method TEXT NOT NULL,
                    evicts_nothing INTEGER NOT NULL, raw_bytes INTEGER NOT NULL,
                    file_bytes INTEGER NOT NULL, created_ms INTEGER NOT NULL, last_used_ms INTEGER NOT NULL);
                CREATE INDEX IF NOT EXISTS entries_model ON entries (model_id);
                CREATE TABLE IF NOT EXISTS blocks (
                    cache_id TEXT NOT NULL, idx INTEGER NOT NULL, hash TEXT NOT NULL,
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

    def put(
        self,
        cache: list,
        model: ModelFingerprint,
        tokens: Sequence[int] | PrefixKey,
        press: Press | None = None,
        codec: str = "zstd",
        level: int = 1,
        byte_shuffle: bool | None = None,
        chunk_size: int = 1 << 20,
        node_id: str = "",
        threads: int = 2,
    ) -> pb.CacheManifest:
        """Encode a sparse cache of a prefix into the store; returns its complete manifest."""
        prefix = tokens if isinstance(tokens, PrefixKey) else PrefixKey.of(tokens)
        manifest = build_manifest(
            cache, model, prefix, press or Press(), codec, level, byte_shuffle, chunk_size, node_id
        )
        return self._write(manifest, encode_chunks(cache, manifest, threads))

    def receive(
        self,
        manifest: pb.CacheManifest,
        chunks: Iterable[pb.Chunk],
        trailer_digest: str | None = None,
        decoder: CacheDecoder | None = None,
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
                f.write(MAGIC)
                for chunk in chunks:
                    _write_record(f, chunk.SerializeToString())
                # The encoder fills in sizes and digest as the last chunk goes out: id it now.
                manifest.cache_id = content_id(manifest)
                data = manifest.SerializeToString()
                f.write(data)
                f.write(FOOTER.pack(len(data), xxhash.xxh3_64_intdigest(data), FOOTER_MAGIC))
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
            raise StoreError(f"the cache takes {file_bytes:,} bytes, more than the store's budget of {self.max_bytes:,}")
        os.replace(tmp, path)
        now = _now_ms()
        with self._db() as db:
            db.execute("DELETE FROM blocks WHERE cache_id = ?", (manifest.cache_id,))
            db.execute(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (manifest.cache_id, manifest.model.model_id, manifest.prefix.num_tokens,
                 manifest.prefix.sha256, manifest.prefix.block_size, manifest.compression.method,
                 evicts_nothing(manifest), manifest.encoding.raw_bytes, file_bytes, now, now),
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
            rows = db.execute("SELECT cache_id, file_bytes FROM entries ORDER BY last_used_ms DESC, created_ms DESC").fetchall()
        total = sum(size for _, size in rows)
        for cache_id, size in reversed(rows):
            if total <= self.max_bytes:
                break
            if cache_id != keep:
                self.delete(cache_id)
                total -= size

    def delete(self, cache_id: str) -> None:
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
            rows = db.execute(
                "SELECT cache_id, model_id, num_tokens, prefix_sha256, method, evicts_nothing, raw_bytes,"
                f" file_bytes, created_ms, last_used_ms FROM entries {clause}", args,
            ).fetchall()
        return [StoredEntry(*row[:5], bool(row[5]), *row[6:]) for row in rows]

    def touch(self, cache_id: str) -> None:
        with self._db() as db:
            db.execute("UPDATE entries SET last_used_ms = ? WHERE cache_id = ?", (_now_ms(), cache_id))

    def total_bytes(self) -> int:
        with self._db() as db:
            return db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM entries").fetchone()[0]

    def manifest(self, cache_id: str) -> pb.CacheManifest:
        return read_entry_manifest(self._open(cache_id), source=cache_id)

    def chunks(self, cache_id: str) -> Iterator[pb.Chunk]:
        """The stored chunks, exactly as they were encoded (no recompression)."""
        return map(pb.Chunk.FromString, self.chunk_records(cache_id))

    def chunk_records(self, cache_id: str) -> Iterator[bytes]:
        """The stored chunks as serialized Chunk messages, checked against their record checksums."""
        f = self._open(cache_id)
        with f:
            manifest = read_entry_manifest(f, source=cache_id)
            yield from read_entry_records(f, manifest, source=cache_id)
        self.touch(cache_id)

    def _open(self, cache_id: str):
        try:
            return open(self._path(cache_id), "rb")
        except FileNotFoundError:
            raise NotFoundError(f"no cache {cache_id} in the store") from None

    def load(self, cache_id: str) -> tuple[pb.CacheManifest, list]:
        """Decode an entry into sparse MLX caches (checksums and digest verified)."""
        manifest = self.manifest(cache_id)
        return manifest, decode_chunks(manifest, self.chunks(cache_id))

    # Finding caches

    def lookup(self, model_id: str, tokens: Sequence[int]) -> PrefixMatch | None:
        """The entry serving the longest prefix of `tokens` for this model, if any.

        An entry serves its exact prefix; one that evicted nothing also serves any block-aligned
        shorter prefix of itself (see `prefix_entry`).
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

    def blocks_matched(self, model_id: str, hashes: Sequence[str]) -> dict[str, int]:
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

    def prefix_entry(self, cache_id: str, num_tokens: int) -> pb.CacheManifest:
        """The manifest of an entry holding the first `num_tokens` of `cache_id`.

        That is the entry itself, or (for an entry that evicted nothing, at a block boundary) a
        new entry cut from it once and then served like any other.
        """
        manifest = self.manifest(cache_id)
        if num_tokens == manifest.prefix.num_tokens:
            return manifest
        block = manifest.prefix.block_size
        if not evicts_nothing(manifest) or num_tokens % block or not 0 < num_tokens < manifest.prefix.num_tokens:
            raise StoreError(
                f"cache {cache_id} cannot serve a {num_tokens}-token prefix: only caches that evicted "
                f"nothing serve shorter prefixes, at multiples of {block} tokens"
            )
        prefix = PrefixKey(
            manifest.prefix.num_tokens, manifest.prefix.sha256, block, tuple(manifest.prefix.block_hashes)
        ).first_blocks(num_tokens // block)
        _, cache = self.load(cache_id)
        cache = [truncate(c, num_tokens) for c in cache]
        encoding = manifest.encoding
        cut = build_manifest(
            cache, ModelFingerprint.from_proto(manifest.model), prefix,
            make_press(manifest.compression.method, press_config(manifest)),
            codec=CODEC_NAMES[encoding.codec], level=encoding.level, byte_shuffle=encoding.byte_shuffle,
            chunk_size=encoding.chunk_size, node_id=manifest.node_id,
        )
        return self._write(cut, encode_chunks(cache, cut))

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
            f = open(path, "rb")
        except OSError as e:
            raise StoreError(f"{path}: cannot read: {e.strerror or e}") from e
        with f:
            manifest = read_entry_manifest(f, source=str(path))
            return self.receive(manifest, read_entry_chunks(f, manifest, source=str(path)))


class _Transaction:
    """`with store._db() as db:` runs the block in one transaction and closes the connection."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, *_):
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.db.close()


def read_entry_manifest(f, source: str) -> pb.CacheManifest:
    """The manifest from an entry file's footer (the file position is left after the magic)."""
    try:
        if f.read(len(MAGIC)) != MAGIC:
            raise IntegrityError(f"{source}: not a kvmesh cache file")
        end = f.seek(0, os.SEEK_END)
        if end < len(MAGIC) + FOOTER.size:
            raise IntegrityError(f"{source}: truncated cache file")
        f.seek(end - FOOTER.size)
        length, checksum, magic = FOOTER.unpack(f.read(FOOTER.size))
        if magic != FOOTER_MAGIC or length > min(MAX_MANIFEST_BYTES, end - FOOTER.size - len(MAGIC)):
            raise IntegrityError(f"{source}: truncated or corrupt cache file (no manifest footer)")
        f.seek(end - FOOTER.size - length)
        data = f.read(length)
        if xxhash.xxh3_64_intdigest(data) != checksum:
            raise IntegrityError(f"{source}: the manifest is corrupt")
        manifest = pb.CacheManifest.FromString(data)
        f.seek(len(MAGIC))
        return manifest
    except OSError as e:
        raise StoreError(f"{source}: cannot read: {e.strerror or e}") from e


def read_entry_chunks(f, manifest: pb.CacheManifest, source: str) -> Iterator[pb.Chunk]:
    return map(pb.Chunk.FromString, read_entry_records(f, manifest, source))


def read_entry_records(f, manifest: pb.CacheManifest, source: str) -> Iterator[bytes]:
    """The chunk records after the magic, each checked against its record checksum."""
    limit = max_encoded_length(manifest.encoding.chunk_size) + 1024
    for i in range(manifest.encoding.chunk_count):
        header = f.read(RECORD_HEADER.size)
        if len(header) != RECORD_HEADER.size:
            raise IntegrityError(f"{source}: truncated at chunk {i}")
        length, checksum = RECORD_HEADER.unpack(header)
        if length > limit:
            raise IntegrityError(f"{source}: chunk {i} record of {length} bytes is oversized")
        data = f.read(length)
        if len(data) != length or xxhash.xxh3_64_intdigest(data) != checksum:
            raise IntegrityError(f"{source}: chunk {i} is damaged on disk")
        yield data
