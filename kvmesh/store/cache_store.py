"""The local cache store: entries on disk in their wire encoding, indexed in SQLite.

An entry is one file (`kvmesh.store.entry_file`): the chunks exactly as they travel, then the
manifest. Caches are compressed once, before they enter the store (`kvmesh.codec.encode`), and
served many times by reading the file; the store itself never encodes, decodes or cuts a cache.
A writer stages its file (`kvmesh.store.layout`), syncs it, then renames it into `entries/` and
indexes it in one write transaction of the index (`kvmesh.store.index`), under an flock it holds
until the index commits: a half-written cache is never visible, and writers in several processes
take turns there, as they do over an eviction's rows and files (`kvmesh.store.eviction`).

The index is a cache of the entry files, never the truth: opening a store repairs it from them
(`kvmesh.store.recovery`), and a damaged or misplaced entry is quarantined, never served again.
Reads work on a full disk: they take no write lock, and recording a use is best effort. A store
this process cannot write (a read-only mount, another user's directory) serves reads all the same;
writes refuse in one line naming it.

This class is the facade the rest of kvmesh calls; the modules named above do the work.
"""

import logging
import os
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvmesh import paths
from kvmesh.codec.chunks import DECODE_THREADS, Chunk, ChunkChecker, parse_frame
from kvmesh.codec.compat import validate_manifest
from kvmesh.codec.manifest import content_id, uncuttable_reason
from kvmesh.codec.prefix import BLOCK_SIZE, block_hashes
from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.store import blocks, entry_file, eviction, matching, recovery
from kvmesh.store.budget import AUTO_BUDGET, resolve_budget
from kvmesh.store.index import INDEX, Index, StoredEntry, Written
from kvmesh.store.layout import Layout, VerifiedManifests
from kvmesh.store.matching import PrefixMatch
from kvmesh.v1 import cache_pb2 as pb

