"""One budget for every writer of a store: the daemon's, whichever flag, variable or file set it; and
the daemon brings its store back within it when another writer kept to another."""

import json

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.store import CacheStore
from support.daemons import loopback_daemon
from support.processes import cli
from support.stores import put

pytestmark = pytest.mark.slow

BUDGET = 2_000_000


def stored_bytes(store: CacheStore) -> int:
    return sum(e.file_bytes for e in store.entries())


def test_cli_writers_keep_to_the_budget_the_daemon_runs_with(tiny_dir, tmp_path):
    data = tmp_path / "d"
    # The config file says "no limit"; the daemon's flag says 2 MB: the flag is what runs.
    config = tmp_path / "config.toml"
    config.write_text("store_budget = 0\n")
    daemon = loopback_daemon(data, "--config", config, "--store-budget", str(BUDGET))
    try:
        made = []
        for i in range(5):
            out = cli("prefill", tiny_dir, "--prompt", f"Note {i}: the tide was high. " * 30, "--json", data_dir=data)
            made.append(json.loads(out.stdout)["cache_id"])
        store = CacheStore(daemon.state.store)
        kept = [e.cache_id for e in store.entries()]
        assert stored_bytes(store) <= BUDGET
        # Least recently used first: what is left is the newest ones.
        assert 1 <= len(kept) < 5 and set(kept) == set(made[-len(kept) :])
    finally:
        daemon.stop()


def test_the_daemon_brings_its_store_back_within_budget(tiny, tiny_fp, prompt_ids, tmp_path):
    import time

    data = tmp_path / "d"
    daemon = loopback_daemon(data, "--store-budget", str(BUDGET), "--budget-interval", "0.2")
    try:
        # A writer that keeps to no budget at all (a library user): the store goes past the daemon's.
        unlimited = CacheStore(daemon.state.store, max_bytes=None)
        model = tiny[0]
        for i in range(4):
            tokens = prompt_ids[i * 10 :] + prompt_ids[: i * 10]
            put(unlimited, prefill(model, tokens).cache, tiny_fp, tokens)
        assert stored_bytes(unlimited) > BUDGET
        deadline = time.monotonic() + 30
        while stored_bytes(unlimited) > BUDGET:  # the daemon's next check evicts; nothing to wait on here
            assert time.monotonic() < deadline, "the daemon never brought the store back within its budget"
            time.sleep(0.1)
    finally:
        daemon.stop()
    assert "evicted cache" in daemon.log.read_text()
