"""The gRPC service and client, against real `kvmesh serve` processes on 127.0.0.1."""

import copy
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import grpc
import mlx.core as mx
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import Press, make_press
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.chunks import FRAME_HEADER
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.codec.manifest import content_id
from kvmesh.errors import CacheRejected, IntegrityError, KvmeshError, PeerError, Rejection
from kvmesh.net.client import Outbox, PeerClient
from kvmesh.net.policy import Policy
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore
from kvmesh.store.entry_file import FOOTER, MAGIC, RECORD_HEADER
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PROTOCOL_VERSION
from support.references import assert_same_generation, same_tensors, steps_after
from support.waiting import wait_for

KINDS = {
    "dense": ("full", {}),
    "sparse": ("snapkv", {"ratio": 0.5, "window": 16}),
    "quantized": ("quantize", {"kv_bits": 8}),
    "sparse+quantized": ("streaming_llm", {"budget": 96, "kv_bits": 4}),
}


@pytest.fixture(scope="module")
def fp(tiny_fp):
    return tiny_fp


@pytest.fixture(scope="module")
def producer(tiny, prompt_ids, fp, tmp_path_factory):
    """A store holding the prompt's first 250 tokens in every cache kind and both codecs."""
    root = tmp_path_factory.mktemp("producer")
    store = CacheStore(root)
    made = {}
    for kind, (method, config) in KINDS.items():
        press = make_press(method, config)
        cache = prefill(tiny[0], prompt_ids[:250], press).cache
        for codec in ("none", "zstd"):
            options = EncodeOptions(codec=codec, chunk_size=16384)
            made[kind, codec] = (store.add(*encode_cache(cache, fp, prompt_ids[:250], press, options=options)), cache)
    return root, made


@pytest.fixture(scope="module")
def big(fp, tmp_path_factory):
    """A store with one 32 MB cache of random keys in the tiny geometry (codec none)."""
    root = tmp_path_factory.mktemp("big")
    n = 8000
    cache = [
        SparseKVCache.from_arrays(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)), n)
        for _ in range(fp.num_layers)
    ]
    tokens = [i % 500 for i in range(n)]
    options = EncodeOptions(codec="none", chunk_size=64 << 10)
    manifest = CacheStore(root).add(*encode_cache(cache, fp, tokens, Press(), options=options))
    return root, manifest, tokens


def copy_store(root, tmp_path, name):
    return shutil.copytree(root, tmp_path / name)


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("kind", KINDS)
def test_fetched_caches_generate_like_the_producer(tiny, prompt_ids, fp, producer, serve, tmp_path, kind, codec):
    root, made = producer
    manifest, cache = made[kind, codec]
    address = serve(copy_store(root, tmp_path, "served"))
    client_store = CacheStore(tmp_path / "client")
    with PeerClient(address) as client:
        fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids), store=client_store)
    assert fetched.manifest.cache_id == manifest.cache_id
    assert [e.cache_id for e in client_store.entries()] == [manifest.cache_id]
    suffix = prompt_ids[250:256]
    want = steps_after(tiny[0], copy.deepcopy(cache), suffix, 5)
    got = steps_after(tiny[0], copy.deepcopy(fetched.cache), suffix, 5)
    assert_same_generation(got, want)  # both codecs are lossless