__all__ = ["INDEX", "CacheStore", "PrefixMatch", "Problem", "StoredEntry"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """An entry that failed verification, and why; it is in quarantine now."""

    cache_id: str
    problem: str


class CacheStore:
    """Caches on disk, one file each, found through an SQLite index of their prefixes.

    Safe to share between threads and processes (the daemon and the CLI open the same store).
    `max_bytes` is the budget: AUTO_BUDGET (the default) is 10% of the disk the store is on, None
    no limit. Every writer keeps to it, least-recently used entries going first.
    """

    def __init__(self, root: Path | str | None = None, *, max_bytes: int | None = AUTO_BUDGET):
        self.root = Path(root) if root else paths.store_dir()
        self.layout = Layout(self.root)
        self.entries_dir = self.layout.entries_dir
        self.incoming_dir = self.layout.incoming_dir
        self.quarantine_dir = self.layout.quarantine_dir
        self.index = Index(self.root)
        self._manifests = VerifiedManifests()
        # Why this process cannot write the store (None: it can); reads work either way.
        self.read_only_reason = self.layout.make_dirs(self.index.path)
        # The disk the entries are on (entries/ may be a link to another one).
        self.max_bytes = resolve_budget(max_bytes, self.entries_dir if self.entries_dir.is_dir() else self.root)
        if self.read_only_reason:
            self._open_read_only()
        else:
            self.index.open_writable()
            self.recover()

    @property
    def read_only(self) -> bool:
        return self.read_only_reason is not None

    def _open_read_only(self) -> None:
        """Read the index as it is; one that is missing, damaged or of another version cannot be
        rebuilt on the disk, so it is built in memory from the entry files, for this process."""
        if (problem := self.index.open_read_only()) is None:
            return
        log.warning(
            "the store at %s cannot be written (%s) and its index is unusable (%s): indexing its files in memory",
            self.root,
            self.read_only_reason,
            problem,
        )
        self.index.open_memory()
        recovery.index_unindexed(self.layout, self.index, set(), self.layout.entry_files(), writable=False)

    def _refuse_writes(self) -> None:
        if self.read_only_reason:
            raise StoreError(self._read_only_message())

    def _read_only_message(self) -> str:
        return (
            f"the store at {self.root} cannot be written ({self.read_only_reason}): its caches can be listed "
            "and read, not added or deleted (give a writable one with --store)"
        )

    def recover(self) -> None:
        """Make the index agree with the files (`kvmesh.store.recovery.recover`); called on open."""
        if not self.read_only_reason:
            recovery.recover(self.layout, self.index)

    def _quarantine(self, path: Path, problem: str) -> None:
        recovery.quarantine(self.layout, self.index, path, problem, writable=not self.read_only_reason)

    # Writing

    def add(
        self,
        manifest: pb.CacheManifest,
        chunks: Iterable[Chunk],
        *,
        before_commit: Callable[[], None] | None = None,
    ) -> pb.CacheManifest:
        """Store a cache whose chunks this process made or checked: `store.add(*encode_cache(...))`,
        or a fetched cache as its decoder checks it (`kvmesh.codec.decode.CacheDecoder.feed_iter`).

        The chunks are written as they come; the manifest, completed by the encoder once the last
        chunk is out, gets its id and goes last. Returns it. Whatever `chunks` raises (a chunk or
        digest that fails its decoder's checks) leaves nothing in the store, and so does whatever
        `before_commit` raises: it runs once the entry is written and synced, before it is indexed
        (a fetch's decoder waits there for its last layers: the sync overlaps their decoding).
        """
        return self._write(manifest, chunks, before_commit)

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

    def _write(
        self, manifest: pb.CacheManifest, chunks: Iterable[Chunk], before_commit: Callable[[], None] | None = None
    ) -> pb.CacheManifest:
        """Write an entry: staged, synced, renamed and indexed in one transaction, then the budget
        kept. A blockwise cache's blocks that another entry holds become references to it
        (`kvmesh.store.blocks`), pinned from the first chunk until the index commits."""
        self._refuse_writes()
        manifest.ClearField("held")  # (what one transfer left out: the entry holds every chunk)
        try:
            tmp, f = self.layout.staging_file()
        except OSError as e:
            raise StoreError(f"cannot write to the store at {self.root}: {e.strerror or e}") from e
        keys = blocks.piece_keys(manifest)
        try:
            found = self.index.pin(tmp.name, sorted(set(keys.values())))
        except sqlite3.Error as e:
            f.close()
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot update the store index at {self.root}: {e}") from e
        writer = blocks.BlockWriter(keys, found)
        try:
            with f:
                entry_file.write_header(f, blocks=bool(found))
                for chunk in chunks:
                    writer.write(f, chunk)
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
                # Its own bytes and the files whose blocks it shares: no eviction can free those.
                kept = file_bytes + self.index.kept_alive_bytes(writer.refs)
                if self.max_bytes is not None and kept > self.max_bytes:
                    raise StoreError(
                        f"the cache keeps {kept:,} bytes on disk with the blocks it shares, more than the "
                        f"store's budget of {self.max_bytes:,}"
                    )
                if before_commit is not None:
                    before_commit()
                path = self.layout.path(manifest.cache_id)
                written = Written(tmp.name, writer.refs, writer.referred, writer.new)
                self.index.add_file(manifest, path, source=tmp, written=written)
        except OSError as e:
            raise StoreError(f"cannot write to the store at {self.root}: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)
            if found:
                self.index.unpin(tmp.name)  # (released with the rows when it was indexed)
        eviction.evict(self.layout, self.index, self.max_bytes, keep=manifest.cache_id)
        return manifest

    def enforce_budget(self) -> None:
        """Evict least-recently used entries until the store fits its budget (what each write does
        for itself; the daemon calls it for writers that kept to another budget)."""
        eviction.evict(self.layout, self.index, self.max_bytes)

    def delete(self, cache_id: str) -> None:
        """Remove an entry (its index rows and its file, together); NotFoundError if there is none."""
        self._refuse_writes()
        self.layout.path(cache_id)  # a bad id is NotFoundError before anything is touched
        try:
            with self.index.write() as db:
                found = eviction.remove(self.layout, self.index, db, cache_id)
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
            return self.index.select("ORDER BY created_ms")
        return self.index.select("WHERE model_id = ? ORDER BY created_ms", (model_id,))

    def entry(self, cache_id: str) -> StoredEntry:
        found = self.index.select("WHERE cache_id = ?", (cache_id,))
        if not found:
            raise NotFoundError(f"no cache {cache_id} in the store")
        return found[0]

    def resolve(self, given: str, shared: Callable[[str], bool] | None = None) -> str:
        """The id of the one cache whose id starts with `given` (as git takes a commit's prefix): a
        person types `46f0c5a6`, not 32 digits. None or several matching is a NotFoundError saying so.
        `shared`: which models' caches count (a daemon's share_models: the others look absent)."""
        found = self.index.select("WHERE cache_id >= ? AND cache_id < ?", matching.id_range(given))
        return matching.one_id(given, found, shared)

    def touch(self, cache_id: str) -> None:
        """Record a use (for LRU eviction); skipped, not failed, when the disk is full or read-only."""
        if not self.read_only_reason:
            self.index.touch(cache_id)

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def manifest(self, cache_id: str) -> pb.CacheManifest:
        """The entry's manifest, checked to be that entry's (a damaged or misplaced file is quarantined)."""
        path = self.layout.path(cache_id)
        try:
            return self._manifests.get(path, cache_id)
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
        path = self.layout.path(cache_id)
        try:
            with open(path, "rb") as f, ExitStack() as opened:
                # Every file it refers to opened before the first record: an eviction meanwhile unlinks
                # them, and an open file outlives its unlink.
                segments = self._segments(opened, self.index.refs_of(cache_id))
                yield from entry_file.read_records(f, manifest, f"cache {cache_id}", segments)
        except FileNotFoundError:
            raise NotFoundError(
                f"no cache {cache_id} in the store (or the blocks it shares went with an eviction)"
            ) from None
        except IntegrityError as e:
            self._quarantine(path, str(e))
            raise
        self.touch(cache_id)

    def _segments(self, opened: ExitStack, now: list[str]) -> entry_file.Segments:
        """Opens the entry files a blockwise entry refers to, each once, closed with `opened`: those
        `now` at once (a missing one raises FileNotFoundError here), any other when first read."""
        files: dict[str, BinaryIO] = {}

        def segment(cache_id: str) -> BinaryIO:
            if cache_id not in files:
                files[cache_id] = opened.enter_context(open(self.layout.path(cache_id), "rb"))  # noqa: SIM115
            return files[cache_id]

        for cache_id in now:
            segment(cache_id)
        return segment

    def verify(self, cache_id: str) -> None:
        """Check every chunk of an entry (decoded and checksummed) and its payload digest.

        A damaged entry is quarantined and raises IntegrityError.
        """
        manifest = self.manifest(cache_id)
        try:
            for _ in ChunkChecker(manifest).verified(self.chunks(cache_id), threads=DECODE_THREADS):
                pass
        except IntegrityError as e:
            self._quarantine(self.layout.path(cache_id), str(e))
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
        """The entry serving the longest prefix of `tokens` for this model, if any
        (`kvmesh.store.matching.longest_prefix`: cut prefixes of dense entries, the less lossy first)."""
        shared = self.blocks_matched(model_id, block_hashes(tokens, BLOCK_SIZE))
        return matching.longest_prefix(self.entries(model_id), shared, tokens)

    def exact_only(self, model_id: str, tokens: Sequence[int], beyond: int = 0) -> tuple[PrefixMatch, str] | None:
        """The entry that shares the most block-aligned tokens of `tokens` (more than `beyond`) yet
        serves none of them, and why (`kvmesh.codec.manifest.uncuttable_reason`): it serves only its
        exact prefix (a press evicted positions, a window dropped some, a layer is recurrent state),
        which `tokens` does not extend. Its `tokens` are those it shares. So a lookup that finds
        nothing can say what it passed over."""
        shared = self.blocks_matched(model_id, block_hashes(tokens, BLOCK_SIZE))
        best = matching.exact_only(self.entries(model_id), shared, tokens, beyond)
        if best is None:
            return None
        try:
            why = uncuttable_reason(self.manifest(best.entry.cache_id)) or "its index says so"
        except (IntegrityError, NotFoundError) as e:
            why = str(e)
        return best, why

    def blocks_matched(self, model_id: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each entry of the model: how many leading blocks it shares with these hashes."""
        return self.index.blocks_matched(model_id, hashes)

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
