"""The store's SQLite index: one row per entry and its prefix's block hashes, a cache of the files.

The index is never the truth (each entry file carries its own manifest, `kvmesh.store.recovery`
rebuilds what it lacks), so it may be dropped whenever its tables change. Each thread keeps its own
connection for the store's life: SQLite removes the WAL when its last connection closes and must
create it again on the next open, which fails on a full disk, and reads would fail with it.
"""

import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvmesh.codec.manifest import cuttable, lossy, measured_loss, predicted
from kvmesh.errors import StoreError
from kvmesh.store.blocks import Piece
from kvmesh.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)
# Raised whenever the index's tables change, or what a column is derived from; an index of another
# version is rebuilt from the files (5: `lossy` reads quantized layers, not only the method, so
# entries of bits alone recorded as `full` lose their lossless mark; 6: transform-coded entries are
# `cuttable`, their shorter prefixes re-coded by kvmesh.codec.cut; 7: entry files are segments whose
# blocks others refer to, kvmesh.store.blocks; 8: the measured loss's metric is kept beside it, so a
# lookup names it: kvmesh.codec.manifest.LOSS_METRICS; 9: whether transform-coded layers are
# predicted from the layer before, kvmesh.codec.prediction).
INDEX_VERSION = 9
INDEX = "index.sqlite3"
# Opening the index is tried this many times on an error that may pass, waiting this long times
# the attempt between tries.
OPEN_TRIES = 3
OPEN_RETRY_S = 0.1


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
    # A press or a transform codec changed it, and the loss its producer measured (None: not
    # measured) by which metric (kvmesh.codec.manifest.LOSS_METRICS).
    lossy: bool = False
    loss: float | None = None
    loss_metric: str | None = None
    # Its transform-coded layers are predicted from the layer before (they decode slower on a CPU).
    predicted: bool = False


def now_ms() -> int:
    return int(time.time() * 1000)


ENTRY_COLUMNS = (
    "cache_id, model_id, num_tokens, prefix_sha256, method, cuttable, raw_bytes, file_bytes, created_ms, "
    "last_used_ms, lossy, loss, loss_metric, predicted"
)
SCHEMA_SQL = """
    CREATE TABLE IF NOT EXISTS entries (
        cache_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, num_tokens INTEGER NOT NULL,
        prefix_sha256 BLOB NOT NULL, block_size INTEGER NOT NULL, method TEXT NOT NULL,
        cuttable INTEGER NOT NULL, raw_bytes INTEGER NOT NULL,
        file_bytes INTEGER NOT NULL, created_ms INTEGER NOT NULL, last_used_ms INTEGER NOT NULL,
        lossy INTEGER NOT NULL, loss REAL, loss_metric TEXT, predicted INTEGER NOT NULL);
    CREATE INDEX IF NOT EXISTS entries_model ON entries (model_id);
    CREATE TABLE IF NOT EXISTS blocks (
        cache_id TEXT NOT NULL, idx INTEGER NOT NULL, hash BLOB NOT NULL, PRIMARY KEY (cache_id, idx));
    CREATE INDEX IF NOT EXISTS blocks_hash ON blocks (hash);
    CREATE TABLE IF NOT EXISTS segments (cache_id TEXT PRIMARY KEY, file_bytes INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS refs (cache_id TEXT NOT NULL, segment TEXT NOT NULL, PRIMARY KEY (cache_id, segment));
    CREATE INDEX IF NOT EXISTS refs_segment ON refs (segment);
    CREATE TABLE IF NOT EXISTS pieces (
        key BLOB PRIMARY KEY, segment TEXT NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL,
        digest INTEGER NOT NULL);
    CREATE INDEX IF NOT EXISTS pieces_segment ON pieces (segment);
    CREATE TABLE IF NOT EXISTS pins (writer TEXT NOT NULL, segment TEXT NOT NULL);
"""
TABLES = ("entries", "blocks", "segments", "refs", "pieces", "pins")


SEGMENT_SQL = "SELECT 1 FROM segments WHERE cache_id = ?"
TOUCH_SQL = "UPDATE entries SET last_used_ms = ? WHERE cache_id = ?"


@dataclass
class Written:
    """What a writer wrote of blocks (kvmesh.store.blocks.BlockWriter): the entries it refers to,
    the data bytes those references stand for, and the pieces it holds (key, offset, length, digest)."""

    writer: str = ""
    refs: set[str] = field(default_factory=set)
    referred: int = 0
    pieces: list[tuple[bytes, int, int, int]] = field(default_factory=list)


