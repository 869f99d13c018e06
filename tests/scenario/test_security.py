"""Mesh membership and TLS, with real daemons: who is refused, what the wire shows, what is shared."""

import contextlib
import datetime
import os
import socket
import sys
import threading
import time

import grpc
import mlx.core as mx
import pytest
from cryptography import x509

from kvmesh.caches.prefill import prefill
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.chunks import Chunk
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.daemon.control import DaemonProcess
from kvmesh.errors import CacheRejected, CredentialsError, PeerError
from kvmesh.net.client import PeerClient
from kvmesh.net.mesh.credentials import MeshCredentials, load_credentials
from kvmesh.net.mesh.enrolment import enrol, export_bundle, init_mesh, join_mesh, renew, renew_if_due, write_authority
from kvmesh.net.mesh.pki import issue_node_cert
from kvmesh.net.node_id import node_id
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.net.transport import MAX_MESSAGE_BYTES, method, open_channel, serialize
from kvmesh.paths import mesh_dir
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore, entry_file
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.v1 import service_pb2_grpc
from kvmesh.versions import PROTOCOL_VERSION
from support.daemons import loopback_daemon
from support.membership import join_address
from support.processes import ENV, rss
from support.waiting import wait_for

NONE = EncodeOptions(codec="none")


class Relay:
    """A TCP relay on 127.0.0.1 that records what passes each way (a wire tap for the tests)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.to_server, self.to_client = bytearray(), bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, self.to_server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.to_client), daemon=True).start()

    @staticmethod
    def _pipe(source, sink, record):
        try:
            while data := source.recv(1 << 16):
                record += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.listener.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """Data dirs: a (made the mesh: its authority), b and d (admitted to it), c (another mesh)."""
    root = tmp_path_factory.mktemp("mesh")
    init_mesh(root / "a", node_id(root / "a"))
    for name in ("b", "d"):
        enrol(root / "a", root / name, node_id(root / name))
    init_mesh(root / "c", node_id(root / "c"))
    return root


def creds(mesh, name) -> MeshCredentials:
    return load_credentials(mesh / name)


@pytest.fixture(scope="module")
def served(mesh, tiny, tiny_fp, prompt_ids):
    """A's store holds one uncompressed cache (codec none, so its bytes are recognisable)."""
    cache = prefill(tiny[0], prompt_ids).cache
    manifest = CacheStore(mesh / "a" / "store").add(*encode_cache(cache, tiny_fp, prompt_ids, options=NONE))
    return manifest, tiny_fp


class Daemon(DaemonProcess):
    """A daemon without discovery, and what its log says about refused handshakes."""

    def __init__(self, data_dir, *args, env=None):
        started = loopback_daemon(data_dir, *args, log=data_dir.parent / f"{data_dir.name}.log", env=env)
        super().__init__(**vars(started))

    def handshake_failures(self) -> int:
        """The daemon's lines about refused handshakes (gRPC's own are kept out of its log): the
        first refusal of each daemon process, then one an hour."""
        return self.log.read_text().count("failed the TLS handshake")

    def wait_for_more_handshake_failures(self, before: int, seconds: float = 10.0) -> int:
        """The daemon logs a refused handshake from its own thread: poll the log for it."""
        deadline = time.monotonic() + seconds
        while (now := self.handshake_failures()) <= before:
            assert time.monotonic() < deadline, "no refused handshake was logged"
            time.sleep(0.05)
        return now


@pytest.fixture
def daemon_a(mesh, served):
    daemon = Daemon(mesh / "a")
    yield daemon
    daemon.stop()


def stats(daemon, mesh):
    with PeerClient(daemon.address, credentials=creds(mesh, "b")) as client:
        return client.info().transfers


