"""A daemon left running for months: frozen peers, budgets, full disks, damaged stores, two instances,
and every CLI mistake a one-line error. Real daemons, real files, real signals; a test of what a
peer answers serves its store in process (the real gRPC server: support.grpc_peers)."""

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.caches.prefill import prefill
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.daemon.control import control_status
from kvmesh.errors import CacheRejected, IntegrityError, KvmeshError, NotFoundError, PeerError
from kvmesh.net.client import PeerClient
from kvmesh.net.flow import watch_interval
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.generate import generate
from kvmesh.store import CacheStore
from kvmesh.store.cache_store import INDEX
from support.daemons import loopback_daemon
from support.processes import cli
from support.references import greedy_tokens
from support.stores import put
from support.waiting import wait_for


@pytest.fixture(scope="module")
def long_prompt(long_ids):
    """2,000 tokens (8 MB of float32 KV in the tiny model, 500 chunks of 16 KiB): far more than a
    transfer has in flight when the first chunk arrives."""
    return (long_ids * 2)[:2000]


@pytest.fixture(scope="module")
def long_cache(tiny, long_prompt):
    return prefill(tiny[0], long_prompt[:-8]).cache


# A peer that freezes mid-transfer (SIGSTOP: a Mac that went to sleep)


def test_a_frozen_sender_costs_a_fetch_the_idle_timeout_and_generate_prefills_instead(
    tiny, tiny_fp, long_prompt, long_cache, serve, tmp_path
):
    served = tmp_path / "a"
    put(CacheStore(served), long_cache, tiny_fp, long_prompt[:-8], codec="none", chunk_size=16 << 10)
    address = serve(served)
    sender = serve.processes[address]
    stopped = threading.Event()

    def freeze_sender(received, total):
        if not stopped.is_set():
            os.kill(sender.pid, signal.SIGSTOP)
            stopped.set()

    store = CacheStore(tmp_path / "b")
    idle = 2.0
    try:
        result = generate(
            tiny[0],
            tiny_fp,
            long_prompt,
            store,
            peers=[address],
            max_tokens=6,
            progress=freeze_sender,
            idle_timeout=idle,
        )
    finally:
        os.kill(sender.pid, signal.SIGCONT)
    assert stopped.is_set()
    assert result.prefix.where == "none" and "sent nothing for 2 s" in result.prefix.skipped[0]
    assert result.tokens == greedy_tokens(tiny[0], long_prompt, 6)
    assert store.entries() == [] and list(store.incoming_dir.iterdir()) == []
    # Woken up, the sender serves again, and a fetch through it completes.
    with PeerClient(address) as client:
        assert client.info().transfers.fetches_failed >= 1
        start = time.monotonic()
        again = fetch_cache(
            client, CacheStore(served).entries()[0].cache_id, ReceiverProfile(tiny_fp, prompt=long_prompt)
        )
        whole_fetch = time.monotonic() - start
    assert again.manifest.prefix.num_tokens == len(long_prompt) - 8
    # The frozen peer cost the idle timeout, then the prompt was prefilled here: no more than the
    # timeout, the watch's look after it and what this machine takes for a whole fetch of it, thrice
    # (its first chunk came).
    held = result.prefix.seconds
    bound = idle + watch_interval(idle) + 3 * whole_fetch
    assert idle <= held < bound, f"the frozen peer held generate for {held:.2f} s (bound {bound:.2f} s)"


def test_a_frozen_peer_is_marked_lost_and_back_by_the_daemon_that_watches_it(serve, tmp_path):
    a = serve(tmp_path / "a")
    watcher = loopback_daemon(tmp_path / "b", "--peer", a, "--health-interval", "0.5")

    def health():
        return [p.healthy for p in control_status(tmp_path / "b").peers]

    try:
        wait_for(lambda: health() == [True], seconds=20, every=0.1, what="the peer to be healthy")
        os.kill(serve.processes[a].pid, signal.SIGSTOP)
        try:
            wait_for(lambda: health() == [False], seconds=20, every=0.1, what="the frozen peer to be lost")
        finally:
            os.kill(serve.processes[a].pid, signal.SIGCONT)
        wait_for(lambda: health() == [True], seconds=20, every=0.1, what="the woken peer to be back")
    finally:
        watcher.stop()


