"""The on-disk store: round trips, lookup, LRU, bad input, and crashes of a real writer process."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.errors import IntegrityError, NotFoundError, StoreError
from kvmesh.reuse.find import find_prefix, load_prefix
from kvmesh.store import CacheStore, entry_file
from kvmesh.v1 import cache_pb2 as pb
from support.references import same_tensors, tokens_after
from support.stores import load, put


@pytest.fixture(scope="module")
def fp(tiny_fp):
    return tiny_fp


@pytest.fixture(scope="module")
def dense500(tiny, long_ids):
    return prefill(tiny[0], long_ids[:500]).cache


@pytest.fixture
def store(tmp_path):
    return CacheStore(tmp_path / "store")


def put_dense500(store, dense500, fp, long_ids, **options):
    return put(store, dense500, fp, long_ids[:500], chunk_size=64 << 10, **options)


def entry_files(store):
    """What entries/ holds besides the store's own staging directory (.incoming)."""
    return [p for p in store.entries_dir.iterdir() if p != store.incoming_dir]


def test_put_load_and_survive_a_restart(store, dense500, fp, long_ids, tmp_path):
    manifest = put_dense500(store, dense500, fp, long_ids)
    assert manifest.encoding.payload_digest and len(manifest.cache_id) == 32
    reopened = CacheStore(tmp_path / "store")
    [entry] = reopened.entries()
    assert (entry.cache_id, entry.num_tokens, entry.method, entry.cuttable) == (
        manifest.cache_id,
        500,
        "full",
        True,
    )
    loaded_manifest, cache = load(reopened, manifest.cache_id)
    assert loaded_manifest == manifest
    assert same_tensors(cache, dense500)


def test_serving_reads_the_stored_chunks_without_recompressing(store, dense500, fp, long_ids):
    manifest = put_dense500(store, dense500, fp, long_ids)
    with open(store.entries_dir / f"{manifest.cache_id}.kvc", "rb") as f:
        on_disk = [c.data for c in entry_file.read_chunks(f, entry_file.read_manifest(f, "x"), "x")]
    assert [c.data for c in store.chunks(manifest.cache_id)] == on_disk


def test_lookup_finds_the_longest_prefix_across_entries(store, tiny, dense500, fp, long_ids):
    dense = put_dense500(store, dense500, fp, long_ids)
    snap = make_press("snapkv", {"ratio": 0.5, "window": 16})
    sparse = put(store, prefill(tiny[0], long_ids[:300], snap).cache, fp, long_ids[:300], snap)
    short = put(store, prefill(tiny[0], long_ids[:200]).cache, fp, long_ids[:200])
    junk = [7] * 100

    def best(prompt):
        match = store.lookup(fp.model_id, prompt)
        return match and (match.entry.cache_id, match.tokens)

    assert best(long_ids) == (dense.cache_id, 500)
    # The sparse entry serves only its exact 300; the dense 500 shares two 128-token blocks.
    assert best(long_ids[:300] + junk) == (sparse.cache_id, 300)
    # Three shared blocks of the dense 500 beat the exact 200.
    assert best(long_ids[:450] + junk) == (dense.cache_id, 384)
    assert best(long_ids[:250] + junk) == (short.cache_id, 200)
    assert best(junk) is None
    assert store.lookup("0123456789abcdef", long_ids) is None


@pytest.mark.parametrize("options", [{}, {"codec": "none"}, {"byte_shuffle": True}])
def test_a_dense_entry_serves_a_block_aligned_shorter_prefix_cut_as_read(store, tiny, dense500, fp, long_ids, options):
    manifest = put_dense500(store, dense500, fp, long_ids, **options)
    cache = load_prefix(store, manifest.cache_id, 384)
    fresh = prefill(tiny[0], long_ids[:384]).cache
    assert same_tensors(cache, fresh)
    suffix = long_ids[384:390]
    assert tokens_after(tiny[0], cache, suffix, 4) == tokens_after(tiny[0], fresh, suffix, 4)
    # Cut as it is read: the store holds only the original.
    assert [e.cache_id for e in store.entries()] == [manifest.cache_id]


