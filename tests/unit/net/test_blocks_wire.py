"""A peer that holds the first blocks of a cache is sent only the rest (#30), over the real gRPC
server and client: the manifest says which chunks stay home, the receiver checks its own equal
them before it accepts, and what it decodes is the sender's cache exactly."""

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.prefix import BLOCK_SIZE
from kvmesh.errors import Rejection
from kvmesh.net.client import PeerClient
from kvmesh.net.held import leave_out, own_chunks
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb
from support.references import same_tensors
from support.stores import put

TURN4, TURN5 = 590, 720


@pytest.fixture(scope="module")
def turns(tiny, long_ids):
    """Turns 4 and 5 of a conversation, prefilled a block at a time as a server extends its cache."""
    return {n: prefill(tiny[0], long_ids[:n], step_size=BLOCK_SIZE).cache for n in (TURN4, TURN5)}


def fetch_into(store: CacheStore, address: str, cache_id: str, profile: ReceiverProfile):
    """Fetch a cache into `store` the way generate and serve do (kvmesh.reuse.fetch.fetch_cache, which
    leaves home the blocks the store holds): (the manifest stored, the decoded cache, chunk bytes
    on the wire)."""
    with PeerClient(address) as client:
        fetched = fetch_cache(client, cache_id, profile, store=store)
    assert fetched.kept
    # The link's rate is timed on what travelled: the held chunks, read here at once, would flatter it.
    assert fetched.stream_bytes < fetched.wire_bytes
    return fetched.manifest, fetched.cache, fetched.wire_bytes


def test_a_peer_holding_turn_4_fetches_only_turn_5s_new_blocks(turns, long_ids, tiny_fp, grpc_peers, tmp_path):
    sender = grpc_peers.start(tmp_path / "a", store_budget=0)
    turn5 = put(sender.store, turns[TURN5], tiny_fp, long_ids[:TURN5])
    receiver = CacheStore(tmp_path / "b", max_bytes=None)
    put(receiver, turns[TURN4], tiny_fp, long_ids[:TURN4])
    profile = ReceiverProfile(tiny_fp, prompt=long_ids[:TURN5])
    manifest, cache, wire = fetch_into(receiver, sender.address, turn5.cache_id, profile)
    assert manifest.cache_id == turn5.cache_id and not manifest.HasField("held")
    assert same_tensors(cache, turns[TURN5])
    # Only the blocks from 512 on travelled: 208 of 720 rows, against the whole cache's bytes.
    held = TURN4 // BLOCK_SIZE * BLOCK_SIZE
    share = (TURN5 - held) / TURN5
    assert wire < turn5.encoding.encoded_bytes * share * 1.1, (wire, turn5.encoding.encoded_bytes)
    stats = sender.server.service.counters.snapshot()
    assert stats.chunk_bytes_sent == wire and stats.fetches_completed == 1
    # What was stored reads back whole, its held blocks shared with turn 4 on the disk.
    assert same_tensors(decode_chunks(manifest, receiver.chunks(manifest.cache_id)), turns[TURN5])


def test_a_receiver_whose_blocks_differ_gets_the_whole_cache(turns, long_ids, tiny_fp, grpc_peers, tmp_path):
    sender = grpc_peers.start(tmp_path / "a", store_budget=0)
    turn5 = put(sender.store, turns[TURN5], tiny_fp, long_ids[:TURN5])
    receiver = CacheStore(tmp_path / "b", max_bytes=None)
    put(receiver, turns[TURN4], tiny_fp, long_ids[:TURN4], codec="none")  # the same rows, other bytes
    profile = ReceiverProfile(tiny_fp, prompt=long_ids[:TURN5])
    manifest, cache, wire = fetch_into(receiver, sender.address, turn5.cache_id, profile)
    assert manifest.cache_id == turn5.cache_id and same_tensors(cache, turns[TURN5])
    assert wire == turn5.encoding.encoded_bytes


def lied(manifest: pb.CacheManifest, lie) -> pb.CacheManifest:
    told = pb.CacheManifest()
    told.CopyFrom(manifest)
    lie(told.held)
    return told


@pytest.mark.parametrize(
    "lie, reason, says",
    [
        (lambda held: held.chunk_indices.pop(), pb.REJECT_REASON_MALFORMED, "left out other chunks than those of 512"),
        (lambda held: setattr(held, "num_tokens", 384), pb.REJECT_REASON_MALFORMED, "left out other chunks"),
        (lambda held: held.checksums.pop(), pb.REJECT_REASON_MALFORMED, "listed without their checksums"),
        (lambda held: held.checksums.__setitem__(3, held.checksums[3] ^ 1), pb.REJECT_REASON_PREFIX, "other bytes"),
        (lambda held: held.raw_lengths.__setitem__(0, 1), pb.REJECT_REASON_PREFIX, "other bytes for chunk"),
    ],
)
def test_a_sender_that_misstates_what_it_left_out_is_declined(turns, long_ids, tiny_fp, tmp_path, lie, reason, says):
    """The receiver takes its own chunks only for exactly the chunks of the tokens it asked to keep,
    with the sender's lengths and checksums: any other statement is declined (and the client then
    asks for the whole cache), so no chunk of its own ever stands in for one it lacks."""
    sender = CacheStore(tmp_path / "a", max_bytes=None)
    turn5 = put(sender, turns[TURN5], tiny_fp, long_ids[:TURN5])
    receiver = CacheStore(tmp_path / "b", max_bytes=None)
    turn4 = put(receiver, turns[TURN4], tiny_fp, long_ids[:TURN4])
    asked = TURN4 // BLOCK_SIZE * BLOCK_SIZE
    told, _ = leave_out(sender.manifest(turn5.cache_id), lambda: sender.chunk_records(turn5.cache_id), asked)
    honest = own_chunks(receiver, turn4.cache_id, told, asked)
    assert isinstance(honest, dict) and sorted(honest) == list(told.held.chunk_indices)
    declined = own_chunks(receiver, turn4.cache_id, lied(told, lie), asked)
    assert isinstance(declined, Rejection) and declined.reason == reason and says in declined.message