# The store budget


@pytest.mark.slow
def test_every_writer_keeps_the_store_within_its_budget_evicting_the_least_recently_used(
    tiny, tiny_dir, tiny_fp, long_ids, grpc_peers, tmp_path, caplog
):
    probe = CacheStore(tmp_path / "probe", max_bytes=None)
    made = {
        n: put(probe, prefill(tiny[0], long_ids[:n]).cache, tiny_fp, long_ids[:n]).cache_id
        for n in (100, 110, 120, 130)
    }
    size = {n: probe.entry(cache_id).file_bytes for n, cache_id in made.items()}
    budget = size[100] + size[120] + size[130] + 100  # any three of these fit, never four
    data = tmp_path / "node"
    store_dir = data / "store"

    def kvmesh(*args):
        return cli(*args, data_dir=data, env={"KVMESH_STORE_BUDGET": str(budget)})

    def stored() -> CacheStore:
        return CacheStore(store_dir, max_bytes=budget)

    # `cache import` (a CLI writer): the fourth import evicts the least recently used.
    for n in (100, 110, 120):
        kvmesh("cache", "import", probe.export(made[n], tmp_path / f"{n}.kvc"))
    stored().touch(made[100])  # used now: 110 is the least recently used
    kvmesh("cache", "import", probe.export(made[130], tmp_path / "130.kvc"))
    assert {e.cache_id for e in stored().entries()} == {made[100], made[120], made[130]}
    assert stored().total_bytes() <= budget

    # A peer with that budget: a publish larger than the whole budget is refused before any chunk
    # with a typed reason; one that fits evicts the least recently used (120 now).
    caplog.set_level(logging.INFO, logger="kvmesh.store")
    address = grpc_peers.start(store_dir, store_budget=budget).address
    big = CacheStore(tmp_path / "big", max_bytes=None)
    big_id = put(big, prefill(tiny[0], long_ids[:800]).cache, tiny_fp, long_ids[:800]).cache_id
    with PeerClient(address) as client:
        with pytest.raises(CacheRejected) as refused:
            client.publish(big, big_id)
        assert refused.value.rejection.reason_name == "size_limit" and "budget" in str(refused.value)
        assert client.publish(probe, made[110]) == made[110]
        assert client.info().store.bytes <= budget
    assert made[120] not in {e.cache_id for e in stored().entries()}
    assert f"evicted cache {made[120]}" in caplog.text

    # `prefill` and `fetch` (CLI writers, beside the running daemon) keep to it too.
    doc = tmp_path / "doc.txt"
    doc.write_text("Rivers run to the sea. " * 30)
    kvmesh("prefill", tiny_dir, "--file", doc, "--store", store_dir)
    assert stored().total_bytes() <= budget
    source = grpc_peers.start(tmp_path / "source").address
    with PeerClient(source) as client:
        assert client.publish(probe, made[120]) == made[120]
    kvmesh("fetch", made[120], "--peer", source, "--model", tiny_dir, "--store", store_dir)
    assert made[120] in {e.cache_id for e in stored().entries()} and stored().total_bytes() <= budget


# A full disk