def test_lookup_and_a_block_aligned_prefix_of_a_dense_cache(tiny, prompt_ids, fp, producer, serve, tmp_path):
    root, made = producer
    served = copy_store(root, tmp_path, "served")
    address = serve(served)
    stored_before = sorted(p.name for p in (served / "entries").iterdir())
    prompt = prompt_ids[:200] + [9] * 50
    with PeerClient(address) as client:
        matches = client.lookup(fp.model_id, prompt)
        # Only caches that evicted nothing share whole blocks with a prompt that diverges at 200.
        assert {m.candidate.cache_id for m in matches} == {made["dense", c][0].cache_id for c in ("none", "zstd")} | {
            made["quantized", c][0].cache_id for c in ("none", "zstd")
        }
        assert {m.tokens for m in matches} == {128}
        assert client.lookup(fp.model_id, prompt_ids)[0].tokens == 250
        dense_id = made["dense", "zstd"][0].cache_id
        fetched = fetch_cache(client, dense_id, ReceiverProfile(fp, prompt=prompt), num_tokens=128)
        again = fetch_cache(client, dense_id, ReceiverProfile(fp, prompt=prompt), num_tokens=128)
    assert fetched.manifest.cache_id == again.manifest.cache_id != dense_id
    # The prefix was cut as it streamed: the serving store holds nothing new.
    assert sorted(p.name for p in (served / "entries").iterdir()) == stored_before
    assert [(c.offset, c.n_kept) for c in fetched.cache] == [(128, 128)] * fp.num_layers
    fresh = prefill(tiny[0], prompt_ids[:128]).cache
    assert same_tensors(fresh, fetched.cache)


def test_a_lookup_names_the_shortest_of_the_caches_serving_as_much_first(tiny, prompt_ids, fp, serve, tmp_path):
    """More copies serve a prompt's first block than a lookup names (MAX_CANDIDATES): the one that
    is that block alone comes first, so a receiver is not left with copies it must have cut."""
    model, _ = tiny
    store = CacheStore(tmp_path / "a")
    longer = prefill(model, prompt_ids[:256]).cache
    for level in range(1, 6):  # five encodings of a 256-token cache, each its own entry
        store.add(*encode_cache(longer, fp, prompt_ids[:256], options=EncodeOptions(level=level)))
    block = store.add(*encode_cache(prefill(model, prompt_ids[:128]).cache, fp, prompt_ids[:128]))
    with PeerClient(serve(tmp_path / "a")) as client:
        matches = client.lookup(fp.model_id, prompt_ids[:200] + [9] * 50)
    assert len(matches) == 4 and {m.tokens for m in matches} == {128}
    assert matches[0].candidate.cache_id == block.cache_id


def tampered_entry(root, cache_id, change) -> str:
    """Rewrite an entry's manifest with `change` applied, consistently (checksums, id, file name, index),
    as a peer of another kvmesh version, or a hostile one, might hold it. Returns the new id."""
    path = root / "entries" / f"{cache_id}.kvc"
    data = path.read_bytes()
    length, _, magic = FOOTER.unpack(data[-FOOTER.size :])
    manifest = pb.CacheManifest.FromString(data[-FOOTER.size - length : -FOOTER.size])
    change(manifest)
    manifest.cache_id = content_id(manifest)
    new = manifest.SerializeToString()
    path.unlink()
    (root / "entries" / f"{manifest.cache_id}.kvc").write_bytes(
        data[: -FOOTER.size - length] + new + FOOTER.pack(len(new), xxhash.xxh3_64_intdigest(new), magic)
    )
    CacheStore(root)  # recovery indexes the rewritten file, or quarantines it
    return manifest.cache_id


def replaced(fp, **fields):
    return dataclasses.replace(fp, **fields)


