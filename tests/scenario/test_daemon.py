"""Real daemon processes on 127.0.0.1: discovery over real mDNS, generation across peers, shutdown."""

import json
import os
import plistlib
import signal
import socket
import sys
import threading
import time
from importlib import resources

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.daemon.process import stop_signals
from kvmesh.net.client import PeerClient
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.store import CacheStore
from support.processes import cli
from support.references import greedy_tokens

# Its daemons find each other over mDNS on 127.0.0.1, where every test's daemons would hear them.
pytestmark = pytest.mark.lan


def kvmesh(data_dir, *args, check=True):
    return cli(*args, data_dir=data_dir, check=check)


class Nodes:
    """Named daemons of one test on 127.0.0.1, with mDNS unless told otherwise, each in its own data
    dir under `root`; the `daemons` fixture stops them at the end."""

    def __init__(self, root, daemons):
        self.root, self.daemons, self.processes = root, daemons, {}

    def start(self, name, *args) -> str:
        daemon = self.daemons.start(self.root / name, *args, discovery=True, log=self.root / f"{name}.log")
        self.processes[name] = daemon.process
        return daemon.address

    def peers(self, name, all=False) -> list[dict]:
        return json.loads(kvmesh(self.root / name, "peers", "--json", *(["--all"] if all else [])).stdout)

    def wait_for_peers(self, name, predicate, seconds=15.0):
        """Poll a daemon's peer list (it lives in another process) until `predicate` holds."""
        deadline = time.monotonic() + seconds
        while not predicate(peers := self.peers(name)):
            assert time.monotonic() < deadline, f"{name} never saw the expected peers; it has {peers}"
            time.sleep(0.2)
        return peers


@pytest.fixture
def nodes(tmp_path, daemons):
    return Nodes(tmp_path, daemons)


def node_id(data_dir) -> str:
    return (data_dir / "node-id").read_text().strip()


def test_daemons_find_each_other_and_generate_uses_a_peers_cache(nodes, tiny, tiny_dir, tmp_path):
    address_a = nodes.start("A")
    nodes.start("B")
    peers = nodes.wait_for_peers("B", lambda p: len(p) == 1)
    assert peers[0]["node_id"] == node_id(tmp_path / "A") and peers[0]["addresses"] == [address_a]
    assert peers[0]["found_by"] == "mdns"

    document = tmp_path / "doc.txt"
    document.write_text(resources.files("kvmesh").joinpath("data/corpus.txt").read_text()[:3000])
    stored = json.loads(kvmesh(tmp_path / "A", "prefill", str(tiny_dir), "--file", str(document), "--json").stdout)

    def generate_on_b() -> dict:
        args = ["--file", document, "--prompt", " What does this test check?", "--max-tokens", 12, "--json"]
        return json.loads(kvmesh(tmp_path / "B", "generate", tiny_dir, *args, "--fetch", "always").stdout)

    out = generate_on_b()
    assert out["prefix_from"] == f"peer {address_a}" and out["prefix_tokens"] == stored["tokens"]
    assert out["wire_bytes"] > 0 and out["skipped"] == []

    model, tokenizer = tiny
    tokens = tokenizer.encode(document.read_text()) + tokenizer.encode(
        " What does this test check?", add_special_tokens=False
    )
    reference = greedy_tokens(model, tokens, 12)
    assert out["tokens"] == reference

    # B kept what it fetched: the same request is now served from its own store.
    again = generate_on_b()
    assert again["prefix_from"] == "local store" and again["tokens"] == reference


def test_a_killed_peer_is_dropped_within_seconds(nodes, tmp_path):
    nodes.start("A")
    nodes.start("B")
    nodes.wait_for_peers("B", lambda p: len(p) == 1)
    nodes.processes["A"].send_signal(signal.SIGKILL)
    nodes.processes["A"].wait()
    nodes.wait_for_peers("B", lambda p: p == [], seconds=10)  # within seconds: mDNS would keep it for minutes
    [lost] = nodes.peers("B", all=True)
    assert lost["node_id"] == node_id(tmp_path / "A") and not lost["healthy"]


