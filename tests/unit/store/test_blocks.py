"""Caches by blocks (#30): a conversation's turns share their history's blocks in the store, once
on disk and in the budget, and a peer that holds the first blocks of a cache is sent only the rest.

Turns are prefilled in steps of one block (step_size=128), as a server extends its cache turn by
turn: the rows of every whole block come out the same bytes in each turn, which is what a turn
that extends the last one's cache gives.
"""

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.codec.chunks import parse_frame
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.manifest import whole_entry_reason
from kvmesh.codec.prefix import BLOCK_SIZE
from kvmesh.errors import NotFoundError, StoreError
from kvmesh.store import CacheStore
from support.references import same_tensors
from support.stores import put

TURNS = (200, 330, 460, 590, 720)  # a 5-turn conversation's prompt lengths


@pytest.fixture(scope="module")
def turns(tiny, long_ids):
    """Each turn's (tokens, cache)."""
    return [(long_ids[:n], prefill(tiny[0], long_ids[:n], step_size=BLOCK_SIZE).cache) for n in TURNS]


def disk_bytes(store: CacheStore) -> int:
    return sum(p.stat().st_size for p in store.entries_dir.glob("*.kvc"))


def whole_bytes(tmp_path, name, cache, fp, tokens) -> int:
    """The bytes one cache takes alone in a store of its own: a whole copy."""
    alone = CacheStore(tmp_path / name)
    put(alone, cache, fp, tokens)
    return disk_bytes(alone)


def test_a_conversations_turns_store_each_history_block_once(turns, tiny_fp, tmp_path):
    store = CacheStore(tmp_path / "store", max_bytes=None)
    stored = [put(store, cache, tiny_fp, tokens) for tokens, cache in turns]
    assert all(m.encoding.block_rows == BLOCK_SIZE and not whole_entry_reason(m) for m in stored)
    wholes = [whole_bytes(tmp_path, f"alone{i}", cache, tiny_fp, tokens) for i, (tokens, cache) in enumerate(turns)]
    # Each whole block once: the last turn's bytes, and the partial last block of each earlier turn
    # (here 72 to 78 rows each, 3 blocks' worth in all: 8 blocks of the last turn's 5.6).
    on_disk = disk_bytes(store)
    assert on_disk == store.total_bytes()
    tails = sum(n % BLOCK_SIZE for n in TURNS[:-1]) / TURNS[-1]
    assert on_disk < wholes[-1] * (1 + tails) * 1.02 and on_disk < sum(wholes) / 2, (on_disk, wholes)
    # Every turn reads back exactly, references resolved.
    for m, (_, cache) in zip(stored, turns, strict=True):
        assert same_tensors(decode_chunks(m, store.chunks(m.cache_id)), cache)
    # A fresh index (lost, or of an older version) is rebuilt with what each file refers to and
    # holds: the same entries and sizes, and a turn stored again shares the same blocks.
    listed = {e.cache_id: e.file_bytes for e in store.entries()}
    (tmp_path / "store" / "index.sqlite3").unlink()
    reopened = CacheStore(tmp_path / "store", max_bytes=None)
    assert {e.cache_id: e.file_bytes for e in reopened.entries()} == listed
    assert reopened.total_bytes() == on_disk
    reopened.delete(stored[-1].cache_id)
    put(reopened, turns[-1][1], tiny_fp, turns[-1][0])
    assert disk_bytes(reopened) == on_disk


def test_evicting_a_turn_keeps_the_blocks_later_turns_share(turns, tiny_fp, tmp_path):
    store = CacheStore(tmp_path / "store", max_bytes=None)
    first, second = (put(store, cache, tiny_fp, tokens) for tokens, cache in turns[:2])
    store.delete(first.cache_id)
    with pytest.raises(NotFoundError):
        store.entry(first.cache_id)
    assert same_tensors(decode_chunks(second, store.chunks(second.cache_id)), turns[1][1])
    store.delete(second.cache_id)  # now nothing needs the first file either
    assert disk_bytes(store) == store.total_bytes() == 0


def test_the_budget_counts_shared_blocks_once(turns, tiny_fp, tmp_path):
    sizes = CacheStore(tmp_path / "probe", max_bytes=None)
    for tokens, cache in turns:
        put(sizes, cache, tiny_fp, tokens)
    shared = disk_bytes(sizes)
    # A budget the five turns fit only because their blocks are shared keeps all five.
    store = CacheStore(tmp_path / "store", max_bytes=int(shared * 1.05))
    for tokens, cache in turns:
        put(store, cache, tiny_fp, tokens)
    assert len(store.entries()) == len(TURNS)
    assert disk_bytes(store) <= store.max_bytes