@pytest.mark.parametrize(
    "reason, profile_change, manifest_change",
    [
        ("schema", {}, lambda m: setattr(m, "schema_version", 9)),
        ("model_config", {"config_sha256": "1" * 64}, None),
        ("weights", {"weights_sha256": "2" * 64}, None),
        ("tokenizer", {"tokenizer_sha256": "3" * 64}, None),
        ("chat_template", {"chat_template_sha256": "4" * 64}, None),
        ("geometry", {"num_layers": 32}, None),
        ("prefix", {"prompt": [5] * 300}, None),
        ("codec", {"codecs": frozenset({"none"})}, None),
        ("size_limit", {"max_bytes": 1000}, None),
    ],
)
def test_an_incompatible_cache_is_rejected_before_any_chunk(
    prompt_ids, fp, producer, serve, tmp_path, reason, profile_change, manifest_change
):
    root, made = producer
    served = copy_store(root, tmp_path, "served")
    manifest = made["dense", "zstd"][0]
    cache_id = manifest.cache_id
    if manifest_change:
        cache_id = tampered_entry(served, cache_id, manifest_change)
    address = serve(served)
    options = {"prompt": prompt_ids, "codecs": frozenset({"none", "zstd"}), "max_bytes": 1 << 30}
    for key in ("prompt", "codecs", "max_bytes"):
        options[key] = profile_change.pop(key, options[key])
    profile = ReceiverProfile(replaced(fp, **profile_change), **options)
    client_store = CacheStore(tmp_path / "client")
    with PeerClient(address) as client:
        with pytest.raises(CacheRejected) as e:
            fetch_cache(client, cache_id, profile, store=client_store)
        assert e.value.rejection.reason_name == reason
        assert str(e.value).startswith(f"cache rejected ({reason}: ")
        stats = client.info().transfers
    assert stats.chunk_bytes_sent == 0 and stats.fetches_rejected == 1 and stats.fetches_completed == 0
    assert client_store.entries() == []


def test_chunks_move_once_accepted_before_the_receiver_reads_them(prompt_ids, fp, producer, serve, tmp_path):
    """No chunk before the accept; after it, the first is on its way while the receiver readies its
    decoder and store (kvmesh.reuse.fetch accepts first), and they arrive as the manifest said."""
    root, made = producer
    manifest, cache = made["dense", "zstd"]
    address = serve(copy_store(root, tmp_path, "served"))
    with PeerClient(address) as client:
        with client.fetch(manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids)) as transfer:
            assert client.info().transfers.chunk_bytes_sent == 0  # the manifest alone, waiting for a decision
            transfer.accept()
            wait_for(lambda: client.info().transfers.chunk_bytes_sent > 0, what="the first chunk to be sent")
            transfer.accept()  # (once is enough: chunks() accepts only if nobody did)
            decoded = decode_chunks(transfer.manifest, transfer.chunks())
        assert transfer.wire_bytes == manifest.encoding.encoded_bytes
        assert client.info().transfers.fetches_completed == 1
    assert same_tensors(decoded, cache)


def test_a_fetch_declined_once_accepted_is_cut_not_drained(fp, big, serve, tmp_path):
    """A receiver that says no after its accept (the chunks moving) cuts the call: the sender stops,
    nothing more is read; and a fetch declined cannot be accepted after all."""
    root, manifest, tokens = big
    address = serve(copy_store(root, tmp_path, "served"))
    with PeerClient(address) as client:
        transfer = client.fetch(manifest.cache_id, ReceiverProfile(fp, prompt=tokens))
        transfer.accept()
        wait_for(lambda: client.info().transfers.chunk_bytes_sent > 0, what="the first chunk to be sent")
        transfer.decline(Rejection(pb.REJECT_REASON_SIZE_LIMIT, "changed its mind"))
        wait_for(lambda: client.info().transfers.transfers_active == 0, what="the sender to stop")
        stats = client.info().transfers
        assert stats.fetches_completed == 0 and stats.chunk_bytes_sent < manifest.encoding.encoded_bytes
        assert transfer.wire_bytes == 0
        declined = client.fetch(manifest.cache_id, ReceiverProfile(fp, prompt=tokens))
        declined.decline(Rejection(pb.REJECT_REASON_SIZE_LIMIT, "no"))
        with pytest.raises(RuntimeError, match="declined cannot be accepted"):
            declined.accept()
        assert client.info().transfers.chunk_bytes_sent == stats.chunk_bytes_sent  # (none for the second)


