"""Chunk frames batched on the wire: a receiver that asks for it (FetchOpen.frame_batches, a
publish's accept) gets an 8-bit cache's many small chunks several a message; one that does not, as
kvmesh sent them before, one frame a message. Both get the stored frames, in order, and the same cache."""

import grpc
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.codec.chunks import BATCH_BYTES, batch_frames, frames_in
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.errors import IntegrityError
from kvmesh.net.client import PeerClient
from kvmesh.net.messages import trailer
from kvmesh.net.transport import as_bytes, method, serialize
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PROTOCOL_VERSION
from support.stores import load, put


@pytest.fixture
def eight_bit(tiny, tiny_fp, prompt_ids, serve, tmp_path):
    """(address, store, manifest): a daemon serving an 8-bit cache of the prompt (six small tensors a layer)."""
    store = CacheStore(tmp_path / "a")
    press = make_press("quantize", {"kv_bits": 8})
    manifest = put(store, prefill(tiny[0], prompt_ids, press).cache, tiny_fp, prompt_ids, press)
    return serve(store.root), store, manifest


def raw_fetch(address: str, cache_id: str, *, batches: bool) -> tuple[list[bytes], list[bytes]]:
    """Fetch as a receiver that does (or does not) ask for batches: (the chunk messages, the frames in them)."""
    opened = spb.FetchOpen(cache_id=cache_id, protocol_version=PROTOCOL_VERSION, frame_batches=batches)
    accept = spb.FetchRequest(decision=spb.Decision(accept=True))
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(method("Fetch"), request_serializer=serialize, response_deserializer=as_bytes)
        answers = list(call(iter([spb.FetchRequest(open=opened), accept]), timeout=30))
    assert spb.FetchResponse.FromString(answers[0]).WhichOneof("msg") == "manifest"
    assert spb.FetchResponse.FromString(answers[-1]).WhichOneof("msg") == "trailer"
    messages = answers[1:-1]
    return messages, [bytes(f) for m in messages for f in frames_in(m)]


def test_small_chunks_travel_several_a_message_to_a_receiver_that_asks(tiny_fp, prompt_ids, eight_bit, tmp_path):
    address, store, manifest = eight_bit
    stored = list(store.chunk_records(manifest.cache_id))
    assert len(stored) == manifest.encoding.chunk_count and max(map(len, stored)) < BATCH_BYTES // 4

    batched, frames = raw_fetch(address, manifest.cache_id, batches=True)
    assert frames == stored and len(batched) < len(stored) / 4
    assert all(len(m) <= BATCH_BYTES + 4096 for m in batched)
    # A receiver of before the field: a frame a message, as ever.
    single, frames = raw_fetch(address, manifest.cache_id, batches=False)
    assert single == stored

    # kvmesh's own receiver asks, and decodes what the producer stored; the sender counts chunk bytes alike.
    with PeerClient(address) as client:
        fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=prompt_ids + [0]))
        sent = client.info().transfers.chunk_bytes_sent
    assert fetched.wire_bytes == manifest.encoding.encoded_bytes == sent // 3
    _, here = load(store, manifest.cache_id)
    mine, theirs = tree_flatten([c.state for c in fetched.cache]), tree_flatten([c.state for c in here])
    assert len(mine) == len(theirs) and all(mx.array_equal(a, b) for (_, a), (_, b) in zip(mine, theirs))


def test_batches_keep_each_frame_whole_and_in_order():
    frames = [bytes([i]) * n for i, n in enumerate((10, 20, 300, 5, 5, 1000, 7))]
    messages = list(batch_frames(frames, max_bytes=100))
    assert [lengths for _, lengths in messages] == [[10, 20], [300], [5, 5], [1000], [7]]
    assert messages[1][0] == frames[2] and messages[3][0] == frames[5]  # a lone frame travels as itself
    assert [bytes(f) for m, _ in messages for f in frames_in(m)] == frames


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda m: m[:-1], "its chunk frames add up to 30 bytes, it holds 29"),
        (lambda m: m + b"x", "its chunk frames add up to 30 bytes, it holds 31"),
        (lambda m: m[:4] + (10**6).to_bytes(4, "little") + m[8:], "a batch of 1000000 chunk frames does not fit"),
        (lambda m: m[:4] + bytes(4) + m[8:], "a batch of 0 chunk frames does not fit"),
        (lambda m: m[:6], "6 bytes, too short for a batch of chunk frames"),
    ],
)
def test_a_batch_whose_lengths_do_not_add_up_is_refused_in_one_line(damage, says):
    [(message, _)] = batch_frames([b"a" * 10, b"b" * 20], max_bytes=100)
    with pytest.raises(IntegrityError, match="^chunk 7: " + says.replace("(", r"\(")):
        frames_in(damage(message), "chunk 7")


def test_a_publish_sends_batches_to_a_peer_that_reads_them_and_one_a_message_is_still_taken(eight_bit, serve, tmp_path):
    _, store, manifest = eight_bit
    stored = list(store.chunk_records(manifest.cache_id))
    with PeerClient(serve(tmp_path / "b")) as client:  # kvmesh's own publisher: batches, as the peer asks
        assert client.offer(store, manifest.cache_id).sent
    assert list(CacheStore(tmp_path / "b").chunk_records(manifest.cache_id)) == stored

    # A publisher of before batches sends a frame a message, whatever the peer says; batches are read too.
    for name, messages in (("c", stored), ("d", [m for m, _ in batch_frames(stored)])):
        offered = [
            serialize(spb.PublishRequest(manifest=manifest, protocol_version=PROTOCOL_VERSION)),
            *messages,
            serialize(spb.PublishRequest(trailer=trailer(manifest))),
        ]
        with grpc.insecure_channel(serve(tmp_path / name)) as channel:
            call = channel.stream_stream(method("Publish"), request_serializer=as_bytes,
                                         response_deserializer=spb.PublishResponse.FromString)  # fmt: skip
            decision, result = list(call(iter(offered), timeout=30))
        assert decision.decision.accept and decision.frame_batches
        assert result.result.cache_id == manifest.cache_id
        assert list(CacheStore(tmp_path / name).chunk_records(manifest.cache_id)) == stored