def test_an_exported_blockwise_entry_stands_alone(turns, tiny_fp, tmp_path):
    store = CacheStore(tmp_path / "store")
    put(store, turns[0][1], tiny_fp, turns[0][0])
    later = put(store, turns[1][1], tiny_fp, turns[1][0])
    path = store.export(later.cache_id, tmp_path / "turn2.kvc")
    elsewhere = CacheStore(tmp_path / "elsewhere")
    imported = elsewhere.import_file(path)
    assert same_tensors(decode_chunks(imported, elsewhere.chunks(imported.cache_id)), turns[1][1])


def test_caches_whose_state_is_not_per_token_stay_whole(tiny, long_ids, tiny_fp, tmp_path):
    snap = make_press("snapkv", {"ratio": 0.5, "window": 16})
    store = CacheStore(tmp_path / "store")
    m = put(store, prefill(tiny[0], long_ids[:300], snap).cache, tiny_fp, long_ids[:300], snap)
    assert m.encoding.block_rows == 0 and "evicted" in whole_entry_reason(m)


def test_8_bit_caches_go_by_blocks_too(tiny, long_ids, tiny_fp, tmp_path):
    press = make_press("quantize", {"kv_bits": 8})
    store = CacheStore(tmp_path / "store", max_bytes=None)
    turns = [
        (long_ids[:n], press.apply(prefill(tiny[0], long_ids[:n], step_size=BLOCK_SIZE).cache)) for n in (300, 420)
    ]
    stored = [put(store, cache, tiny_fp, tokens, press) for tokens, cache in turns]
    assert [m.encoding.block_rows for m in stored] == [BLOCK_SIZE] * 2
    whole = sum(e.file_bytes for e in store.entries())
    assert disk_bytes(store) < whole * 0.75  # the two blocks of the first turn are stored once
    for m, (_, cache) in zip(stored, turns, strict=True):
        assert same_tensors(decode_chunks(m, store.chunks(m.cache_id)), cache)


def test_eviction_passes_over_entries_whose_blocks_a_staying_entry_shares(turns, tiny, long_ids, tiny_fp, tmp_path):
    sizes = CacheStore(tmp_path / "probe", max_bytes=None)
    for tokens, cache in turns:
        put(sizes, cache, tiny_fp, tokens)
    conversation = disk_bytes(sizes)
    store = CacheStore(tmp_path / "store", max_bytes=int(conversation * 1.05))
    stored = [put(store, cache, tiny_fp, tokens) for tokens, cache in turns]
    # A newer, unrelated cache puts the store over its budget. Turns 1 to 4 free nothing while the
    # last turn shares their blocks: only the last turn's own file can go, and the four stay listed
    # (removing them first, as the oldest, would have emptied the store of the whole conversation).
    other = long_ids[::-1][:100]
    newest = put(store, prefill(tiny[0], other).cache, tiny_fp, other)
    listed = {e.cache_id for e in store.entries()}
    assert listed == {m.cache_id for m in stored[:-1]} | {newest.cache_id}
    assert disk_bytes(store) == store.total_bytes() <= store.max_bytes
    for m, (_, cache) in zip(stored[:-1], turns, strict=False):
        assert same_tensors(decode_chunks(m, store.chunks(m.cache_id)), cache)


def test_a_cache_whose_shared_blocks_outgrow_the_budget_is_refused_whole(turns, tiny_fp, tmp_path):
    store = CacheStore(tmp_path / "store", max_bytes=None)
    first = put(store, turns[0][1], tiny_fp, turns[0][0])
    small = CacheStore(tmp_path / "store", max_bytes=first.encoding.encoded_bytes + 40_000)
    with pytest.raises(StoreError, match="with the blocks it shares, more than the store's budget"):
        put(small, turns[1][1], tiny_fp, turns[1][0])
    assert [e.cache_id for e in small.entries()] == [first.cache_id]  # nothing half-written, nothing lost


def test_a_reader_keeps_the_blocks_an_eviction_unlinks_meanwhile(turns, tiny_fp, tmp_path):
    store = CacheStore(tmp_path / "store", max_bytes=None)
    first, second, third = (put(store, cache, tiny_fp, tokens) for tokens, cache in turns[:3])
    store.delete(first.cache_id)
    store.delete(second.cache_id)  # their files stay: the third turn shares their blocks
    records = store.chunk_records(third.cache_id)
    read = [next(records)]
    CacheStore(tmp_path / "store", max_bytes=None).delete(third.cache_id)  # another writer, meanwhile
    assert disk_bytes(store) == 0  # every file is unlinked, and yet:
    read += list(records)
    assert same_tensors(decode_chunks(third, map(parse_frame, read)), turns[2][1])