@pytest.mark.parametrize(
    "change",
    [lambda m: m.layers[1].tensors[0].shape.__setitem__(0, 10**9), lambda m: setattr(m.layers[0], "kind", 77)],
    ids=["malformed", "unknown_kind"],
)
def test_a_peer_never_serves_an_entry_it_cannot_vouch_for(prompt_ids, fp, producer, serve, tmp_path, change):
    root, made = producer
    served = copy_store(root, tmp_path, "served")
    cache_id = tampered_entry(served, made["dense", "zstd"][0].cache_id, change)
    assert list((served / "quarantine").iterdir()) and not (served / "entries" / f"{cache_id}.kvc").exists()
    with PeerClient(serve(served)) as client:
        with pytest.raises(PeerError, match="not_found"):
            fetch_cache(client, cache_id, ReceiverProfile(fp, prompt=prompt_ids))
        assert client.info().transfers.chunk_bytes_sent == 0


def test_a_peer_killed_mid_stream_then_another_peer_serves(fp, big, serve, tmp_path):
    root, manifest, tokens = big
    first = serve(copy_store(root, tmp_path, "a"))
    second = serve(copy_store(root, tmp_path, "b"))
    client_store = CacheStore(tmp_path / "client")
    killed = threading.Event()

    def kill_first(received, total):
        if not killed.is_set():
            process = serve.processes[first]
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            killed.set()

    profile = ReceiverProfile(fp, prompt=tokens)
    with PeerClient(first) as client:
        with pytest.raises(PeerError) as e:
            fetch_cache(client, manifest.cache_id, profile, store=client_store, progress=kill_first)
    assert e.value.address == first
    assert client_store.entries() == [] and list(client_store.incoming_dir.iterdir()) == []

    with PeerClient(second) as client:
        fetched = fetch_cache(client, manifest.cache_id, profile, store=client_store)
    assert fetched.manifest.cache_id == manifest.cache_id
    assert [e.cache_id for e in client_store.entries()] == [manifest.cache_id]


def corrupt_a_chunk_in_flight(entry_path, index):
    """Damage chunk `index`'s data but keep its record checksum valid: only the receiver can tell."""
    data = bytearray(entry_path.read_bytes())
    at = len(MAGIC)
    for _ in range(index):
        length, _ = RECORD_HEADER.unpack_from(data, at)
        at += RECORD_HEADER.size + length
    length, _ = RECORD_HEADER.unpack_from(data, at)
    frame = at + RECORD_HEADER.size
    data[frame + FRAME_HEADER.size] ^= 0xFF  # the chunk's first data byte
    data[at:frame] = RECORD_HEADER.pack(length, xxhash.xxh3_64_intdigest(bytes(data[frame : frame + length])))
    entry_path.write_bytes(bytes(data))


def test_a_corrupted_chunk_is_refused_and_the_server_serves_on(prompt_ids, fp, producer, serve, tmp_path):
    root, made = producer
    served = copy_store(root, tmp_path, "served")
    bad, good = made["dense", "none"][0], made["sparse", "zstd"][0]
    corrupt_a_chunk_in_flight(served / "entries" / f"{bad.cache_id}.kvc", 3)
    address = serve(served)
    client_store = CacheStore(tmp_path / "client")
    profile = ReceiverProfile(fp, prompt=prompt_ids)
    with PeerClient(address) as client:
        with pytest.raises(IntegrityError, match="chunk 3 is corrupt"):
            fetch_cache(client, bad.cache_id, profile, store=client_store)
        assert client_store.entries() == []
        assert fetch_cache(client, good.cache_id, profile, store=client_store).manifest.cache_id == good.cache_id