def test_a_member_fetches_over_tls_and_the_wire_shows_no_payload(mesh, served, daemon_a, prompt_ids):
    manifest, fp = served
    assert daemon_a.state.mode == "mutual TLS"
    # (the banner follows daemon.json, which the fixture waited for)
    wait_for(lambda: "(mutual TLS) serving on" in daemon_a.log.read_text(), seconds=10, what="the banner")
    relay = Relay(daemon_a.address)
    try:
        with PeerClient(relay.address, credentials=creds(mesh, "b")) as client:
            fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
    finally:
        relay.close()
    assert fetched.manifest.cache_id == manifest.cache_id
    assert len(relay.to_client) > manifest.encoding.raw_bytes  # the whole payload went through the tap
    with open(mesh / "a" / "store" / "entries" / f"{manifest.cache_id}.kvc", "rb") as f:
        chunks = list(entry_file.read_chunks(f, entry_file.read_manifest(f, "a"), "a"))
    for chunk in chunks[:: max(1, len(chunks) // 8)]:
        needle = chunk.data[1000:1064]
        assert needle not in relay.to_client, "plaintext cache bytes on the wire"
    assert b"kvmesh.v1.KvMesh" not in relay.to_server  # even the method names are encrypted


def expired_credentials(mesh) -> MeshCredentials:
    ca = mesh_dir(mesh / "a")
    trust = (ca / "trust.pem").read_bytes()
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=40)
    key, cert = issue_node_cert((ca / "ca.key").read_bytes(), trust, "eeeeeeeeeeeeeeee", not_before=start, days=30)
    return MeshCredentials(trust, key, cert)


@pytest.mark.parametrize("who", ["no credentials", "another mesh", "an expired certificate"])
def test_non_members_are_refused_and_logged_and_get_nothing(mesh, served, daemon_a, prompt_ids, who):
    manifest, fp = served
    # An outsider may know the mesh's CA certificate (it is not secret): it trusts A, but its own
    # certificate is from another mesh, so A must be the one that refuses.
    outsider = creds(mesh, "c")
    credentials = {
        "no credentials": None,
        "another mesh": MeshCredentials(creds(mesh, "a").trust_pem, outsider.key_pem, outsider.cert_pem),
        "an expired certificate": expired_credentials(mesh),
    }[who]
    before = daemon_a.handshake_failures()
    with PeerClient(daemon_a.address, timeout=5.0, credentials=credentials) as client:
        with pytest.raises(PeerError):
            fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids), deadline=10)
    daemon_a.wait_for_more_handshake_failures(before)
    transfers = stats(daemon_a, mesh)
    assert transfers.fetches_started == 0 and transfers.chunk_bytes_sent == 0


def test_a_replayed_call_is_refused(mesh, served, daemon_a, prompt_ids):
    manifest, fp = served
    relay = Relay(daemon_a.address)
    try:
        with PeerClient(relay.address, credentials=creds(mesh, "b")) as client:
            fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
    finally:
        relay.close()
    captured = bytes(relay.to_server)
    after_fetch = stats(daemon_a, mesh)
    before = daemon_a.handshake_failures()

    host, port = daemon_a.address.rsplit(":", 1)
    answer = bytearray()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(captured)
        try:
            while data := s.recv(1 << 16):
                answer += data
        except (TimeoutError, ConnectionResetError):
            pass
    daemon_a.wait_for_more_handshake_failures(before)
    replayed = stats(daemon_a, mesh)
    assert replayed.fetches_started == after_fetch.fetches_started
    assert replayed.chunk_bytes_sent == after_fetch.chunk_bytes_sent
    assert len(answer) < 16384  # a handshake and an alert, no payload


def test_rotated_certificates_keep_the_mesh(mesh, served, daemon_a, prompt_ids):
    manifest, fp = served
    old = creds(mesh, "b")
    # b was admitted before A's daemon ran: it learns where the authority takes renewals.
    write_authority(mesh / "b", join_address(mesh / "a"), node_id(mesh / "a"))
    renewed = renew(mesh / "b", node_id(mesh / "b"))  # signed by A's daemon: b has no CA key
    assert renewed.cert_pem != old.cert_pem and renewed.expires >= old.expires
    with PeerClient(daemon_a.address, credentials=renewed) as client:
        assert (
            fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids)).manifest.cache_id
            == manifest.cache_id
        )