class Transaction:
    """`with index.write() as db:` runs the block in one write transaction."""

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


class Index:
    """The index of the store at `root`: opened for writing, read as it is, or built in memory."""

    def __init__(self, root: Path):
        self.root = root
        self.path = root / INDEX
        self._uri = self.path.absolute().as_uri()
        self._connections = threading.local()
        self.memory: sqlite3.Connection | None = None  # keeps an in-memory index alive

    def open_writable(self) -> None:
        """Open (or make) the index; one that is corrupt is moved aside and rebuilt from the files.

        An error that may pass (SQLite's OperationalError: "disk I/O error" while other processes
        open and close the index at once, a lock held too long) is tried again first: a store's
        writers once threw a sound index away for it, and one of them crashed when another had
        moved it first."""
        try:
            self._init_retrying()
            return
        except sqlite3.DatabaseError as e:
            self._move_aside(e)
        except OSError as e:
            raise StoreError(f"cannot open the store index at {self.path}: {e.strerror or e}") from e
        try:
            self._init()
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open the store index at {self.path}: {e}") from e

    def _init_retrying(self) -> None:
        """`_init`, tried OPEN_TRIES times while it fails with an error that may pass."""
        for attempt in range(1, OPEN_TRIES):
            try:
                self._init()
                return
            except sqlite3.OperationalError as e:
                log.info("opening the store index %s failed (%s): trying again", self.path, e)
                time.sleep(OPEN_RETRY_S * attempt)
        self._init()

    def _move_aside(self, error: sqlite3.DatabaseError) -> None:
        """Put an unreadable index aside (another process may have done so already)."""
        aside = self.path.with_name(f"{INDEX}.corrupt-{now_ms()}")
        log.warning("the store index %s is unreadable (%s): moved to %s, rebuilding it", self.path, error, aside.name)
        try:
            self.path.replace(aside)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"cannot move the unreadable store index {self.path} aside: {e.strerror or e}") from e
        for suffix in ("-wal", "-shm"):
            self.path.with_name(INDEX + suffix).unlink(missing_ok=True)

    def _init(self) -> None:
        with closing(sqlite3.connect(self.path, timeout=30)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != INDEX_VERSION:
                # Another version's index: forget it; recovery indexes the entry files this one reads.
                db.executescript("".join(f"DROP TABLE IF EXISTS {table};" for table in TABLES))
                db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
            db.executescript(SCHEMA_SQL)
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")

    def open_read_only(self) -> str | None:
        """Read the index of a store this process cannot write, as it is; why it cannot be (None: it is).

        SQLite opens a WAL index read-only only while its -shm file exists; a cleanly closed one
        has none, and nothing can change it here, so it is read as immutable.
        """
        problem = "there is none"
        uris = (f"{self._uri}?mode=ro", f"{self._uri}?immutable=1")
        for uri in uris if self.path.exists() else ():
            try:
                with closing(sqlite3.connect(uri, uri=True, timeout=30)) as db:
                    version = db.execute("PRAGMA user_version").fetchone()[0]
                    usable = version == INDEX_VERSION and db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            except sqlite3.Error as e:
                problem = str(e)
                continue
            if usable:
                self._uri = uri
                return None
            return f"an index of version {version}, not {INDEX_VERSION}, or damaged"
        return problem

    def open_memory(self) -> None:
        """An empty index in memory, for this process (the files are indexed into it by recovery)."""
        self._uri = f"file:kvmesh-store-{uuid.uuid4().hex}?mode=memory&cache=shared"
        self.memory = sqlite3.connect(self._uri, uri=True, check_same_thread=False)
        self.memory.executescript(SCHEMA_SQL)

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, kept open for the store's life (see the module's docstring)."""
        db = getattr(self._connections, "db", None)
        if db is None:
            db = sqlite3.connect(self._uri, uri=True, timeout=30, isolation_level=None)
            # A commit is not synced (a power cut may lose the last ones, never the index's
            # consistency): the index is rebuilt from the entry files, each synced before its row is
            # written, so a lost row comes back at the next open (kvmesh.store.recovery). A synced
            # commit was a second fsync on every fetch's path, after its last layer decoded.
            db.execute("PRAGMA synchronous=NORMAL")
            db.row_factory = sqlite3.Row
            self._connections.db = db
        return db

    def write(self) -> Transaction:
        """A write transaction (`with index.write() as db:`)."""
        return Transaction(self.connection())

    def read(self) -> "nullcontext[sqlite3.Connection]":
        """The connection, for reading: no write lock, so reads work on a full disk."""
        return nullcontext(self.connection())

    def ids(self) -> set[str]:
        """The entry files the index knows: entries, and those kept only for the blocks others use."""
        with self.read() as db:
            return {row[0] for row in db.execute("SELECT cache_id FROM entries UNION SELECT cache_id FROM segments")}

    def refs_of(self, cache_id: str) -> list[str]:
        """The entry files whose blocks this entry's file refers to."""
        with self.read() as db:
            return [row[0] for row in db.execute("SELECT segment FROM refs WHERE cache_id = ?", (cache_id,))]

    def select(self, clause: str, args: tuple = ()) -> list[StoredEntry]:
        with self.read() as db:
            rows = db.execute(f"SELECT {ENTRY_COLUMNS} FROM entries {clause}", args).fetchall()
        return [
            StoredEntry(
                **{
                    **dict(row),
                    "cuttable": bool(row["cuttable"]),
                    "lossy": bool(row["lossy"]),
                    "predicted": bool(row["predicted"]),
                }
            )
            for row in rows
        ]

    @staticmethod
    def has(db: sqlite3.Connection, cache_id: str) -> bool:
        return db.execute("SELECT 1 FROM entries WHERE cache_id = ?", (cache_id,)).fetchone() is not None

    @classmethod
    def insert(cls, db: sqlite3.Connection, manifest: pb.CacheManifest, file_bytes: int) -> None:
        """In `db`'s write transaction: an entry's rows (replacing any it had)."""
        now = now_ms()
        loss = measured_loss(manifest)
        cls.unindex(db, manifest.cache_id)
        db.execute(
            "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                manifest.cache_id,
                manifest.model.model_id,
                manifest.prefix.num_tokens,
                manifest.prefix.sha256,
                manifest.prefix.block_size,
                manifest.compression.method,
                cuttable(manifest),
                manifest.encoding.raw_bytes,
                file_bytes,
                now,
                now,
                lossy(manifest),
                loss,
                manifest.quality.metric if loss is not None else None,
                predicted(manifest),
            ),
        )
        db.executemany(
            "INSERT INTO blocks VALUES (?, ?, ?)",
            [(manifest.cache_id, i, h) for i, h in enumerate(manifest.prefix.block_hashes)],
        )

    def add_file(
        self,
        manifest: pb.CacheManifest,
        path: Path,
        *,
        source: Path | None = None,
        only_new: bool = False,
        written: Written | None = None,
    ) -> bool:
        """Index the entry file at `path`, first renaming `source` there; True when it was indexed.

        The rename and the rows are one write transaction: another process's eviction (rows and
        file, also one) comes wholly before or after, never between. `only_new` (recovery) indexes
        a file only while it still exists and has no row: another process may have evicted or
        indexed it since it was listed. `written`: what its writer referred to and wrote of blocks
        (its pins are released with it).
        """
        written = written or Written()
        renamed = False
        try:
            with self.write() as db:
                held = [s for s in written.refs if db.execute(SEGMENT_SQL, (s,)).fetchone()]
                if source is not None and (gone := sorted(written.refs - set(held))):
                    raise StoreError(
                        f"the store lost the entry {gone[0]} whose blocks this cache shares: store it again"
                    )
                if source is not None and db.execute(SEGMENT_SQL, (manifest.cache_id,)).fetchone() and path.is_file():
                    # Held already (as an entry, or for blocks others use): the file others refer to stays.
                    if not self.has(db, manifest.cache_id):
                        self.insert(db, manifest, path.stat().st_size + written.referred)
                    db.execute(TOUCH_SQL, (now_ms(), manifest.cache_id))
                    db.execute("DELETE FROM pins WHERE writer = ?", (written.writer,))
                    return True
                if source is not None:
                    os.replace(source, path)
                    renamed = True
                elif only_new and (not path.is_file() or self.has(db, manifest.cache_id)):
                    return False
                physical = path.stat().st_size
                self.insert(db, manifest, physical + written.referred)
                self.drop_segment(db, manifest.cache_id)
                db.execute("INSERT INTO segments VALUES (?, ?)", (manifest.cache_id, physical))
                db.executemany("INSERT INTO refs VALUES (?, ?)", [(manifest.cache_id, s) for s in written.refs])
                db.executemany(
                    "INSERT OR IGNORE INTO pieces VALUES (?, ?, ?, ?, ?)",
                    [(key, manifest.cache_id, *place) for key, *place in written.pieces],
                )
                db.execute("DELETE FROM pins WHERE writer = ?", (written.writer,))
        except (sqlite3.Error, OSError) as e:
            if renamed:  # the rows were rolled back: the file must not stay unindexed
                path.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise
            raise StoreError(f"cannot update the store index at {self.root}: {e}") from e
        return True

    def pin(self, writer: str, keys: Sequence[bytes]) -> dict[bytes, Piece]:
        """The pieces of these keys the store holds, their files pinned for `writer` (eviction
        leaves them until its entry is indexed or recovery finds the writer gone)."""
        found: dict[bytes, Piece] = {}
        if not keys:
            return found
        with self.write() as db:
            for start in range(0, len(keys), 500):
                part = keys[start : start + 500]
                rows = db.execute(
                    "SELECT key, segment, offset, length, digest FROM pieces "
                    f"WHERE key IN ({','.join('?' * len(part))})",
                    tuple(part),
                )
                found.update({key: Piece(*place) for key, *place in rows})
            db.executemany("INSERT INTO pins VALUES (?, ?)", [(writer, s) for s in {p.segment for p in found.values()}])
        return found

    def release_pins(self, alive: Callable[[], set[str]]) -> None:
        """Release the pins of writers that are gone (`alive()`: the staging files left, by name),
        listed inside the transaction: a writer makes its file before it pins, so one that pinned
        before is listed."""
        with self.write() as db:
            writers = {row[0] for row in db.execute("SELECT DISTINCT writer FROM pins")}
            if writers:
                db.executemany("DELETE FROM pins WHERE writer = ?", [(w,) for w in writers - alive()])

    def unpin(self, writer: str) -> None:
        """Release a writer's pins (its write failed); best effort, as recovery releases them too."""
        try:
            with self.write() as db:
                db.execute("DELETE FROM pins WHERE writer = ?", (writer,))
        except sqlite3.Error as e:
            log.debug("could not release the pins of %s: %s", writer, e)

    @staticmethod
    def drop_segment(db: sqlite3.Connection, cache_id: str) -> None:
        """Forget an entry file as a segment: its size, what it refers to, the pieces it holds."""
        db.execute("DELETE FROM segments WHERE cache_id = ?", (cache_id,))
        db.execute("DELETE FROM refs WHERE cache_id = ?", (cache_id,))
        db.execute("DELETE FROM pieces WHERE segment = ?", (cache_id,))

    @staticmethod
    def unindex(db: sqlite3.Connection, cache_id: str) -> bool:
        """Drop an entry's rows (in `db`'s transaction); True when it had any."""
        found = db.execute("DELETE FROM entries WHERE cache_id = ?", (cache_id,)).rowcount > 0
        db.execute("DELETE FROM blocks WHERE cache_id = ?", (cache_id,))
        return found

    def touch(self, cache_id: str) -> None:
        """Record a use (for LRU eviction); skipped, not failed, when the disk is full."""
        try:
            with self.write() as db:
                db.execute(TOUCH_SQL, (now_ms(), cache_id))
        except sqlite3.Error as e:
            log.debug("could not record a use of %s: %s", cache_id, e)

    def kept_alive_bytes(self, refs: set[str]) -> int:
        """The bytes of the entry files `refs` name and of every file they refer to in turn: what a
        new entry referring to `refs` keeps on the disk besides its own file."""
        seen: set[str] = set()
        with self.read() as db:
            todo = list(refs)
            while todo:
                if (segment := todo.pop()) not in seen:
                    seen.add(segment)
                    todo += [row[0] for row in db.execute("SELECT segment FROM refs WHERE cache_id = ?", (segment,))]
            return sum(
                row[0] for s in seen for row in db.execute("SELECT file_bytes FROM segments WHERE cache_id = ?", (s,))
            )

    def total_bytes(self) -> int:
        with self.read() as db:
            return db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM segments").fetchone()[0]

    def blocks_matched(self, model_id: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each entry of the model: how many leading blocks it shares with these hashes.

        Hashes are chained, so a match at block i means blocks 0..i all match.
        """
        matched: dict[str, int] = {}
        with self.read() as db:
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
