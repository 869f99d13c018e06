"""Keeping a store within its byte budget: least-recently used entries go first.

One write transaction chooses and removes them (rows and files), so writers evicting at the same
moment take turns: each sees what the others left, none is told of a cache that another removed
first, and together they evict no more than the budget asks.
"""

import logging
import sqlite3

from kvmesh.store.index import Index
from kvmesh.store.layout import Layout

log = logging.getLogger(__name__)


# Entry files no entry lists, no other file refers to and no writer has pinned: nothing needs them.
UNUSED_SQL = """
    SELECT cache_id, file_bytes FROM segments WHERE cache_id NOT IN (SELECT cache_id FROM entries)
    AND cache_id NOT IN (SELECT segment FROM refs) AND cache_id NOT IN (SELECT segment FROM pins)"""


# Whether another entry file refers to this one's blocks.
SHARED_SQL = "SELECT 1 FROM refs WHERE segment = ? LIMIT 1"


def remove(layout: Layout, index: Index, db: sqlite3.Connection, cache_id: str) -> bool:
    """In `db`'s write transaction: an entry's rows, and its file unless others refer to its blocks
    (it goes once they no longer do: `collect`); True when it had either."""
    found = index.unindex(db, cache_id)
    known = db.execute("SELECT 1 FROM segments WHERE cache_id = ?", (cache_id,)).fetchone() is not None
    if not known:  # (a file the index never knew as a segment)
        try:
            layout.path(cache_id).unlink()
        except FileNotFoundError:
            return found
        return True
    collect(layout, index, db)
    return True


def collect(layout: Layout, index: Index, db: sqlite3.Connection) -> int:
    """In `db`'s write transaction: delete the entry files nothing needs any more (`UNUSED_SQL`),
    then those only they referred to, and so on; the bytes freed."""
    freed = 0
    while unused := db.execute(UNUSED_SQL).fetchall():
        for cache_id, size in unused:
            index.drop_segment(db, cache_id)
            layout.path(cache_id).unlink(missing_ok=True)
            freed += size
    return freed


def evict(layout: Layout, index: Index, max_bytes: int | None, *, keep: str = "") -> None:
    """Drop least-recently used entries until the store fits `max_bytes` (None: no budget).

    `keep` is stored by then and stays: an eviction that fails is logged, not that write's failure.
    """
    if max_bytes is None:
        return
    evicted = []
    try:
        with index.write() as db:
            rows = db.execute(
                "SELECT cache_id, file_bytes FROM entries ORDER BY last_used_ms DESC, created_ms DESC"
            ).fetchall()
            # Each file once: an entry whose blocks others share frees only what is its own.
            total = db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM segments").fetchone()[0]
            total -= collect(layout, index, db)
            gone: set[str] = set()
            # Least recently used first, passing over an entry whose blocks an entry that stays shares
            # (removing it would free nothing); again while a pass frees something, for the entries
            # that only the removed ones shared.
            freeing = True
            while total > max_bytes and freeing:
                freeing = False
                for cache_id, size in reversed(rows):
                    if total <= max_bytes:
                        break
                    if cache_id == keep or cache_id in gone or db.execute(SHARED_SQL, (cache_id,)).fetchone():
                        continue
                    index.unindex(db, cache_id)
                    gone.add(cache_id)
                    evicted.append((cache_id, size))
                    total -= collect(layout, index, db)
                    freeing = True
    except (sqlite3.Error, OSError) as e:
        log.warning(
            "could not evict to keep the store within %s bytes%s: %s",
            f"{max_bytes:,}",
            f" (stored {keep})" if keep else "",
            e,
        )
        return
    for cache_id, size in evicted:
        log.info(
            "evicted cache %s (%s bytes, least recently used) to keep the store within %s bytes",
            cache_id,
            f"{size:,}",
            f"{max_bytes:,}",
        )
