"""A misbehaving member against real processes: a peer that answers lookups with bogus candidates,
stalls or trickles; a member that opens fetches and never sends the open, or accepts a transfer and
stops reading. Each costs the others at most a bounded time, and no slot for good."""

import re
import threading
import time

import grpc
import mlx.core as mx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.errors import PeerError
from kvmesh.net.client import PeerClient
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import method, open_channel, serialize
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.generate import generate
from kvmesh.reuse.rates import Rates
from kvmesh.store import CacheStore
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PROTOCOL_VERSION
from support import hostile_peer
from support.mesh import make_mesh, member_credentials
from support.references import greedy_tokens
from support.stores import put
from support.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def hostile(tmp_path):
    """hostile(store, *flags) -> address of a hostile_peer process, killed at the end."""
    started = []

    def start(store, *flags) -> str:
        process, address = hostile_peer.start(store, *flags)
        started.append(process)
        return address

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_bogus_lookup_answers_are_capped_checked_and_cost_at_most_the_budget(
    tiny, tiny_fp, prompt_ids, hostile, tmp_path
):
    address = hostile(tmp_path / "h", "--bogus", 20, "--stall", 9.5)
    with PeerClient(address) as client:
        matches = client.lookup(tiny_fp.model_id, prompt_ids)
    assert 0 < len(matches) <= 4  # of 21 offered (kvmesh.net.client.MAX_CANDIDATES)
    assert all(m.tokens <= len(prompt_ids) for m in matches)  # the billion-token claim is left out

    rates = Rates(tmp_path / "data")
    result = generate(
        tiny[0], tiny_fp, prompt_ids, CacheStore(tmp_path / "b"), peers=[address], max_tokens=4, rates=rates
    )
    assert result.tokens == greedy_tokens(tiny[0], prompt_ids, 4)
    spent = [s for s in result.prefix.skipped if "time budget" in s]
    assert result.prefix.where == "none" and spent
    # The mesh part took at most the budget (this machine's own prefill of the whole prompt, as its
    # calibration timed it, at least 2 s: a loaded machine's budget is longer too) and one call's
    # overshoot (a lookup's timeout at most): not 20 stalls of 9.5 s.
    budget = float(re.search(r"time budget of ([0-9.e+-]+) s", spent[0]).group(1))
    assert result.prefix.seconds < budget + TIMEOUTS.lookup, result.prefix


def synthetic_cache(tokens: int) -> list:
    """A cache of the tiny geometry (4 layers, 2 kv heads of 64) over `tokens` tokens: 4 KiB a token."""
    return [
        SparseKVCache.from_arrays(mx.ones((1, 2, tokens, 64)), mx.ones((1, 2, tokens, 64)), tokens) for _ in range(4)
    ]


def test_a_trickling_sender_is_cut_like_a_stall(tiny_fp, hostile, tmp_path):
    tokens = list(range(4, 2052))
    manifest = put(
        CacheStore(tmp_path / "h"), synthetic_cache(len(tokens)), tiny_fp, tokens, codec="none", chunk_size=16 << 10
    )
    pace = 8.5  # one frame per 8.5 s: under the 10 s idle limit; the cache's 512 frames take 72 minutes so
    address = hostile(tmp_path / "h", "--trickle", pace)
    start = time.monotonic()
    with PeerClient(address) as client, pytest.raises(PeerError, match="a trickle"):
        fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=tokens))
    assert time.monotonic() - start < 3 * pace  # cut before the sender's third frame (of 512)


@pytest.fixture
def members(tmp_path):
    """Data dirs a (serving), b (misbehaving) and d (well-behaved), members of one mesh."""
    a, b, d = tmp_path / "a", tmp_path / "b", tmp_path / "d"
    make_mesh(a, b, d)
    return a, b, d