def test_a_stopped_peer_says_goodbye(nodes, tmp_path):
    nodes.start("A")
    nodes.start("B")
    nodes.wait_for_peers("B", lambda p: len(p) == 1)
    nodes.processes["A"].terminate()
    assert nodes.processes["A"].wait(timeout=30) == 0
    nodes.wait_for_peers("B", lambda p: p == [], seconds=10)
    # A goodbye removes the peer entirely, not just from the live list.
    assert nodes.peers("B", all=True) == []


def test_static_peers_work_without_discovery(nodes, tmp_path):
    address_a = nodes.start("A", "--no-discovery")
    nodes.start("B", "--no-discovery", "--peer", address_a)
    [peer] = nodes.wait_for_peers("B", lambda p: len(p) == 1 and p[0]["healthy"] and p[0]["host_name"])
    assert peer["addresses"] == [address_a] and peer["found_by"] == "static"
    # Its Info names its machine; its one link is health checked (round trip), not probed.
    assert peer["host_name"] == socket.gethostname().removesuffix(".local")
    [link] = peer["links"]
    assert link["address"] == address_a and link["answers"] and link["rtt_ms"] > 0 and link["bytes_per_s"] == 0


def test_sigterm_during_a_transfer_finishes_it_and_a_restart_keeps_store_and_node(nodes, tiny_fp, tiny, tmp_path):
    cache = prefill(tiny[0], [i % 400 + 4 for i in range(3000)]).cache
    tokens = [i % 400 + 4 for i in range(3000)]
    options = EncodeOptions(codec="none", chunk_size=16 << 10)
    manifest = CacheStore(tmp_path / "A" / "store").add(*encode_cache(cache, tiny_fp, tokens, options=options))
    address = nodes.start("A", "--no-discovery")
    node = node_id(tmp_path / "A")
    process = nodes.processes["A"]
    signalled = threading.Event()

    def sigterm_once(received, total):
        if not signalled.is_set():
            process.send_signal(signal.SIGTERM)
            signalled.set()

    with PeerClient(address) as client:
        fetched = fetch_cache(client, manifest.cache_id, ReceiverProfile(tiny_fp, prompt=tokens), progress=sigterm_once)
    assert signalled.is_set() and fetched.manifest.cache_id == manifest.cache_id
    assert process.wait(timeout=30) == 0
    assert not (tmp_path / "A" / "daemon.json").exists()
    log = (tmp_path / "A.log").read_text()
    assert "shutting down" in log and "stopped" in log

    nodes.start("A", "--no-discovery")
    assert node_id(tmp_path / "A") == node
    status = json.loads(kvmesh(tmp_path / "A", "status", "--json").stdout)
    assert status["info"]["node_id"] == node and status["info"]["store"]["entries"] == 1


