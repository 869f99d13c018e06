"""The store in the environment it finds: a read-only data directory, foreign files in entries/,
entries/ on another file system. Real directories, mounts and commands."""

import contextlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvmesh import paths
from kvmesh.caches.prefill import prefill
from kvmesh.store import CacheStore
from support.processes import ENV, cli
from support.stores import load, put

# Runs "$@" with the folder "$0" read-only: a read-only bind mount in a mount namespace of its own.
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'


@contextlib.contextmanager
def read_only(folder: Path):
    """The prefix under which commands see `folder` read-only. Root is not stopped by permissions,
    so it gets a read-only bind mount in a mount namespace of its own (`unshare -m`); anyone else
    gets the folder's write permissions taken away, and given back after."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if not p.is_symlink()}
        for p, mode in modes.items():
            p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield ()
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    prefix = ("unshare", "-m", "sh", "-c", READ_ONLY_MOUNT, str(folder))
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode:
        pytest.skip(f"root needs a read-only bind mount (unshare -m) here: {probe and probe.stderr.strip()}")
    yield prefix


@pytest.fixture
def small(tiny, long_ids):
    """small(n): (a cache of the first n tokens, those tokens)."""
    return lambda n=40: (prefill(tiny[0], long_ids[:n]).cache, long_ids[:n])


def put_small(store, small, fp, n=40) -> str:
    return put(store, *small(n)[:1], fp, small(n)[1]).cache_id


@pytest.mark.slow
@pytest.mark.parametrize("index", ["closed", "open", "lost"])
def test_a_read_only_data_dir_serves_reads_and_refuses_writes_in_one_line(tmp_path, small, tiny_fp, index):
    """Before, every command failed after a false "index unreadable ... rebuilding it".

    The index as a command leaves it (closed: no WAL beside it), as a running daemon holds it (its
    WAL open), or lost: a read-only store cannot rebuild it on disk, and indexes in memory.
    """
    source = CacheStore(tmp_path / "source")
    cache_id = put_small(source, small, tiny_fp)
    exported = source.export(cache_id, tmp_path / "c.kvc")
    data = tmp_path / "data"
    cli("cache", "import", exported, data_dir=data)
    store = CacheStore(paths.store_dir(data)) if index == "open" else None
    if index == "lost":
        (paths.store_dir(data) / "index.sqlite3").unlink()
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    with read_only(data) as prefix:
        listing = cli("cache", "list", data_dir=data, prefix=prefix, check=False)
        shown = cli("cache", "show", cache_id[:8], data_dir=data, prefix=prefix, check=False)
        verified = cli("cache", "verify", "--all", data_dir=data, prefix=prefix, check=False)
        imported = cli("cache", "import", exported, data_dir=data, prefix=prefix, check=False)
        deleted = cli("cache", "delete", cache_id, data_dir=data, prefix=prefix, check=False)
    assert listing.returncode == 0 and cache_id in listing.stdout, listing.stderr
    assert "rebuilding" not in listing.stderr
    assert shown.returncode == 0 and f"cache {cache_id}: 40 tokens" in shown.stdout, shown.stderr
    assert verified.returncode == 0 and f"{cache_id}  ok" in verified.stdout, verified.stderr
    refusal = f"kvmesh: error: the store at {paths.store_dir(data)} cannot be written ("
    for write in (imported, deleted):
        assert write.returncode == 1
        assert write.stderr.splitlines()[-1].startswith(refusal), write.stderr
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
    assert store is None or [e.cache_id for e in store.entries()] == [cache_id]


FOREIGN = ("loop", "directory", "fifo", "dangling", "stray")


def add_foreign_files(entries: Path) -> None:
    """One of each kind of FOREIGN in entries/, the first four named as entry files are."""
    loop, directory, fifo, dangling = (entries / f"{c * 32}.kvc" for c in "abcd")
    loop.symlink_to(loop.name)
    directory.mkdir()
    os.mkfifo(fifo)  # opening it would block the store forever
    dangling.symlink_to(entries / "nowhere.kvc")
    (entries / "notes.txt").write_text("a file a person left here")


def test_foreign_files_in_entries_are_skipped_with_one_warning_each(tmp_path, small, tiny_fp, caplog):
    """Before, one of them made every command and the daemon fail (or, a FIFO, hang)."""
    store = CacheStore(tmp_path / "store")
    kept = put_small(store, small, tiny_fp)
    add_foreign_files(store.entries_dir)
    with caplog.at_level(logging.WARNING, logger="kvmesh.store.cache_store"):
        reopened = CacheStore(store.root)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(FOREIGN), warnings
    assert all(w.startswith("skipping ") for w in warnings)
    assert [e.cache_id for e in reopened.entries()] == [kept]
    assert load(reopened, kept)[0].cache_id == kept
    # Writes and deletes work beside them, and they are left as they were.
    again = put_small(reopened, small, tiny_fp, 20)
    reopened.delete(again)
    assert len(list(store.entries_dir.iterdir())) == 1 + len(FOREIGN) + 1  # with the staging directory


@pytest.mark.slow
def test_a_daemon_and_commands_open_a_store_with_foreign_files(tmp_path, small, tiny_fp, daemons):
    data = tmp_path / "data"
    store = CacheStore(paths.store_dir(data))
    kept = put_small(store, small, tiny_fp)
    add_foreign_files(store.entries_dir)
    daemons.start(data)
    listing = cli("cache", "list", data_dir=data, check=False)
    assert listing.returncode == 0 and kept in listing.stdout, listing.stderr
    assert listing.stderr.count("skipping ") == len(FOREIGN), listing.stderr


def other_file_system(near: Path) -> Path | None:
    """A writable directory on another file system than `near` (tmpfs in /dev/shm, say), or None."""
    for candidate in ("/dev/shm", "/run/shm", tempfile.gettempdir(), f"/run/user/{os.getuid()}"):
        try:
            if os.stat(candidate).st_dev != os.stat(near).st_dev and os.access(candidate, os.W_OK):
                return Path(candidate)
        except OSError:
            continue
    return None


@pytest.fixture
def elsewhere(tmp_path):
    """A fresh directory on another file system than tmp_path, removed after the test."""
    base = other_file_system(tmp_path)
    if base is None:
        pytest.skip("no second writable file system here (/dev/shm, say) to put entries/ on")
    folder = Path(tempfile.mkdtemp(prefix="kvmesh-entries-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_entries_linked_to_another_file_system_are_written_there(tmp_path, elsewhere, small, tiny_fp):
    """Before, every write failed with "Invalid cross-device link" once its work was done."""
    root = tmp_path / "store"
    root.mkdir()
    (root / "entries").symlink_to(elsewhere)
    store = CacheStore(root)
    cache_id = put_small(store, small, tiny_fp)
    assert (elsewhere / f"{cache_id}.kvc").is_file()
    assert list(store.incoming_dir.iterdir()) == []
    exported = store.export(cache_id, tmp_path / "c.kvc")
    store.delete(cache_id)
    # The command, as a user runs it: an import into that store.
    done = cli("cache", "import", exported, "--store", root, data_dir=tmp_path / "data", check=False)
    assert done.returncode == 0, done.stderr
    assert [e.cache_id for e in CacheStore(root).entries()] == [cache_id]
    # A damaged entry still goes to quarantine, across the file systems.
    path = elsewhere / f"{cache_id}.kvc"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="damaged on disk"):
        load(CacheStore(root), cache_id)
    assert [p.name.split(".")[0] for p in (root / "quarantine").iterdir()] == [cache_id]


def low_descriptor_limit() -> tuple[str, ...]:
    """The prefix that runs a command under a hard descriptor limit of 1,024 that it cannot raise
    (root may raise one: setpriv takes that privilege away first)."""
    if not shutil.which("prlimit"):
        pytest.skip("needs prlimit (util-linux) to set a descriptor limit")
    limit = ("prlimit", "--nofile=1024:1024")
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root may raise any limit, and setpriv is not here to take that away")
        return ("setpriv", "--bounding-set=-sys_resource", *limit)
    return limit


# A model loaded through the library, as commands load it (kvmesh.model.loaded), then run: its
# load comes before anything else imports mlx-lm.
LOAD_AND_RUN = """
import resource, sys
from kvmesh.model.loaded import load_model

loaded = load_model(sys.argv[1])
from kvmesh.caches.prefill import prefill

prefilled = prefill(loaded.model, loaded.tokenizer.encode("a prompt of a few words"))
print(len(prefilled.cache), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
"""


@pytest.mark.slow
def test_a_model_loads_under_a_hard_descriptor_limit_below_4096(tiny_dir):
    """mlx-lm raises the limit to (2048, 4096) on import; before, under a lower hard limit, that
    was a ValueError and no model loaded."""
    done = subprocess.run(
        [*low_descriptor_limit(), sys.executable, "-c", LOAD_AND_RUN, str(tiny_dir)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    layers, hard = map(int, done.stdout.split())
    assert layers > 0 and hard == 1024


@pytest.mark.slow
def test_kvmesh_prefill_runs_under_a_hard_descriptor_limit_below_4096(tiny_dir, tmp_path):
    """Before, every model command ended in "unexpected ValueError: not allowed to raise maximum limit"."""
    done = cli(
        "prefill",
        tiny_dir,
        "--prompt",
        "a prompt of a few words",
        data_dir=tmp_path,
        prefix=low_descriptor_limit(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stored "), done.stdout