@pytest.mark.parametrize("who", ["a member", "a local caller"])
def test_fetches_that_never_send_their_open_starve_no_health_check_or_fetch(members, tiny_fp, daemons, tmp_path, who):
    a, b, d = members
    if who == "a local caller":  # a daemon without credentials: every caller is this machine's user
        a, b, d = tmp_path / "local", None, None
    tokens = list(range(4, 260))
    manifest = put(CacheStore(a / "store"), synthetic_cache(len(tokens)), tiny_fp, tokens, codec="none")
    daemon = daemons.start(a)
    never = threading.Event()

    def no_open():
        never.wait()
        yield spb.FetchRequest()

    def credentials(data_dir):
        return None if data_dir is None else member_credentials(data_dir)

    results: list[str] = []
    with open_channel(daemon.address, credentials(b)) as attacker:
        fetch = attacker.stream_stream(method("Fetch"), request_serializer=serialize, response_deserializer=bytes)
        calls = [fetch(no_open(), timeout=60) for _ in range(40)]
        try:
            with open_channel(daemon.address, credentials(d)) as channel:
                for _ in range(20):
                    answer = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="kvmesh.v1.KvMesh"), timeout=2
                    )
                    results.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
            with PeerClient(daemon.address, credentials=credentials(d)) as client:
                if who == "a member":  # held to its own transfer count: the others' fetches go on
                    fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=tokens))
                    assert fetched.manifest.cache_id == manifest.cache_id
                else:  # one user's own calls: at worst refused at once as busy, never left hanging
                    began = time.monotonic()
                    try:
                        fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=tokens))
                    except PeerError as e:
                        # Refused as busy, not left waiting until an idle stream is cut.
                        assert "busy" in str(e) and time.monotonic() - began < TIMEOUTS.stream_idle, e
        finally:
            never.set()
            for call in calls:
                call.cancel()
    assert results == ["SERVING"] * 20
    with PeerClient(daemon.address, credentials=credentials(d)) as client:  # the opens' deadline passed
        fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=tokens))
    assert fetched.manifest.cache_id == manifest.cache_id


def test_a_receiver_that_stops_reading_frees_its_transfer_slot(tiny_fp, daemons, tmp_path):
    tokens = list(range(4, 16388))  # 64 MiB: far more than sockets and HTTP/2 windows hold
    manifest = put(CacheStore(tmp_path / "a"), synthetic_cache(len(tokens)), tiny_fp, tokens, codec="none")
    daemon = daemons.start(tmp_path / "a.data", "--store", tmp_path / "a", "--max-transfers", 2, "--idle-timeout", 2)
    release = threading.Event()

    def accept_then_stall():
        yield spb.FetchRequest(open=spb.FetchOpen(cache_id=manifest.cache_id, protocol_version=PROTOCOL_VERSION))
        yield spb.FetchRequest(decision=spb.Decision(accept=True))
        release.wait()

    channels = [grpc.insecure_channel(daemon.address) for _ in range(2)]
    try:
        stalled = []
        for channel in channels:  # two receivers that accept and never read: both transfer slots
            call = channel.stream_stream(method("Fetch"), request_serializer=serialize, response_deserializer=bytes)(
                accept_then_stall(), timeout=120
            )
            next(call)  # the manifest; nothing after it is read
            stalled.append(call)
        start = time.monotonic()
        with PeerClient(daemon.address) as client:
            with client.fetch(manifest.cache_id, ReceiverProfile(tiny_fp, prompt=tokens)) as transfer:
                chunks = transfer.chunks()
                received = len(next(chunks).data)
                # A slot came free once the idle timeout (2 s) cut a stalled sender, long before the
                # stalled calls' own 120 s deadline; the bytes then take what this machine takes.
                assert time.monotonic() - start < 60
                received += sum(len(chunk.data) for chunk in chunks)
        assert received == manifest.encoding.encoded_bytes
    finally:
        release.set()
        for channel in channels:
            channel.close()
    cut = "stopped reading): transfer cut"
    wait_for(lambda: cut in daemon.log.read_text(), 20, 0.1, "the daemon to log the cut transfer")