def test_a_sparse_entry_serves_only_its_own_prefix(store, tiny, fp, long_ids):
    press = make_press("streaming_llm", {"budget": 64})
    manifest = put(store, prefill(tiny[0], long_ids[:300], press).cache, fp, long_ids[:300], press)
    with pytest.raises(ValueError, match="it serves only its exact prefix of 300 tokens: layer 0 evicted tokens"):
        load_prefix(store, manifest.cache_id, 256)
    # A prompt that shares its first two blocks finds nothing, and is told what was passed over.
    prompt = long_ids[:280] + [7] * 40
    assert store.lookup(fp.model_id, prompt) is None
    match, why = store.exact_only(fp.model_id, prompt)
    assert (match.entry.cache_id, match.tokens, why) == (manifest.cache_id, 256, "layer 0 evicted tokens")
    found = find_prefix(fp, prompt, store)
    assert found.cache is None and found.skipped == [
        f"local store: {manifest.cache_id} shares 256 tokens of the prompt but serves only its exact prefix of 300 "
        "(layer 0 evicted tokens)"
    ]
    assert store.exact_only(fp.model_id, long_ids[:300] + [7]) is None  # it serves that prompt


def test_lru_eviction_under_a_byte_budget(tmp_path, tiny, fp, long_ids):
    caches = {n: prefill(tiny[0], long_ids[:n]).cache for n in (100, 110, 120)}
    probe = CacheStore(tmp_path / "probe")
    sizes = {n: probe.entry(put(probe, c, fp, long_ids[:n]).cache_id).file_bytes for n, c in caches.items()}

    store = CacheStore(tmp_path / "store", max_bytes=sizes[100] + sizes[110] + sizes[120] - 1)
    first = put(store, caches[100], fp, long_ids[:100]).cache_id
    second = put(store, caches[110], fp, long_ids[:110]).cache_id
    load(store, first)  # now `second` is the least recently used
    third = put(store, caches[120], fp, long_ids[:120]).cache_id
    assert {e.cache_id for e in store.entries()} == {first, third}
    assert store.total_bytes() <= store.max_bytes
    assert not (store.entries_dir / f"{second}.kvc").exists()


def test_an_entry_larger_than_the_budget_is_refused(tmp_path, dense500, fp, long_ids):
    store = CacheStore(tmp_path / "store", max_bytes=1000)
    with pytest.raises(StoreError, match="more than the store's budget of 1,000"):
        put_dense500(store, dense500, fp, long_ids)
    assert store.entries() == [] and entry_files(store) == []


def corrupt(chunks, how):
    if how == "corrupt":
        data = bytearray(chunks[2].data)
        data[10] ^= 0xFF
        chunks[2].data = bytes(data)
    elif how == "truncated":
        del chunks[-1]
    elif how == "reordered":
        chunks[1], chunks[2] = chunks[2], chunks[1]
    elif how == "duplicated":
        chunks.insert(3, chunks[2])
    elif how == "oversized":
        chunks[0].data = bytes(chunks[0].data) + bytes(3 * chunks[0].raw_length)
    return chunks


@pytest.mark.parametrize("how", ["corrupt", "truncated", "reordered", "duplicated", "oversized", "digest"])
def test_bad_input_leaves_nothing_in_the_store(tmp_path, store, dense500, fp, long_ids, how):
    source = CacheStore(tmp_path / "source")
    manifest = put_dense500(source, dense500, fp, long_ids)
    chunks = corrupt(list(source.chunks(manifest.cache_id)), how)
    if how == "digest":
        manifest.encoding.payload_digest = bytes(16)
    with pytest.raises(IntegrityError):
        store.receive(manifest, chunks)
    assert store.entries() == []
    assert entry_files(store) == [] and list(store.incoming_dir.iterdir()) == []