def test_stop_signals_are_noted_end_the_wait_and_leave_the_handlers_as_they_were():
    """The daemon's wait for SIGTERM or SIGINT (stop_signals): signals that come one after another,
    before the wait as after it, end it; the process's handlers and wakeup fd come back after."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_signals() as stopped:
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)  # a signal handled while another one's handler runs: it only notes it
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        stopped()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert signal.set_wakeup_fd(-1) == -1  # (none was set before, none is left)


def test_a_daemon_sent_sigterm_again_and_again_stops(nodes, tmp_path):
    nodes.start("A", "--no-discovery")
    process = nodes.processes["A"]
    for _ in range(200):  # as `terminate` then `stop` do, and a person pressing ^C twice
        if process.poll() is not None:
            break
        process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert "stopped" in (tmp_path / "A.log").read_text()


@pytest.mark.slow
def test_cli_without_a_daemon_says_so(tmp_path):
    result = kvmesh(tmp_path / "none", "peers", check=False)
    assert result.returncode == 1
    assert (
        result.stderr
        == f"kvmesh: error: no kvmesh daemon is running for {tmp_path / 'none'} (start one with `kvmesh daemon`)\n"
    )


@pytest.mark.slow
def test_service_files(tmp_path):
    plist = plistlib.loads(kvmesh(tmp_path, "service", "--platform", "macos", "--print").stdout.encode())
    assert plist["Label"] == "dev.kvmesh.daemon"
    # The data dir the user chose is the one the service runs on.
    daemon = [sys.executable, "-m", "kvmesh", "--data-dir", str(tmp_path), "daemon", "--log-format", "json"]
    assert plist["ProgramArguments"] == daemon
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    # launchd's default of 256 descriptors is too few for a daemon with many peers.
    assert plist["SoftResourceLimits"] == plist["HardResourceLimits"] == {"NumberOfFiles": 4096}
    unit = tmp_path / "kvmesh.service"
    out = kvmesh(tmp_path, "service", "--platform", "linux", "--output", str(unit)).stdout
    assert "systemctl --user" in out
    text = unit.read_text()
    assert f"ExecStart={' '.join(daemon)}\n" in text and "Restart=on-failure" in text and "LimitNOFILE=4096" in text


def test_a_service_written_without_a_data_dir_uses_the_platform_one():
    from kvmesh.daemon.service_files import service_file

    _, content, _ = service_file("linux")
    assert f"ExecStart={sys.executable} -m kvmesh daemon --log-format json\n" in content.decode()


def test_the_advert_carries_ids_only(nodes, tmp_path):
    from zeroconf import Zeroconf

    from kvmesh.net.discovery.mdns import SERVICE_TYPE

    address = nodes.start("A")
    zc = Zeroconf(interfaces=["127.0.0.1"])
    try:
        info = zc.get_service_info(SERVICE_TYPE, f"{node_id(tmp_path / 'A')}.{SERVICE_TYPE}", timeout=5000)
    finally:
        zc.close()
    assert info is not None and f"127.0.0.1:{info.port}" == address
    properties = {k.decode(): v.decode() for k, v in info.properties.items()}
    assert set(properties) == {"id", "pv", "v", "tls"}
    assert properties["id"] == node_id(tmp_path / "A") and properties["tls"] == "0"
    assert len(info.text) < 400


def test_link_local_ipv6_addresses_are_dialled_with_their_scope_or_left_out():
    import socket

    from kvmesh.net.discovery.interfaces import dial_address

    loopback = socket.if_indextoname(1)
    assert dial_address("192.168.1.20", 7000) == "192.168.1.20:7000"
    assert dial_address("2001:db8::5", 7000) == "[2001:db8::5]:7000"
    # fe80::/10 exists on every link: without the interface it was heard on it cannot be dialled.
    assert dial_address("fe80::1c2:3ff:fe4d:5e6f", 7000) is None
    assert dial_address("fe80::1c2:3ff:fe4d:5e6f%1", 7000) == f"[fe80::1c2:3ff:fe4d:5e6f%{loopback}]:7000"
    assert dial_address("fe80::1%en0", 7000) == "[fe80::1%en0]:7000"
    assert dial_address("not-an-address", 7000) is None


def test_the_daemon_raises_its_descriptor_limit_as_its_service_files_do():
    import resource

    from kvmesh.daemon.limits import raise_descriptor_limit
    from kvmesh.daemon.service_files import OPEN_FILES

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = before[1]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # macOS's default for a terminal's processes
        wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
        assert raise_descriptor_limit() == wanted == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


@pytest.mark.slow
def test_a_peer_that_has_not_joined_is_named_so_not_as_an_ssl_error(tmp_path):
    from support.daemons import loopback_daemon
    from support.mesh import make_mesh
    from support.waiting import wait_for

    make_mesh(tmp_path / "member")
    plain = loopback_daemon(tmp_path / "plain")  # no mesh credentials: it answers in plain text
    member = loopback_daemon(tmp_path / "member", "--peer", plain.address, "--health-interval", "0.3")
    try:
        log = tmp_path / "member" / "daemon.log"
        said = f"at {plain.address} answers without TLS: it has not joined this mesh (`kvmesh mesh join` there)"
        wait_for(lambda: said in log.read_text(), seconds=60, what="the member's word on the peer")
    finally:
        member.stop()
        plain.stop()
    assert "WRONG_VERSION_NUMBER" not in log.read_text()
