"""Peers of protocol 2 (chunks as protobuf messages) and this one: refused both ways, by reason
`version`, before a single chunk byte moves."""

import queue
import threading
from concurrent import futures

import grpc
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.errors import CacheRejected
from kvmesh.net.client import PeerClient
from kvmesh.net.transport import SERVICE_NAME, as_bytes, serialize
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc
from support.stores import put


@pytest.fixture
def stored(tiny, tiny_fp, prompt_ids, tmp_path):
    store = CacheStore(tmp_path / "a")
    return store, put(store, prefill(tiny[0], prompt_ids).cache, tiny_fp, prompt_ids, codec="none")


def old_chunk(record: pb.Chunk) -> bytes:
    """A FetchResponse of protocol 2: field 2 held the chunk."""
    data = record.SerializeToString()
    assert len(data) < 1 << 14
    return b"\x12" + bytes([len(data) & 0x7F | 0x80, len(data) >> 7]) + data


class OldPeer:
    """A peer of protocol 2, as far as the handshake goes: no protocol_version anywhere, and chunks
    as FetchResponse field 2 (PublishRequest field 2) once a receiver accepts. It records what it got."""

    def __init__(self, manifest: pb.CacheManifest):
        self.manifest = manifest
        self.decisions: queue.Queue = queue.Queue()
        self.chunks_sent = 0
        self.published_messages: list[bytes] = []
        self.published = threading.Event()
        handlers = {
            "Fetch": grpc.stream_stream_rpc_method_handler(self.fetch, spb.FetchRequest.FromString, serialize),
            "Publish": grpc.stream_stream_rpc_method_handler(self.publish, as_bytes, serialize),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def fetch(self, requests, context):
        next(requests)  # the open
        yield spb.FetchResponse(manifest=self.manifest)
        decision = next(requests).decision
        self.decisions.put(decision)
        if decision.accept:
            self.chunks_sent += 1
            yield old_chunk(pb.Chunk(index=0, raw_length=4, data=b"\0" * 4))

    def publish(self, requests, context):
        next(requests)  # the manifest

        def drain():  # on its own thread: a cancelled call never resumes this handler after a yield
            try:
                for message in requests:  # ends when the publisher closes or cancels the stream
                    self.published_messages.append(message)
            except grpc.RpcError:
                pass
            finally:
                self.published.set()

        threading.Thread(target=drain, daemon=True).start()
        yield spb.PublishResponse(decision=spb.Decision(accept=True))


def test_a_peer_of_the_old_framing_is_refused_before_any_chunk(tiny_fp, prompt_ids, stored):
    store, manifest = stored
    old = OldPeer(manifest)
    try:
        with PeerClient(old.address) as client:
            with pytest.raises(CacheRejected) as refused:
                fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=prompt_ids))
            assert refused.value.rejection.reason == pb.REJECT_REASON_VERSION
            assert "speaks protocol 2 or older" in str(refused.value) and "update kvmesh" in str(refused.value)
            decision = old.decisions.get(timeout=10)
            assert not decision.accept and decision.reason == pb.REJECT_REASON_VERSION and old.chunks_sent == 0

            with pytest.raises(CacheRejected) as refused:
                client.publish(store, manifest.cache_id)
            assert refused.value.rejection.reason == pb.REJECT_REASON_VERSION
        assert old.published.wait(10) and old.published_messages == []  # no frame followed the manifest
    finally:
        old.server.stop(None)


def test_a_requester_of_the_old_framing_is_refused_with_the_reason(tiny_fp, stored, serve, tmp_path):
    store, manifest = stored
    address = serve(store.root)
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.KvMeshStub(channel)  # as kvmesh 0.2 asked: no protocol_version
        opened = spb.FetchRequest(open=spb.FetchOpen(cache_id=manifest.cache_id))
        [answer] = list(stub.Fetch(iter([opened]), timeout=10))
        assert answer.WhichOneof("msg") == "refused" and answer.refused.reason == pb.REJECT_REASON_VERSION
        assert "the requester speaks protocol 2 or older" in answer.refused.message

        [decision] = list(stub.Publish(iter([spb.PublishRequest(manifest=manifest)]), timeout=10))
        assert not decision.decision.accept and decision.decision.reason == pb.REJECT_REASON_VERSION

        stats = stub.Info(spb.InfoRequest(), timeout=10).transfers
    assert stats.fetches_rejected == 1 and stats.chunk_bytes_sent == 0 and stats.publishes_rejected == 1