def test_before_commit_runs_on_the_written_entry_and_its_failure_keeps_nothing(tmp_path, store, dense500, fp, long_ids):
    """What a fetch's decoder does (kvmesh.reuse.receive): its last layers decode while the store
    writes and syncs the entry; the entry is indexed only once they have, and not at all if they fail."""
    source = CacheStore(tmp_path / "source")
    manifest = put_dense500(source, dense500, fp, long_ids)
    seen = []

    def staged():  # every chunk is on disk, under a staging name, and nothing is indexed yet
        [staging] = list(store.incoming_dir.iterdir())
        seen.append((staging.stat().st_size, store.entries()))

    kept = store.add(manifest, list(source.chunks(manifest.cache_id)), before_commit=staged)
    [(size, entries)] = seen
    assert entries == [] and size == store.layout.path(kept.cache_id).stat().st_size
    assert [e.cache_id for e in store.entries()] == [manifest.cache_id]
    assert same_tensors(load(store, manifest.cache_id)[1], dense500)

    other = CacheStore(tmp_path / "other")

    def undecodable():
        raise IntegrityError("a transform-coded layer does not decode")

    with pytest.raises(IntegrityError, match="does not decode"):
        other.add(manifest, list(source.chunks(manifest.cache_id)), before_commit=undecodable)
    assert other.entries() == [] and entry_files(other) == [] and list(other.incoming_dir.iterdir()) == []


def test_a_malformed_manifest_is_refused_before_any_chunk(store, tmp_path, dense500, fp, long_ids):
    manifest = put_dense500(CacheStore(tmp_path / "source"), dense500, fp, long_ids)
    manifest.layers[0].tensors[0].shape[0] = 10**12

    def never():
        raise AssertionError("no chunk may be read for a malformed manifest")
        yield

    with pytest.raises(IntegrityError, match="malformed manifest"):
        store.receive(manifest, never())


def test_damage_on_disk_is_detected_when_read(store, dense500, fp, long_ids):
    manifest = put_dense500(store, dense500, fp, long_ids)
    path = store.entries_dir / f"{manifest.cache_id}.kvc"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="chunk 0 is damaged on disk"):
        load(store, manifest.cache_id)


def test_export_then_import_elsewhere(store, tmp_path, tiny, fp, long_ids):
    press = make_press("knorm", {"ratio": 0.5, "kv_bits": 4})
    cache = prefill(tiny[0], long_ids[:300], press).cache
    manifest = put(store, cache, fp, long_ids[:300], press)
    exported = store.export(manifest.cache_id, tmp_path / "cache.kvc")
    other = CacheStore(tmp_path / "other")
    assert other.import_file(exported).cache_id == manifest.cache_id
    assert same_tensors(load(other, manifest.cache_id)[1], cache)


def test_files_of_kvmesh_0_2_are_read(store, tmp_path, dense500, fp, long_ids):
    """Entry files of 0.2 hold protobuf Chunk records: in a store, and imported, they serve as before."""
    source = CacheStore(tmp_path / "source")
    manifest = put_dense500(source, dense500, fp, long_ids, codec="zstd")
    old = tmp_path / "old.kvc"
    with open(old, "wb") as f:
        f.write(entry_file.MAGIC_V1)
        for c in source.chunks(manifest.cache_id):
            record = pb.Chunk(
                index=c.index,
                tensor=c.tensor,
                byte_offset=c.byte_offset,
                raw_length=c.raw_length,
                checksum=c.checksum,
                data=bytes(c.data),
            )
            entry_file.write_record(f, record.SerializeToString())
        entry_file.write_footer(f, manifest)
    assert store.import_file(old).cache_id == manifest.cache_id
    assert same_tensors(load(store, manifest.cache_id)[1], dense500)
    # Left in place by an upgrade: served from the file as it is, and exported in the new format.
    (store.entries_dir / f"{manifest.cache_id}.kvc").write_bytes(old.read_bytes())
    assert same_tensors(load(store, manifest.cache_id)[1], dense500)
    exported = store.export(manifest.cache_id, tmp_path / "new.kvc")
    assert exported.read_bytes().startswith(entry_file.MAGIC)


