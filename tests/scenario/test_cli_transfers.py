"""`kvmesh publish` and `kvmesh fetch` as a user runs them: a cache of the local store given to a real
daemon; a fetch of what the store already holds."""

import json
import re

import pytest

from kvmesh.store import CacheStore
from support.daemons import loopback_daemon
from support.processes import cli

pytestmark = pytest.mark.slow


@pytest.fixture
def stored(tiny_dir, tmp_path):
    """(store dir, cache id) of a cache `kvmesh prefill` made."""
    local = tmp_path / "local"
    made = cli("prefill", tiny_dir, "--prompt", "The river runs to the sea. " * 20, "--store", local, "--json")
    return local, json.loads(made.stdout)["cache_id"]


def test_publish_gives_the_cache_to_the_peer_byte_for_byte(stored, tmp_path):
    local, cache_id = stored
    daemon = loopback_daemon(tmp_path / "peer.data", "--store", tmp_path / "peer")
    try:
        result = cli("publish", cache_id, daemon.address, "--store", local, data_dir=tmp_path / "me", check=False)
        assert result.returncode == 0, result.stderr
        out = result.stdout
    finally:
        daemon.stop()
    assert out.startswith(f"published {cache_id} to {daemon.address} (") and out.endswith(
        f"stored there as {cache_id}\n"
    )
    theirs, ours = CacheStore(tmp_path / "peer"), CacheStore(local)
    theirs.verify(cache_id)
    assert theirs.manifest(cache_id) == ours.manifest(cache_id)
    assert list(theirs.chunk_records(cache_id)) == list(ours.chunk_records(cache_id))


def test_publishing_a_cache_the_peer_holds_sends_nothing(stored, tmp_path):
    local, cache_id = stored
    daemon = loopback_daemon(tmp_path / "peer.data", "--store", tmp_path / "peer")
    try:
        publish = ["publish", cache_id, daemon.address, "--store", local]
        first = cli(*publish, data_dir=tmp_path / "me").stdout
        entry = next((tmp_path / "peer").rglob(f"{cache_id}*"))
        written = entry.stat().st_mtime_ns
        second = cli(*publish, data_dir=tmp_path / "me").stdout
        transfers = json.loads(cli("status", "--json", data_dir=tmp_path / "peer.data").stdout)["info"]["transfers"]
    finally:
        daemon.stop()
    assert first.startswith(f"published {cache_id} to {daemon.address} (")
    assert second == f"{daemon.address} holds {cache_id} already: nothing sent\n"
    assert (transfers["publishes_accepted"], transfers["publishes_rejected"]) == (1, 0)
    assert entry.stat().st_mtime_ns == written  # not written again


def test_a_read_only_peer_refuses_in_one_line_and_stores_nothing(stored, tmp_path):
    local, cache_id = stored
    daemon = loopback_daemon(tmp_path / "peer.data", "--store", tmp_path / "peer", "--read-only")
    try:
        result = cli("publish", cache_id, daemon.address, "--store", local, data_dir=tmp_path / "me", check=False)
    finally:
        daemon.stop()
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("kvmesh: error: ") and "does not accept publishes" in result.stderr
    assert result.stderr.count("\n") == 1
    assert CacheStore(tmp_path / "peer").entries() == []


def test_an_unknown_cache_is_a_clear_error_before_dialling(tmp_path):
    result = cli("publish", "0" * 32, "127.0.0.1:9", "--store", tmp_path / "empty", check=False)
    assert result.returncode == 1 and result.stderr.startswith("kvmesh: error: ") and "0" * 32 in result.stderr


def test_fetching_a_cache_the_store_holds_says_so_and_dials_no_one(stored, tiny_dir):
    local, cache_id = stored
    # Port 9 (discard) has no listener here: a dial would fail.
    result = cli("fetch", cache_id, "--peer", "127.0.0.1:9", "--model", tiny_dir, "--store", local)
    assert (
        result.stdout.startswith(f"{cache_id} is already in the local store (") and "nothing fetched" in result.stdout
    )


def test_commands_take_a_unique_start_of_a_cache_id(stored, tmp_path):
    local, cache_id = stored
    shown = cli("cache", "show", cache_id[:8], "--store", local).stdout
    assert shown.startswith(f"cache {cache_id}: ")
    out = cli("cache", "export", cache_id[:6], tmp_path / "c.kvmesh", "--store", local).stdout
    assert out == f"exported {cache_id} to {tmp_path / 'c.kvmesh'}\n"


