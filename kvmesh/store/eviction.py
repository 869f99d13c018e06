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


def remove(layout: Layout, index: Index, db: sqlite3.Connection, cache_id: str) -> bool:
    """In `db`'s write transaction: an entry's rows and file; True when it had either."""
    found = index.unindex(db, cache_id)
    try:
        layout.path(cache_id).unlink()
    except FileNotFoundError:
        return found
    return True


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
            total = sum(size for _, size in rows)
            for cache_id, size in reversed(rows):
                if total <= max_bytes:
                    break
                if cache_id != keep:
                    remove(layout, index, db, cache_id)
                    evicted.append((cache_id, size))
                    total -= size
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