@pytest.mark.parametrize("decision", ["accept", "decline"])
def test_a_copy_damaged_on_disk_is_found_before_the_decision_and_fails_only_an_accepted_fetch(
    prompt_ids, fp, producer, serve, tmp_path, decision
):
    """The sender reads a fetch's first message while the receiver decides: damage in it quarantines
    the entry then, and is the receiver's error only once it accepts (a decline ends quietly)."""
    root, made = producer
    served = copy_store(root, tmp_path, "served")
    bad = made["dense", "none"][0]
    path = served / "entries" / f"{bad.cache_id}.kvc"
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + RECORD_HEADER.size + FRAME_HEADER.size] ^= 0xFF  # chunk 0's data, its record checksum kept
    path.write_bytes(bytes(data))
    with PeerClient(serve(served)) as client:
        transfer = client.fetch(bad.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
        with transfer:
            if decision == "decline":
                transfer.decline(Rejection(pb.REJECT_REASON_PREFIX, "not this one"))
            else:
                with pytest.raises(PeerError, match="this peer's copy is damaged: .*chunk 0 is damaged on disk") as e:
                    next(transfer.chunks())
                assert e.value.code == grpc.StatusCode.DATA_LOSS
        info = client.info()
    assert info.transfers.chunk_bytes_sent == 0
    assert not path.exists() and [p.name.split(".")[0] for p in (served / "quarantine").iterdir()] == [bad.cache_id]


def test_the_accept_is_handed_to_grpcs_thread_before_the_receiver_goes_on():
    """`Outbox.hand_over` returns once the request stream took the message (the receiver's work after
    an accept would hold the GIL that thread needs to send it), or after HAND_OVER_S when nothing
    takes it (a call that ended)."""
    outbox, order = Outbox(), []
    stream = outbox.requests()

    def send():  # (what gRPC's thread does with the request stream)
        order.append(next(stream).decision.accept)

    sender = threading.Thread(target=send)
    sender.start()
    outbox.hand_over(spb.FetchRequest(decision=spb.Decision(accept=True)))
    order.append("went on")
    sender.join()
    assert order == [True, "went on"]
    outbox.HAND_OVER_S = 0.05
    outbox.hand_over(spb.FetchRequest(decision=spb.Decision(accept=True)))  # nobody takes it: returns all the same
    outbox.put(None)
    assert next(stream).decision.accept and next(stream, "ended") == "ended"


class Stop(Exception):
    pass


def test_a_client_cancel_ends_the_transfer_on_both_sides(fp, big, serve, tmp_path):
    root, manifest, tokens = big
    address = serve(copy_store(root, tmp_path, "served"))
    client_store = CacheStore(tmp_path / "client")

    def cancel(received, total):
        if received > total // 10:
            raise Stop

    with PeerClient(address) as client:
        with pytest.raises(Stop):
            fetch_cache(
                client, manifest.cache_id, ReceiverProfile(fp, prompt=tokens), store=client_store, progress=cancel
            )
        wait_for(lambda: client.info().transfers.transfers_active == 0, what="the peer to end the transfer")
        stats = client.info().transfers
        assert stats.fetches_failed == 1 and stats.chunk_bytes_sent < manifest.encoding.encoded_bytes
        assert client_store.entries() == [] and list(client_store.incoming_dir.iterdir()) == []
        # The server serves the next request as usual.
        assert (
            fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=tokens)).manifest.cache_id
            == manifest.cache_id
        )


def test_concurrent_fetches_all_succeed_within_the_cap(fp, big, serve, tmp_path):
    root, manifest, tokens = big
    address = serve(copy_store(root, tmp_path, "served"), "--max-transfers", "2")
    results, errors = [], []

    def fetch():
        try:
            with PeerClient(address) as client:
                results.append(fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=tokens)).wire_bytes)
        except KvmeshError as e:
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [manifest.encoding.encoded_bytes] * 5
    with PeerClient(address) as client:
        stats = client.info().transfers
    assert stats.fetches_completed == 5 and 1 <= stats.transfers_max_seen <= 2 == stats.transfers_cap


def test_publish_then_fetch_back(tiny, prompt_ids, fp, producer, serve, tmp_path):
    root, made = producer
    address = serve(tmp_path / "empty")
    manifest = made["sparse+quantized", "zstd"][0]
    with PeerClient(address) as client:
        assert client.publish(CacheStore(root), manifest.cache_id) == manifest.cache_id
        assert client.info().store.entries == 1
        fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
    assert [(c.offset, c.n_kept, c.bits) for c in fetched.cache] == [(250, 96, 4)] * fp.num_layers