def test_an_ending_certificate_is_renewed_when_due_and_loading_never_writes(tmp_path):
    data = tmp_path / "e"
    init_mesh(data, node_id(data))  # the authority renews its own; members ask it (test_membership)
    ca = mesh_dir(data)
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=25)
    key, cert = issue_node_cert(
        (ca / "ca.key").read_bytes(), (ca / "trust.pem").read_bytes(), node_id(data), not_before=start, days=30
    )
    (ca / "node.key").write_bytes(key)
    (ca / "node.pem").write_bytes(cert)
    assert load_credentials(data).cert_pem == cert  # loading alone (`mesh status`) writes nothing
    loaded = renew_if_due(data, node_id(data))
    assert loaded.expires - datetime.datetime.now(datetime.timezone.utc) > datetime.timedelta(days=29)
    assert x509.load_pem_x509_certificate(loaded.cert_pem).subject.rfc4514_string() == f"CN={node_id(data)}"


def test_a_bad_token_or_an_old_bundle_is_a_clear_error(tmp_path, mesh):
    for given in ("kvmesh-join-v1:bm90IGpzb24=", "kvmesh-mesh-v1:bm90IGpzb24="):
        with pytest.raises(CredentialsError, match="not a kvmesh join token"):
            join_mesh(tmp_path / "x", "0123456789abcdef", given, "127.0.0.1")
    assert not mesh_dir(tmp_path / "x").exists()
    with pytest.raises(
        CredentialsError, match="the mesh CA key no longer leaves the authority: run `kvmesh mesh token`"
    ):
        export_bundle(mesh / "a")


def test_the_mesh_key_is_private_to_its_owner_and_stays_with_the_authority(mesh):
    for name in ("ca.key", "node.key"):
        assert (mesh_dir(mesh / "a") / name).stat().st_mode & 0o077 == 0
    for member in ("b", "d"):
        assert not (mesh_dir(mesh / member) / "ca.key").exists()
        assert (mesh_dir(mesh / member) / "node.key").stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_without_credentials_a_daemon_serves_loopback_only_and_says_so(tmp_path):
    daemon = Daemon(tmp_path / "lonely", "--interface", "192.0.2.1")
    try:
        assert daemon.state.mode == "loopback only, no mesh credentials"
        assert [a.rsplit(":", 1)[0] for a in daemon.state.listen] == ["127.0.0.1"]
        # (the banner follows daemon.json, which the start waited for)
        banner = "(loopback only, no mesh credentials) serving on 127.0.0.1:"
        wait_for(lambda: banner in daemon.log.read_text(), seconds=10, what="the banner")
    finally:
        daemon.stop()
    assert "no mesh credentials: serving loopback only, not 192.0.2.1" in daemon.log.read_text()


@pytest.mark.slow
def test_policy_limits_what_is_shared_and_who_publishes(mesh, served, tmp_path, prompt_ids):
    manifest, fp = served
    b, d = node_id(mesh / "b"), node_id(mesh / "d")
    daemon = Daemon(mesh / "a", "--share-model", "0000000000000000", "--publisher", b)
    try:
        with PeerClient(daemon.address, credentials=creds(mesh, "b")) as client:
            assert client.info().model_ids == [] and client.lookup(fp.model_id, prompt_ids) == []
            with pytest.raises(PeerError, match="not_found"):
                fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids))
        # d is a member but not a publisher: read-only here.
        publish_from = CacheStore(tmp_path / "d-store")
        small = publish_from.add(*encode_cache(small_cache(), fp, prompt_ids[:64], options=NONE))
        with PeerClient(daemon.address, credentials=creds(mesh, "d")) as client:
            with pytest.raises(CacheRejected, match=f"does not accept publishes from {d}") as refused:
                client.publish(publish_from, small.cache_id)
            assert refused.value.rejection.reason_name == "policy"
        with PeerClient(daemon.address, credentials=creds(mesh, "b")) as client:
            assert client.publish(publish_from, small.cache_id) == small.cache_id
    finally:
        daemon.stop()
    assert f"refused a publish from {d}" in daemon.log.read_text()