@pytest.mark.parametrize("damage", ["truncated", "not-kvmesh"])
def test_importing_a_bad_file_leaves_nothing(store, tmp_path, dense500, fp, long_ids, damage):
    source = CacheStore(tmp_path / "source")
    exported = source.export(put_dense500(source, dense500, fp, long_ids).cache_id, tmp_path / "c.kvc")
    data = exported.read_bytes()
    exported.write_bytes(data[: len(data) // 2] + data[-200:] if damage == "truncated" else b"hello" * 100)
    with pytest.raises(IntegrityError):
        store.import_file(exported)
    assert store.entries() == [] and list(store.incoming_dir.iterdir()) == []


def test_a_manifest_is_read_once_per_entry_file_and_again_when_the_file_changes(store, dense500, fp, long_ids):
    """A daemon reads a cache's manifest for each open and for its records: once read and checked, the
    same file (inode, size, time) is not read again; a file changed in place is, and damage found."""
    manifest = put_dense500(store, dense500, fp, long_ids)
    path = store.entries_dir / f"{manifest.cache_id}.kvc"
    assert store.manifest(manifest.cache_id) == manifest
    data = path.read_bytes()
    before = path.stat()
    damaged = data[:-20] + bytes(20)  # (the footer's checksum and magic zeroed: unreadable)
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(damaged)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert store.manifest(manifest.cache_id) == manifest  # the file's identity is the one read: not read again
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    with pytest.raises(IntegrityError, match="truncated or corrupt"):
        store.manifest(manifest.cache_id)
    assert not path.exists() and list(store.quarantine_dir.iterdir())


def test_ids_never_become_paths(store):
    for bad in ("../../etc/passwd", "a" * 31, "A" * 32, "g" * 32):
        with pytest.raises(NotFoundError):
            store.manifest(bad)


def test_recovery_removes_orphans_and_dangling_rows(store, tmp_path, dense500, fp, long_ids):
    kept = put_dense500(store, dense500, fp, long_ids)
    (store.incoming_dir / "deadbeef.part").write_bytes(b"half a cache")
    orphan = store.entries_dir / ("ab" * 16 + ".kvc")
    orphan.write_bytes(b"renamed but never indexed")
    other = put_dense500(CacheStore(tmp_path / "other"), dense500, fp, long_ids, codec="none")
    # An indexed entry whose file is gone (deleted by hand, or lost with a disk).
    store.receive(other, CacheStore(tmp_path / "other").chunks(other.cache_id))
    (store.entries_dir / f"{other.cache_id}.kvc").unlink()

    reopened = CacheStore(store.root)
    assert [e.cache_id for e in reopened.entries()] == [kept.cache_id]
    assert list(reopened.incoming_dir.iterdir()) == [] and not orphan.exists()


def test_a_row_the_index_lost_comes_back_when_the_store_opens(store, dense500, fp, long_ids):
    """The index's commits are not synced (a power cut may lose the last ones): an entry whose row is
    lost, its file synced and in place, is indexed again at the next open and found as before."""
    kept = put_dense500(store, dense500, fp, long_ids)
    assert store.index.connection().execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: not synced
    with store.index.write() as db:  # (what a power cut after its commit, before any sync, loses)
        rows = (("entries", "cache_id"), ("blocks", "cache_id"), ("segments", "cache_id"), ("pieces", "segment"))
        for table, column in rows:
            db.execute(f"DELETE FROM {table} WHERE {column} = ?", (kept.cache_id,))
    assert store.entries() == []

    reopened = CacheStore(store.root)
    assert [e.cache_id for e in reopened.entries()] == [kept.cache_id]
    assert reopened.lookup(fp.model_id, long_ids[:500]).entry.cache_id == kept.cache_id


WRITER = textwrap.dedent(
    """
    import sys
    from kvmesh.store import CacheStore, entry_file

    store = CacheStore(sys.argv[1])
    with open(sys.argv[2], "rb") as f:
        manifest = entry_file.read_manifest(f, "export")

        def chunks():
            for i, chunk in enumerate(entry_file.read_chunks(f, manifest, "export")):
                if i == 3:
                    print("ready", flush=True)
                    sys.stdin.read()  # hold the half-written entry until killed
                yield chunk

        store.receive(manifest, chunks())
    """
)


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_the_store_consistent(store, tmp_path, tiny, dense500, fp, long_ids):
    kept = put(store, prefill(tiny[0], long_ids[:200]).cache, fp, long_ids[:200])
    source = CacheStore(tmp_path / "source")
    exported = source.export(put_dense500(source, dense500, fp, long_ids).cache_id, tmp_path / "c.kvc")

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store.root), str(exported)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        assert len(list(store.incoming_dir.iterdir())) == 1  # the half-written entry
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait()
    assert writer.returncode == -signal.SIGKILL

    reopened = CacheStore(store.root)
    assert [e.cache_id for e in reopened.entries()] == [kept.cache_id]
    assert list(reopened.incoming_dir.iterdir()) == []
    assert load(reopened, kept.cache_id)[0].cache_id == kept.cache_id


FULL_DISK_WRITER = textwrap.dedent(
    """
    import resource, signal, sys
    from kvmesh.errors import StoreError
    from kvmesh.store import CacheStore

    store = CacheStore(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    try:
        store.import_file(sys.argv[2])
    except StoreError as e:
        print(e)
        sys.exit(3)
    """
)


@pytest.mark.slow
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(store, tmp_path, dense500, fp, long_ids):
    source = CacheStore(tmp_path / "source")
    exported = source.export(put_dense500(source, dense500, fp, long_ids).cache_id, tmp_path / "c.kvc")
    assert exported.stat().st_size > 200_000
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK_WRITER, str(store.root), str(exported)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith(f"cannot write to the store at {store.root}: File too large")
    assert store.entries() == [] and list(store.incoming_dir.iterdir()) == []


@pytest.mark.slow
def test_opening_the_store_leaves_a_live_writers_file_alone(store, tmp_path, dense500, fp, long_ids):
    """The CLI opens the store while the daemon writes to it: recovery must not take that write."""
    source = CacheStore(tmp_path / "source")
    exported = source.export(put_dense500(source, dense500, fp, long_ids).cache_id, tmp_path / "c.kvc")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store.root), str(exported)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        [in_progress] = list(store.incoming_dir.iterdir())
        CacheStore(store.root)  # a second opener runs recovery now
        assert in_progress.exists()
        writer.stdin.close()  # let the writer finish
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert [e.num_tokens for e in CacheStore(store.root).entries()] == [500]