def test_a_peer_that_takes_no_publishes_says_so(producer, tmp_path):
    root, made = producer
    from kvmesh.net.server import start_server

    running = start_server(CacheStore(tmp_path / "ro"), "readonly", policy=Policy(accept_publish=False))
    try:
        with PeerClient(f"127.0.0.1:{running.port}") as client:
            with pytest.raises(CacheRejected, match="does not accept publishes"):
                client.publish(CacheStore(root), made["dense", "none"][0].cache_id)
    finally:
        running.stop()


def test_an_unreachable_peer_is_a_clear_error():
    with PeerClient("127.0.0.1:9", timeout=2.0) as client:
        with pytest.raises(PeerError, match="peer 127.0.0.1:9: .*unavailable"):
            client.info()


def test_standard_health_check(serve, tmp_path):
    address = serve(tmp_path / "store")
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvmesh.v1.KvMesh"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


GENERIC_CLIENT = textwrap.dedent(
    """
    # A generic client: everything it knows of kvmesh comes from the server's reflection service.
    import sys
    import grpc
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel = grpc.insecure_channel(sys.argv[1])
    database = ProtoReflectionDescriptorDatabase(channel)
    print(" ".join(sorted(database.get_services())))
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName("kvmesh.v1.KvMesh")
    method = service.FindMethodByName("Info")
    request = message_factory.GetMessageClass(method.input_type)
    response = message_factory.GetMessageClass(method.output_type)
    info = channel.unary_unary(
        "/kvmesh.v1.KvMesh/Info", request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )(request(), timeout=10)
    print(info.node_id, info.protocol_version)
    assert not any(name.startswith("kvmesh") for name in sys.modules), "used kvmesh code"
    """
)


def test_a_generic_client_works_from_reflection_alone(serve, tmp_path):
    address = serve(tmp_path / "store")
    result = subprocess.run([sys.executable, "-c", GENERIC_CLIENT, address], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    services, info = result.stdout.splitlines()
    assert "kvmesh.v1.KvMesh" in services.split() and "grpc.health.v1.Health" in services.split()
    node_id = (tmp_path / "store.data" / "node-id").read_text().strip()
    assert info.split() == [node_id, str(PROTOCOL_VERSION)]


def test_a_quality_floor_is_honoured_before_any_chunk(tiny, prompt_ids, fp, serve, tmp_path):
    prefix = prompt_ids[:250]
    press = make_press("knorm", {"ratio": 0.9, "kv_bits": 4})
    pressed = prefill(tiny[0], prefix, press)
    assert pressed.tail_kl is not None and pressed.tail_kl > 0
    store = CacheStore(tmp_path / "served")
    measured = store.add(*encode_cache(pressed.cache, fp, prefix, press, tail_kl=pressed.tail_kl))
    unmeasured = store.add(*encode_cache(pressed.cache, fp, prefix, press))
    lossless = store.add(*encode_cache(prefill(tiny[0], prefix).cache, fp, prefix))
    assert measured.quality.metric == "tail_kl" and not unmeasured.HasField("quality")
    kl = measured.quality.value

    def fetch(client, manifest, max_kl):
        profile = ReceiverProfile(fp, prompt=prompt_ids, max_kl=max_kl)
        return fetch_cache(client, manifest.cache_id, profile, store=CacheStore(tmp_path / "received"))

    with PeerClient(serve(tmp_path / "served")) as client:
        for manifest, floor, why in [
            (measured, kl / 2, f"measured at {kl:.4f}"),
            (unmeasured, 10.0, "did not measure"),
        ]:
            with pytest.raises(CacheRejected, match=why) as refused:
                fetch(client, manifest, floor)
            assert refused.value.rejection.reason_name == "quality"
        assert client.info().transfers.chunk_bytes_sent == 0
        assert fetch(client, measured, kl * 2).manifest.cache_id == measured.cache_id
        assert fetch(client, lossless, 0.0).manifest.cache_id == lossless.cache_id  # lossless passes any floor
