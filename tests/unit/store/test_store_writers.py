"""Writers in several processes at once, as the daemon and commands share a store: eviction,
recovery and the index under real concurrency."""

import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.store import CacheStore
from kvmesh.store.index import Index
from support.stores import put

# Imports its files in a shuffled order, opening the store for each as a command does (recovery
# included); prints [file, id stored or the error] per import.
WRITER = textwrap.dedent(
    """
    import json, random, sys
    from kvmesh.errors import KvmeshError
    from kvmesh.store import CacheStore

    root, budget, seed, rounds, *files = sys.argv[1:]
    print("ready", flush=True)
    sys.stdin.readline()  # every writer starts at once
    rng = random.Random(int(seed))
    for _ in range(int(rounds)):
        rng.shuffle(files)
        for name in files:
            try:
                got = CacheStore(root, max_bytes=int(budget)).import_file(name).cache_id
            except KvmeshError as e:
                got = f"error: {e}"
            print(json.dumps([name, got]), flush=True)
    """
)


@pytest.fixture(scope="module")
def exported(tiny, tiny_fp, long_ids, tmp_path_factory):
    """Ten small caches as export files: {path: (cache id, entry bytes)}."""
    folder = tmp_path_factory.mktemp("exports")
    source = CacheStore(folder / "source", max_bytes=None)
    files = {}
    for n in range(20, 30):
        cache_id = put(source, prefill(tiny[0], long_ids[:n]).cache, tiny_fp, long_ids[:n]).cache_id
        files[str(source.export(cache_id, folder / f"{n}.kvc"))] = (cache_id, source.entry(cache_id).file_bytes)
    return files


def run_writers(root, budget, files, writers=3, rounds=8):
    """Start `writers` processes importing `files` into the store at `root` at the same moment;
    every [file, result] they printed."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(budget), str(seed), str(rounds), *files],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(writers)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * writers
    return [json.loads(line) for out in outputs for line in out.splitlines()]


@pytest.mark.slow
def test_writers_evicting_at_once_each_get_their_own_cache(exported, tmp_path):
    """Three processes fill a store that holds about three of ten caches, so nearly every write
    evicts while others do: each import returns its own id (before, about one in ten failed with
    "no cache <another id>" or "No such file or directory"), and the store ends within its budget
    with index and files agreeing."""
    sizes = sorted(size for _, size in exported.values())
    budget = sum(sizes[-3:])
    results = run_writers(tmp_path / "store", budget, list(exported))
    assert len(results) == 3 * 8 * len(exported)
    wrong = [(name, got) for name, got in results if got != exported[name][0]]
    assert wrong == [], f"{len(wrong)} of {len(results)} imports: {wrong[:3]}"

    store = CacheStore(tmp_path / "store", max_bytes=budget)
    assert 0 < store.total_bytes() <= budget
    on_disk = {p.stem for p in store.entries_dir.glob("*.kvc")}
    assert {e.cache_id for e in store.entries()} == on_disk
    assert list(store.incoming_dir.iterdir()) == []


def test_an_unreadable_index_another_writer_moved_aside_first_is_rebuilt(tiny, tiny_fp, long_ids, tmp_path, caplog):
    """Writers that find the index unreadable at once each move it aside: one that finds it gone
    already (another moved it first) goes on and rebuilds, where it used to crash on the rename."""
    root = tmp_path / "store"
    cache_id = put(CacheStore(root), prefill(tiny[0], long_ids[:24]).cache, tiny_fp, long_ids[:24]).cache_id
    index = Index(root)
    index.path.unlink()  # moved aside by another writer, after this one found it unreadable
    index._move_aside(sqlite3.DatabaseError("file is not a database"))
    index.open_writable()
    assert "is unreadable" in caplog.text
    assert [e.cache_id for e in CacheStore(root).entries()] == [cache_id]
