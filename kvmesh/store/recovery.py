"""Making a store's index agree with its files, and taking damaged entries out of service.

Opening a store deletes what a dead writer left in its staging directory, re-indexes entry files the
index lacks (a lost, corrupt or older index is rebuilt that way), forgets rows whose file is gone,
and leaves alone what a live writer is still working on. An entry found damaged or misplaced (its
file holds another cache: a sync tool restored it under the wrong name) is moved to `quarantine/`,
never served or listed again, and logged; nothing that still verifies is ever deleted here.
"""

import logging
import shutil
import sqlite3
from pathlib import Path

from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.store import blocks, entry_file
from kvmesh.store.index import Index, Written, now_ms
from kvmesh.store.layout import LEGACY_STAGING, Layout, abandoned, remove_if_abandoned, verified_manifest

log = logging.getLogger(__name__)


def recover(layout: Layout, index: Index) -> None:
    """Make the index agree with the files (of a store this process can write).

    Removes what dead writers left in the staging directory and index rows whose file is gone;
    indexes entry files the index lacks when their manifest verifies, and quarantines those that
    do not. Files a live writer holds are left alone, and so is anything in entries/ that is no
    entry file (skipped with a warning).
    """
    for staging in (layout.incoming_dir, layout.root / LEGACY_STAGING):
        for leftover in staging.iterdir() if staging.is_dir() else ():
            remove_if_abandoned(leftover)
    indexed = index.ids()
    try:
        index.release_pins(lambda: {p.name for p in layout.incoming_dir.iterdir()})
        on_disk = layout.entry_files()
        forget_missing(layout, index, indexed, on_disk)
        index_unindexed(layout, index, indexed, on_disk, writable=True)
    except (sqlite3.Error, StoreError, OSError) as e:
        # A full disk: reads still work; the next open finishes the repair.
        log.warning("the store index could not be repaired now (%s); reading on", e)


def forget_missing(layout: Layout, index: Index, indexed: set[str], on_disk: dict[str, Path]) -> None:
    """Drop index rows whose entry file is gone (deleted by hand, lost with a disk).

    Checked again inside the write transaction: a writer renames and indexes in one, so a file
    that appeared since `indexed` was read is seen, and its row kept.
    """
    missing = indexed - set(on_disk)
    if not missing:
        return
    forgotten = 0
    with index.write() as db:
        for cache_id in missing:
            if not layout.path(cache_id).exists():  # (a link there to nothing stays: not ours)
                forgotten += index.unindex(db, cache_id)
                index.drop_segment(db, cache_id)
    if forgotten:
        log.warning("forgot %d index entries whose files are gone", forgotten)


def index_unindexed(
    layout: Layout, index: Index, indexed: set[str], on_disk: dict[str, Path], *, writable: bool
) -> None:
    """Index the entry files not in `indexed` whose manifests verify; quarantine the others."""
    added = 0
    for cache_id, path in on_disk.items():
        if cache_id in indexed or not abandoned(path):
            continue
        try:
            manifest = verified_manifest(path, cache_id)
        except NotFoundError:  # evicted or deleted since it was listed
            continue
        except (IntegrityError, StoreError) as e:
            quarantine(layout, index, path, str(e), writable=writable)
            continue
        try:
            with open(path, "rb") as f:  # what it refers to must be known before anything is evicted
                refs, referred, inline = entry_file.layout(f, manifest)
                written = Written("", refs, referred, blocks.pieces_of(f, manifest, inline))
        except OSError:
            continue
        added += index.add_file(manifest, path, only_new=True, written=written)
    if added:
        log.info("indexed %d entry files the index lacked", added)


def quarantine(layout: Layout, index: Index, path: Path, problem: str, *, writable: bool) -> None:
    """Take a damaged or misplaced entry out of service: out of the index, its file aside.

    In a store this process cannot write (`writable` False), nothing can move: the problem is
    logged, and the caller's error stands; an index built in memory forgets the entry all the same."""
    cache_id = path.stem
    if not writable and index.memory is None:
        log.warning(
            "cache %s is damaged (%s); the store at %s cannot be written, so it stays", cache_id, problem, layout.root
        )
        return
    try:
        with index.write() as db:
            index.unindex(db, cache_id)
            index.drop_segment(db, cache_id)
    except sqlite3.Error as e:
        log.error("cannot unindex %s: %s", cache_id, e)
    if not writable:
        log.warning("not serving damaged cache %s: %s", cache_id, problem)
        return
    try:
        layout.quarantine_dir.mkdir(exist_ok=True)
        # A move, not a rename: entries/ may be on another file system than quarantine/.
        shutil.move(path, layout.quarantine_dir / f"{cache_id}.{now_ms()}.kvc")
    except FileNotFoundError:
        pass
    except OSError as e:  # a full disk: at least stop serving it
        log.error("cannot move %s to quarantine (%s): deleting it", path, e.strerror or e)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.error("cannot delete %s either (%s)", path, e.strerror or e)
    log.warning("quarantined cache %s: %s", cache_id, problem)