def small_cache() -> list:
    """A 64-token cache in the tiny geometry (4 layers, 2 kv heads of 64)."""
    return [SparseKVCache.from_arrays(mx.ones((1, 2, 64, 64)), mx.ones((1, 2, 64, 64)), 64) for _ in range(4)]


def raw_publish(address: str, credentials: MeshCredentials, manifest: pb.CacheManifest, frames=()) -> list:
    """Publish a manifest, then hand-made frames, as a hostile peer would; returns the responses."""
    first = spb.PublishRequest(manifest=manifest, protocol_version=PROTOCOL_VERSION)
    with open_channel(address, credentials) as channel:
        call = channel.stream_stream(
            method("Publish"), request_serializer=serialize, response_deserializer=spb.PublishResponse.FromString
        )
        return list(call(iter([first, *frames]), timeout=20))


def lying(manifest: pb.CacheManifest, lie) -> pb.CacheManifest:
    copy = pb.CacheManifest()
    copy.CopyFrom(manifest)
    lie(copy)
    return copy


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads daemon memory from /proc")
def test_hostile_input_is_refused_while_members_are_served(mesh, served, tiny, tmp_path, prompt_ids):
    manifest, fp = served
    # A cache the daemon does not hold, larger than its publish limit (one it holds is sent nothing).
    longer = [*prompt_ids, *prompt_ids[:64]]
    encoded = encode_cache(prefill(tiny[0], longer).cache, fp, longer, options=NONE)
    for _ in encoded.chunks:  # (the manifest's sizes and digest are filled in as the chunks go)
        pass
    unheld = encoded.manifest
    env = {**ENV, "KVMESH_MAX_PUBLISH_BYTES": str(manifest.encoding.raw_bytes - 1)}
    daemon = Daemon(mesh / "a", "--idle-timeout", "1", "--peer-rate", "20", env=env)
    attacker, member = creds(mesh, "d"), creds(mesh, "b")
    good_fetches, errors, stop = [], [], threading.Event()

    def well_behaved():
        """A member fetching ten times a second, within its rate, throughout the attack."""
        with PeerClient(daemon.address, credentials=member) as client:
            while not stop.wait(0.1):
                try:
                    good_fetches.append(
                        fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids)).wire_bytes
                    )
                except PeerError as e:
                    errors.append(e)

    stored_before = {e.cache_id for e in CacheStore(mesh / "a" / "store").entries()}
    try:
        baseline = rss(daemon.process.pid)
        worker = threading.Thread(target=well_behaved)
        worker.start()

        def publish(m):
            return raw_publish(daemon.address, attacker, m)[0].decision

        refusals = {
            "a billion layers": publish(lying(manifest, lambda m: setattr(m, "num_layers", 10**9))),
            "terabytes claimed": publish(lying(manifest, lambda m: setattr(m.encoding, "raw_bytes", 1 << 40))),
            "a negative shape": publish(
                lying(manifest, lambda m: m.layers[0].tensors[0].shape.__setitem__(0, 2**64 - 1))
            ),
            "over the publish limit": publish(unheld),
        }
        for what, decision in refusals.items():
            assert not decision.accept, what
        assert refusals["over the publish limit"].reason == pb.REJECT_REASON_SIZE_LIMIT

        # A consistent manifest under the limit, then garbage where the chunks should be.
        # (of other tokens than the policy test's, which A may hold already: one it holds is sent nothing)
        small = CacheStore(tmp_path / "small").add(*encode_cache(small_cache(), fp, prompt_ids[64:128], options=NONE))
        garbage = [Chunk(i, 0, 0, 4096, 0, os.urandom(4096)).frame() for i in range(3)]
        with pytest.raises(grpc.RpcError) as e:
            raw_publish(daemon.address, attacker, small, garbage)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS

        # A message over gRPC's size limit is refused by gRPC itself.
        with pytest.raises(grpc.RpcError) as e:
            raw_publish(daemon.address, attacker, small, [bytes(MAX_MESSAGE_BYTES + 1)])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # Slow loris: open a fetch, read the manifest, never decide. The stream is cut.
        release = threading.Event()

        def stalled():
            yield spb.FetchRequest(open=spb.FetchOpen(cache_id=manifest.cache_id, protocol_version=PROTOCOL_VERSION))
            release.wait()

        with open_channel(daemon.address, attacker) as channel:
            call = service_pb2_grpc.KvMeshStub(channel).Fetch(stalled(), timeout=30)
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            release.set()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no decision within 1 s" in e.value.details()

        # More transfers at once than a peer may run: two stalled streams hold its two slots.
        gate = threading.Event()

        def holding():
            yield spb.FetchRequest(open=spb.FetchOpen(cache_id=manifest.cache_id, protocol_version=PROTOCOL_VERSION))
            gate.wait()

        with open_channel(daemon.address, attacker) as channel:
            stub = service_pb2_grpc.KvMeshStub(channel)
            held = [stub.Fetch(holding(), timeout=30) for _ in range(2)]
            for call in held:
                assert next(call).WhichOneof("msg") == "manifest"  # both hold a transfer now
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Fetch(holding(), timeout=30))
            gate.set()
            for call in held:
                call.cancel()
        assert (
            e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2 transfers per peer" in e.value.details()
        )

        # A flood of calls: the attacker is held to its rate.
        codes = []
        with PeerClient(daemon.address, credentials=attacker) as client:
            flood_start = time.monotonic()
            for _ in range(150):
                try:
                    client.info()
                    codes.append("ok")
                except PeerError as error:
                    codes.append(error.code)
            elapsed = time.monotonic() - flood_start
        # A bucket of 40 (twice the rate) refilled at 20 calls/s: no more may get through.
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert codes.count("ok") <= 40 + 20 * elapsed + 1
        stop.set()
        worker.join()
        # After the attack, members are served as before.
        with PeerClient(daemon.address, credentials=member) as client:
            assert (
                fetch_cache(client, manifest.cache_id, ReceiverProfile(fp, prompt=prompt_ids)).manifest.cache_id
                == manifest.cache_id
            )
    finally:
        stop.set()
        worker.join()
        grown = rss(daemon.process.pid) - baseline
        daemon.stop()
    assert errors == [] and len(good_fetches) >= 3 and set(good_fetches) == {manifest.encoding.encoded_bytes}
    assert grown < 200 << 20, f"the daemon grew by {grown >> 20} MB during the attack"
    assert {e.cache_id for e in CacheStore(mesh / "a" / "store").entries()} == stored_before  # nothing got in
    log = daemon.log.read_text()
    assert "refused a publish from" in log and "no decision within 1 s: stream cut" in log and "over its rate" in log


@pytest.mark.slow
def test_a_member_refuses_an_impostor_daemon(mesh):
    impostor = Daemon(mesh / "c")  # a daemon of another mesh, where B might expect a peer
    try:
        with PeerClient(impostor.address, timeout=5.0, credentials=creds(mesh, "b")) as client:
            with pytest.raises(PeerError, match="CERTIFICATE_VERIFY_FAILED"):
                client.info()
    finally:
        impostor.stop()


def test_a_connection_that_never_starts_tls_is_cut(daemon_a):
    host, port = daemon_a.address.rsplit(":", 1)
    start = time.monotonic()
    # Waiting six handshake timeouts for the cut: a loaded machine is late, never early.
    with socket.create_connection((host, int(port)), timeout=6 * TIMEOUTS.handshake) as s:
        s.sendall(b"\x16\x03")  # the first bytes of a TLS record, then nothing
        assert s.recv(1024) == b""  # the daemon closes the connection (a socket timeout if never)...
    assert time.monotonic() - start >= 0.9 * TIMEOUTS.handshake  # ...once its handshake timeout ends