@pytest.fixture
def tiny_disk(tmp_path):
    """A 6 MB tmpfs (root only), unmounted at the end."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Fill the disk to the last byte with one file."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return filler


@pytest.mark.slow
def test_a_full_disk_keeps_reads_working_refuses_writes_in_one_line_and_recovers(
    tiny, tiny_dir, tiny_fp, prompt_ids, grpc_peers, tiny_disk, tmp_path
):
    store_dir = tiny_disk / "store"  # without a budget: the disk is the limit here
    no_budget = {"KVMESH_STORE_BUDGET": "0"}
    stored = put(CacheStore(store_dir, max_bytes=None), prefill(tiny[0], prompt_ids).cache, tiny_fp, prompt_ids)
    address = grpc_peers.start(store_dir, store_budget=0).address
    filler = fill(tiny_disk)
    assert shutil.disk_usage(tiny_disk).free < 64 << 10

    # Reads: lookup and fetch from the full store.
    with PeerClient(address) as client:
        assert client.lookup(tiny_fp.model_id, prompt_ids)[0].candidate.cache_id == stored.cache_id
        fetched = fetch_cache(
            client, stored.cache_id, ReceiverProfile(tiny_fp, prompt=prompt_ids), store=CacheStore(tmp_path / "b")
        )
    assert fetched.manifest.cache_id == stored.cache_id
    # Writes: a prefill is refused before the work, in one line; a publish is refused, the peer serves on.
    doc = tmp_path / "doc.txt"
    doc.write_text("Rivers run to the sea. " * 30)
    refused = cli("prefill", tiny_dir, "--file", doc, "--store", store_dir, check=False, env=no_budget)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("kvmesh: error: not prefilling: the disk holding the store")
    other = CacheStore(tmp_path / "other")
    other_id = put(other, prefill(tiny[0], prompt_ids[:200]).cache, tiny_fp, prompt_ids[:200]).cache_id
    with PeerClient(address) as client:
        with pytest.raises((CacheRejected, PeerError)):
            client.publish(other, other_id)
        assert client.info().store.entries == 1

    # Space returns: the same peer takes writes again; nothing was lost.
    filler.unlink()
    with PeerClient(address) as client:
        assert client.publish(other, other_id) == other_id
        assert client.info().store.entries == 2
    assert cli("prefill", tiny_dir, "--file", doc, "--store", store_dir, env=no_budget).returncode == 0
    assert stored.cache_id in {e.cache_id for e in CacheStore(store_dir, max_bytes=None).entries()}


# Damaged and misplaced entries


def damage(store: CacheStore, cache_id: str, how: str, other_id: str) -> None:
    path = store.entries_dir / f"{cache_id}.kvc"
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[200] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # misplaced: another entry's file under this name (as a sync tool might restore it)
        shutil.copyfile(store.entries_dir / f"{other_id}.kvc", path)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flipped", "truncated", "misplaced"])
def test_a_damaged_or_misplaced_entry_is_quarantined_and_generate_falls_back(
    tiny, tiny_fp, long_ids, grpc_peers, tmp_path, how, caplog
):
    model = tiny[0]
    root = tmp_path / "store"
    store = CacheStore(root)
    doc = long_ids[:300]
    target = put(store, prefill(model, doc).cache, tiny_fp, doc).cache_id
    other = put(store, prefill(model, long_ids[:100]).cache, tiny_fp, long_ids[:100]).cache_id
    damage(store, target, how, other)
    prompt = [*doc, *long_ids[400:410]]

    with caplog.at_level(logging.WARNING, logger="kvmesh.store.cache_store"):
        result = generate(model, tiny_fp, prompt, store, max_tokens=6)
    assert f"quarantined cache {target}" in caplog.text
    assert result.tokens == greedy_tokens(model, prompt, 6)
    assert result.prefix.where != "local store" or result.prefix.cache_id != target
    assert any(s.startswith("local store:") for s in result.prefix.skipped)
    assert target not in {e.cache_id for e in store.entries()}
    assert [p.name.split(".")[0] for p in store.quarantine_dir.iterdir()] == [target]

    # `cache verify --all` is clean now; the other entry still verifies. A peer never offers the damaged one.
    assert cli("cache", "--store", root, "verify", "--all").returncode == 0
    with PeerClient(grpc_peers.start(root).address) as client:
        assert {m.candidate.cache_id for m in client.lookup(tiny_fp.model_id, prompt)} <= {other}


@pytest.mark.slow
def test_cache_verify_finds_damage_quarantines_it_and_export_refuses_it(tiny, tiny_fp, prompt_ids, tmp_path):
    root = tmp_path / "store"
    store = CacheStore(root)
    cache_id = put(store, prefill(tiny[0], prompt_ids).cache, tiny_fp, prompt_ids, chunk_size=16 << 10).cache_id
    with pytest.raises(NotFoundError):
        store.delete("0" * 32)
    path = store.entries_dir / f"{cache_id}.kvc"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        store.export(cache_id, tmp_path / "out.kvc")
    assert not (tmp_path / "out.kvc").exists() and store.entries() == []

    put(store, prefill(tiny[0], prompt_ids).cache, tiny_fp, prompt_ids, chunk_size=16 << 10)
    (store.entries_dir / f"{cache_id}.kvc").write_bytes(bytes(data))
    verified = cli("cache", "--store", root, "verify", "--all", check=False)
    assert verified.returncode == 1 and f"{cache_id}  DAMAGED, quarantined" in verified.stdout
    assert cli("cache", "--store", root, "list", "--json").stdout.strip() == "[]"
    deleted = cli("cache", "--store", root, "delete", cache_id, check=False)
    assert deleted.returncode == 1 and deleted.stderr == f"kvmesh: error: no cache {cache_id} in the store\n"


# The index is a cache of the files


@pytest.mark.parametrize("how", ["deleted", "garbage"])
def test_a_lost_or_corrupt_index_is_rebuilt_from_the_files(
    tiny, tiny_fp, prompt_ids, grpc_peers, tmp_path, how, caplog
):
    root = tmp_path / "store"
    store = CacheStore(root)
    ids = {put(store, prefill(tiny[0], prompt_ids[:n]).cache, tiny_fp, prompt_ids[:n]).cache_id for n in (150, 250)}
    index = root / INDEX
    for suffix in ("", "-wal", "-shm"):
        Path(f"{index}{suffix}").unlink(missing_ok=True)
    if how == "garbage":
        index.write_bytes(os.urandom(8192))
    caplog.set_level(logging.INFO, logger="kvmesh.store")
    address = grpc_peers.start(root).address
    with PeerClient(address) as client:
        assert client.info().store.entries == 2
        match = client.lookup(tiny_fp.model_id, [*prompt_ids[:250], 1])[0]
        fetched = fetch_cache(client, match.candidate.cache_id, ReceiverProfile(tiny_fp, prompt=prompt_ids))
    assert {e.cache_id for e in CacheStore(root).entries()} == ids
    assert fetched.manifest.prefix.num_tokens == 250
    assert "indexed 2 entry files the index lacked" in caplog.text
    if how == "garbage":
        assert "is unreadable" in caplog.text and list(root.glob(f"{INDEX}.corrupt-*"))


# One daemon per data directory, one per port


def daemon_on_port(port, data_dir):
    return cli(
        "daemon",
        "--interface",
        "127.0.0.1",
        "--port",
        port,
        "--no-discovery",
        data_dir=data_dir,
        check=False,
        timeout=60,
    )


@pytest.mark.slow
def test_a_second_daemon_on_the_same_data_dir_or_a_taken_port_exits_with_one_line(tmp_path):
    first = loopback_daemon(tmp_path / "a")
    try:
        again = cli(
            "daemon",
            "--interface",
            "127.0.0.1",
            "--port",
            "0",
            "--no-discovery",
            data_dir=tmp_path / "a",
            check=False,
            timeout=60,
        )
        assert again.returncode == 1 and again.stderr.count("\n") == 1
        assert again.stderr == (
            f"kvmesh: error: another kvmesh daemon (pid {first.process.pid}) already runs for {tmp_path / 'a'}; "
            "stop it first, or give this one its own --data-dir\n"
        )
        assert (tmp_path / "a" / "daemon.json").exists()  # the first one's state is untouched

        port = int(first.address.rsplit(":", 1)[1])
        taken = daemon_on_port(port, tmp_path / "b")
        assert taken.returncode == 1 and taken.stderr.count("\n") == 1
        assert taken.stderr.startswith(f"kvmesh: error: cannot listen on 127.0.0.1:{port}")
        assert f"held by pid {first.process.pid}" in taken.stderr
    finally:
        first.stop()

    with socket.create_server(("127.0.0.1", 0)) as other_program:
        port = other_program.getsockname()[1]
        taken = daemon_on_port(port, tmp_path / "c")
    assert taken.returncode == 1 and f"held by pid {os.getpid()}" in taken.stderr


# Every CLI failure is one line, found before a model loads


@pytest.mark.slow
def test_cli_mistakes_are_one_line_each(tiny_dir, tmp_path):
    empty, binary = tmp_path / "empty.txt", tmp_path / "binary.txt"
    empty.write_text("  \n")
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    expectations = [
        (["prefill", tiny_dir, "--file", empty], 1, f"kvmesh: error: {empty}: the file is empty"),
        (["prefill", tiny_dir, "--file", binary], 1, f"kvmesh: error: {binary}: not UTF-8 text"),
        (
            ["prefill", tiny_dir, "--prompt", "x", "--method", "full", "--ratio", "0.5"],
            1,
            "kvmesh: error: full keeps every position",
        ),
        (["generate", tiny_dir, "--prompt", "x", "--max-tokens", "-1"], 2, "--max-tokens: must be at least 1"),
    ]
    for args, code, start in expectations:
        result = cli(*args, data_dir=tmp_path / "d", check=False)
        assert result.returncode == code, (args, result.stderr)
        last = result.stderr.strip().splitlines()[-1] if code == 2 else result.stderr
        assert (start in last) if code == 2 else last.startswith(start), (args, result.stderr)
        if code == 1:
            assert result.stderr.count("\n") == 1, result.stderr

    (tmp_path / "d").mkdir(exist_ok=True)
    (tmp_path / "d" / "daemon.json").write_text("{not json")
    assert cli("cache", "list", data_dir=tmp_path / "d").stdout == "the store is empty\n"
    status = cli("status", data_dir=tmp_path / "d", check=False)
    assert status.returncode == 1 and status.stderr.startswith("kvmesh: error: ") and status.stderr.count("\n") == 1

    cli("mesh", "init", data_dir=tmp_path / "m1")
    cli("mesh", "init", data_dir=tmp_path / "m2")
    token = cli("mesh", "token", data_dir=tmp_path / "m2").stdout.strip().splitlines()[0]
    before = (tmp_path / "m1" / "mesh" / "trust.pem").read_bytes()
    # Refused before anything is dialled (port 9 has no listener): leaving a mesh takes --replace
    # (tests/scenario/test_membership.py joins with it).
    joined = cli("mesh", "join", token, "127.0.0.1:9", data_dir=tmp_path / "m1", check=False)
    assert joined.returncode == 1 and "already belongs to a mesh" in joined.stderr
    assert (tmp_path / "m1" / "mesh" / "trust.pem").read_bytes() == before


# A busy peer is not a dead peer


def test_health_checks_are_answered_while_every_transfer_slot_is_busy(
    tiny_fp, tiny, long_prompt, long_cache, grpc_peers, tmp_path
):
    served = tmp_path / "a"
    cache_id = put(
        CacheStore(served), long_cache, tiny_fp, long_prompt[:-8], codec="none", chunk_size=16 << 10
    ).cache_id
    address = grpc_peers.start(served, max_transfers=1).address
    release = threading.Event()
    outcomes: list[str] = []

    def slow_fetch():
        try:
            with PeerClient(address) as client:
                fetch_cache(
                    client, cache_id, ReceiverProfile(tiny_fp), progress=lambda *_: release.wait(60), idle_timeout=120
                )
            outcomes.append("done")
        except KvmeshError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=slow_fetch) for _ in range(10)]
    for t in threads:
        t.start()
    try:
        with PeerClient(address) as client:
            wait_for(lambda: client.info().transfers.transfers_active == 1, seconds=20, every=0.1, what="a transfer")
        with grpc.insecure_channel(address) as channel:
            for _ in range(5):
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="kvmesh.v1.KvMesh"), timeout=2
                )
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        for t in threads:
            t.join()
    assert outcomes.count("done") >= 1, outcomes
    assert all(o == "done" or "busy" in o for o in outcomes), outcomes