def test_a_unique_start_of_an_id_names_its_cache(store, tiny, fp, long_ids):
    # 17 caches: two of them share a first hex digit.
    ids = [put(store, prefill(tiny[0], long_ids[:n]).cache, fp, long_ids[:n]).cache_id for n in range(20, 37)]
    for cache_id in ids:
        shortest = next(cache_id[:k] for k in range(1, 33) if sum(i.startswith(cache_id[:k]) for i in ids) == 1)
        assert store.resolve(shortest) == store.resolve(shortest.upper()) == store.resolve(cache_id) == cache_id
    shared = next(c for c in "0123456789abcdef" if sum(i.startswith(c) for i in ids) >= 2)
    count = sum(i.startswith(shared) for i in ids)
    with pytest.raises(NotFoundError, match=rf"^{shared} names {count} caches \(.*\): give more of the id$"):
        store.resolve(shared)
    unused = next(
        a + b for a in "0123456789abcdef" for b in "0123456789abcdef" if not any(i.startswith(a + b) for i in ids)
    )
    with pytest.raises(NotFoundError, match=rf"^no cache {unused} in the store"):
        store.resolve(unused)
    for bad in ("", "../x", "0" * 33):
        with pytest.raises(NotFoundError, match="ids are hex digits"):
            store.resolve(bad)