def test_an_mlx_file_exported_from_a_plain_prefill_imports_with_plain(stored, tiny_dir, tmp_path):
    local, cache_id = stored
    file = tmp_path / "p.safetensors"
    cli("cache", "export-mlx", cache_id, file, "--model", tiny_dir, "--store", local)
    prompt = "The river runs to the sea. " * 20  # what the `stored` fixture prefilled, without --chat
    other = ["--store", tmp_path / "other"]
    refused = cli("cache", "import-mlx", file, "--model", tiny_dir, "--prompt", prompt, *other, check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    held = re.search(r"the cache holds (\d+) tokens", refused.stderr)
    assert held and refused.stderr.endswith(f"; add --plain: that prompt gives {held[1]}\n")
    imported = cli("cache", "import-mlx", file, "--model", tiny_dir, "--prompt", prompt, "--plain", *other).stdout
    assert imported.startswith(f"imported {cache_id} (")


def test_status_shows_the_budget_the_uptime_and_what_was_sent_with_numbers_in_json(tmp_path):
    daemon = loopback_daemon(tmp_path / "d", "--store", tmp_path / "s", "--store-budget", "2000000")
    try:
        shown = cli("status", data_dir=tmp_path / "d").stdout
        status = json.loads(cli("status", "--json", data_dir=tmp_path / "d").stdout)
    finally:
        daemon.stop()
    assert ", up " in shown.splitlines()[0]
    assert "store: 0 caches, 0 bytes of a 2,000,000-byte budget (0%)" in shown
    assert "0 bytes of caches sent to peers" in shown
    store, transfers = status["info"]["store"], status["info"]["transfers"]
    assert store == {"entries": 0, "bytes": 0, "budget_bytes": 2000000}
    assert transfers["fetches_rejected"] == 0 and transfers["chunk_bytes_sent"] == 0
    assert isinstance(status["uptime_s"], int) and status["uptime_s"] >= 0


def test_status_and_peers_name_a_peer_alike_in_json(daemons, tmp_path):
    first = daemons.start(tmp_path / "a")
    daemons.start(tmp_path / "b", "--peer", first.address)
    status = json.loads(cli("status", "--json", data_dir=tmp_path / "b").stdout)
    listed = json.loads(cli("peers", "--all", "--json", data_dir=tmp_path / "b").stdout)
    [peer], [same] = status["peers"], listed
    assert peer.keys() == same.keys() and "source" not in peer
    assert (peer["found_by"], peer["address"]) == (same["found_by"], same["address"]) == ("static", first.address)


def test_cache_show_json_gives_hashes_in_hex_and_numbers_as_numbers(stored, tiny_dir):
    local, cache_id = stored
    shown = json.loads(cli("cache", "show", cache_id, "--json", "--store", local).stdout)
    info = json.loads(cli("model", "info", tiny_dir, "--json").stdout)
    model, prefix, encoding = shown["model"], shown["prefix"], shown["encoding"]
    assert model["weights_sha256"] == info["weights_sha256"] and model["config_sha256"] == info["config_sha256"]
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in [prefix["sha256"], *prefix["block_hashes"]])
    assert len(prefix["block_hashes"]) == prefix["num_tokens"] // prefix["block_size"] >= 1
    assert isinstance(prefix["num_tokens"], int) and isinstance(encoding["raw_bytes"], int)
    assert encoding["raw_bytes"] == CacheStore(local).manifest(cache_id).encoding.raw_bytes


def test_fetch_takes_a_unique_start_of_a_peers_cache_id_and_lists_those_an_ambiguous_one_names(
    tiny, tiny_fp, tiny_dir, daemons, tmp_path
):
    from collections import defaultdict

    from kvmesh.caches.prefill import prefill
    from support.stores import put

    theirs = CacheStore(tmp_path / "peer")
    # 17 caches: two of them at least start with the same hex digit.
    ids = [put(theirs, prefill(tiny[0], [1, 2, n]).cache, tiny_fp, [1, 2, n]).cache_id for n in range(3, 20)]
    by_digit = defaultdict(list)
    for cache_id in ids:
        by_digit[cache_id[0]].append(cache_id)
    digit, named = max(by_digit.items(), key=lambda item: len(item[1]))
    wanted = ids[0]
    start = next(wanted[:n] for n in range(1, 33) if sum(i.startswith(wanted[:n]) for i in ids) == 1)
    peer = daemons.start(tmp_path / "peer.data", "--store", tmp_path / "peer")
    mine = ["--peer", peer.address, "--model", tiny_dir, "--store", tmp_path / "mine"]
    ambiguous = cli("fetch", digit, *mine, data_dir=tmp_path / "me", check=False)
    assert ambiguous.returncode == 1 and ambiguous.stderr.count("\n") == 1, ambiguous.stderr
    assert f"{digit} names {len(named)} caches (" in ambiguous.stderr and "give more of the id" in ambiguous.stderr
    assert all(cache_id in ambiguous.stderr for cache_id in sorted(named)[:4])
    assert CacheStore(tmp_path / "mine").entries() == []
    fetched = cli("fetch", start, *mine, data_dir=tmp_path / "me")
    assert fetched.stdout.startswith(f"fetched {wanted} from {peer.address}: 3 tokens")
    assert [e.cache_id for e in CacheStore(tmp_path / "mine").entries()] == [wanted]


def test_a_start_of_an_unshared_models_cache_id_finds_nothing_and_names_no_id(stored, tiny_dir, tmp_path):
    local, cache_id = stored
    daemon = loopback_daemon(tmp_path / "peer.data", "--store", local, "--share-model", "0" * 16)
    try:
        mine = ["--peer", daemon.address, "--model", tiny_dir, "--store", tmp_path / "mine"]
        result = cli("fetch", cache_id[:6], *mine, data_dir=tmp_path / "me", check=False)
    finally:
        daemon.stop()
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"no cache {cache_id[:6]} in the store" in result.stderr and cache_id not in result.stderr
