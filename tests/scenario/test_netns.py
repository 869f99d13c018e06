"""Three hosts in network namespaces on one bridge: discovery, a fetch, a crash and a partition.

Needs root and iproute2; skipped otherwise. Every name carries this run's prefix, and teardown
removes exactly what the test made, also when it fails. Nothing touches the host's own network.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time
from importlib import resources

import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.codec.encode import encode_cache
from kvmesh.daemon.control import DaemonProcess
from kvmesh.net.node_id import node_id
from kvmesh.store import CacheStore
from support import namespaces
from support.daemons import start_daemon
from support.mesh import make_mesh
from support.processes import cli
from support.references import greedy_tokens
from support.waiting import wait_for

MISSING = namespaces.missing("ip")  # the bridge needs no tc
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
PORT = 7077


class Lan(namespaces.Bridge):
    """The bridge's hosts as kvmesh nodes, each with its data dir under `root`."""

    def __init__(self, root, prefix: str, size: int):
        super().__init__(prefix, size)
        self.root = root
        self.daemons: dict[int, DaemonProcess] = {}

    def kvmesh(self, i: int, *args, check=True) -> subprocess.CompletedProcess:
        return cli(*args, data_dir=self.root / f"n{i}", check=check, prefix=self.in_node(i))

    def start(self, i: int):
        daemon = start_daemon(
            self.root / f"n{i}",
            "--interface",
            self.address(i),
            "--port",
            PORT,
            "--health-interval",
            "0.5",
            log=self.root / f"n{i}.log",
            command=self.in_node(i),
        )
        assert daemon.state.mode == "mutual TLS", f"daemon n{i} did not start as a mesh member; see {daemon.log}"
        self.daemons[i] = daemon

    def live_peers(self, i: int) -> set[str]:
        return {p["addresses"][0] for p in json.loads(self.kvmesh(i, "peers", "--json").stdout)}

    def wait_until(self, i: int, predicate, seconds: float) -> float:
        """Poll node i's live peers (another process, another namespace) until `predicate` holds."""
        start = time.monotonic()
        while not predicate(peers := self.live_peers(i)):
            assert time.monotonic() - start < seconds, f"n{i} sees {peers} after {seconds} s"
            time.sleep(0.2)
        return time.monotonic() - start


@pytest.fixture
def lan(tmp_path):
    with Lan(tmp_path, f"kvm{os.getpid() % 100000}", 3) as network:
        yield network


def test_three_hosts_discover_fetch_crash_and_partition(lan, tiny, tiny_dir, tiny_fp, tmp_path):
    # One mesh: made on n1, its members' certificates signed there (without one a daemon serves
    # loopback only; joining itself is the membership tests' to test).
    make_mesh(tmp_path / "n1", tmp_path / "n2", tmp_path / "n3")
    for i in lan.nodes:
        lan.start(i)
    everyone = {f"{lan.address(i)}:{PORT}" for i in lan.nodes}
    for i in lan.nodes:
        lan.wait_until(i, lambda peers, i=i: peers == everyone - {f"{lan.address(i)}:{PORT}"}, seconds=20)

    # A fetch across the bridge: n1 holds the document's cache, n2 generates from it.
    model, tokenizer = tiny
    document = tmp_path / "doc.txt"
    document.write_text(resources.files("kvmesh").joinpath("data/corpus.txt").read_text()[:2000])
    doc_tokens = tokenizer.encode(document.read_text())
    CacheStore(tmp_path / "n1" / "store").add(*encode_cache(prefill(model, doc_tokens).cache, tiny_fp, doc_tokens))
    out = json.loads(
        lan.kvmesh(
            2,
            "generate",
            str(tiny_dir),
            "--file",
            str(document),
            "--prompt",
            " Why?",
            "--max-tokens",
            "8",
            "--json",
            "--fetch",
            "always",
        ).stdout
    )
    assert out["prefix_from"] == f"peer {lan.address(1)}:{PORT}" and out["prefix_tokens"] == len(doc_tokens)
    prompt = doc_tokens + tokenizer.encode(" Why?", add_special_tokens=False)
    assert out["tokens"] == greedy_tokens(model, prompt, 8)

    # A crash: n3's daemon is SIGKILLed; n1 drops it within seconds.
    lan.daemons[3].process.send_signal(signal.SIGKILL)
    lan.daemons[3].process.wait()
    lan.wait_until(1, lambda peers: f"{lan.address(3)}:{PORT}" not in peers, seconds=10)

    # A partition: n2's link goes down at the bridge; n1 drops it, then sees it again after repair.
    namespaces.ip("-n", lan.hub, "link", "set", "veth2", "down")
    lan.wait_until(1, lambda peers: f"{lan.address(2)}:{PORT}" not in peers, seconds=15)
    namespaces.ip("-n", lan.hub, "link", "set", "veth2", "up")
    lan.wait_until(1, lambda peers: f"{lan.address(2)}:{PORT}" in peers, seconds=15)


def test_a_removal_reaches_the_hosts_at_once_and_their_logs_name_the_mac_that_sent_it(lan, tmp_path):
    """n1 (the authority) removes n3 with the default revocation interval: n2 and n3 hear of it from
    n1's push, and n2's log names n1's own address as the sender, not the guard that relays the
    peer port's connections to gRPC (127.0.0.1)."""
    make_mesh(tmp_path / "n1", tmp_path / "n2", tmp_path / "n3")
    for i in lan.nodes:
        lan.start(i)
    everyone = {f"{lan.address(i)}:{PORT}" for i in lan.nodes}
    lan.wait_until(1, lambda peers: peers == everyone - {f"{lan.address(1)}:{PORT}"}, seconds=20)
    removed = node_id(tmp_path / "n3")
    out = lan.kvmesh(1, "mesh", "remove", removed).stdout
    assert "sent the list to 2 of 2 live members" in out
    pushed = re.compile(rf"revocation list version 1 from peer ipv4:{re.escape(lan.address(1))}:\d+, pushed")
    wait_for(lambda: pushed.search(lan.daemons[2].log.read_text()), 10, what="n2 to take n1's push")
    said = f"this node ({removed}) was removed from the mesh by its authority"
    wait_for(lambda: said in lan.daemons[3].log.read_text(), 10, what="n3 to say it was removed")


class TwoLinks(namespaces.Namespaces):
    """Two hosts joined by two links, as a Mac on Wi-Fi and on a Thunderbolt bridge: eth0
    (10.78.0.0/24) and eth1 (10.79.0.0/24), each limited with tbf on the server's side."""

    def __init__(self, prefix: str):
        self.server, self.client = f"{prefix}-s", f"{prefix}-c"

    def names(self) -> list[str]:
        return [self.server, self.client]

    def address(self, host: str, link: int) -> str:
        return f"10.{78 + link}.0.{1 if host == 's' else 2}"

    def up(self) -> None:
        for ns in (self.server, self.client):
            namespaces.ip("netns", "add", ns)
            namespaces.ip("-n", ns, "link", "set", "lo", "up")
        for link in (0, 1):
            device = f"eth{link}"
            namespaces.ip(
                "-n", self.server, "link", "add", device, "type", "veth", "peer", "name", device, "netns", self.client
            )
            for ns, host in ((self.server, "s"), (self.client, "c")):
                namespaces.ip("-n", ns, "addr", "add", f"{self.address(host, link)}/24", "dev", device)
                namespaces.ip("-n", ns, "link", "set", device, "up")

    def shape(self, device: str, rate: str) -> None:
        namespaces.run(
            "tc", "-n", self.server, "qdisc", "replace", "dev", device, "root", "tbf",
            "rate", rate, "burst", "32kb", "latency", "50ms",
        )  # fmt: skip


def test_a_peer_on_two_links_is_reached_over_the_fast_one_and_the_slow_one_when_it_fails(
    tiny, tiny_dir, tiny_fp, tmp_path
):
    if namespaces.missing("ip", "tc"):
        pytest.skip(str(namespaces.missing("ip", "tc")))
    server, client = tmp_path / "s", tmp_path / "c"
    make_mesh(server, client)
    model, tokenizer = tiny
    text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    documents = []
    for i in (0, 1):  # one document per fetch: a fetched cache is kept, and the next would be local
        document = tmp_path / f"doc{i}.txt"
        document.write_text(text[i * 2000 : i * 2000 + 1500])
        tokens = tokenizer.encode(document.read_text())
        CacheStore(server / "store").add(*encode_cache(prefill(model, tokens).cache, tiny_fp, tokens))
        documents.append(document)
    with TwoLinks(f"kvl{os.getpid() % 100000}") as links:
        # The slow link is the first advertised: only measuring finds the fast one.
        links.shape("eth0", "20mbit")
        links.shape("eth1", "200mbit")
        slow, fast = (f"{links.address('s', i)}:{PORT}" for i in (0, 1))
        for host, namespace in (("s", links.server), ("c", links.client)):
            interfaces = [arg for i in (0, 1) for arg in ("--interface", links.address(host, i))]
            start_daemon(
                tmp_path / host, *interfaces, "--port", PORT, "--health-interval", "0.5",
                log=tmp_path / f"{host}.log", command=namespaces.inside(namespace),
            )  # fmt: skip

        def peers() -> list[list[str]]:
            out = cli("peers", "--json", data_dir=client, prefix=namespaces.inside(links.client)).stdout
            return [p["addresses"] for p in json.loads(out)]

        def fetched_from(document) -> str:
            args = [
                "generate",
                str(tiny_dir),
                "--file",
                str(document),
                "--max-tokens",
                "2",
                "--json",
                "--fetch",
                "always",
            ]
            out = cli(*args, data_dir=client, prefix=namespaces.inside(links.client)).stdout
            return json.loads(out)["prefix_from"]

        wait_for(lambda: peers() == [[fast, slow]], seconds=30, what="the fast link chosen of both")
        measured = r"[\d.]+ ms, [\d.,]+ MB/s"
        both = rf"{re.escape(fast)} \(in use: {measured}\), {re.escape(slow)} \({measured}\)"
        host = socket.gethostname().removesuffix(".local")  # the peer's machine, from its Info
        shown = ""

        def listed() -> bool:  # (each link is shown once a probe measured it, and while it answers)
            nonlocal shown
            shown = cli("peers", data_dir=client, prefix=namespaces.inside(links.client)).stdout
            return bool(re.search(both, shown)) and f"  {host}  " in shown

        wait_for(listed, seconds=30, what="both links measured and the peer's host name in `kvmesh peers`")
        [peer] = json.loads(cli("peers", "--json", data_dir=client, prefix=namespaces.inside(links.client)).stdout)
        rates = {link["address"]: link["bytes_per_s"] for link in peer["links"]}
        assert rates[fast] > 2 * rates[slow] > 0, shown
        assert fetched_from(documents[0]) == f"peer {fast}"
        explained = cli(
            "generate", str(tiny_dir), "--file", str(documents[0]), "--max-tokens", "1", "--explain",
            data_dir=client, prefix=namespaces.inside(links.client),
        ).stderr  # fmt: skip
        in_use = rf"{re.escape(fast)} \(in use: {measured}\)"  # (the slow one may miss a check meanwhile)
        assert re.search(rf"link: {peer['node_id']} \({re.escape(host)}\): {in_use}, {re.escape(slow)}", explained)
        namespaces.ip("-n", links.server, "link", "set", "eth1", "down")  # the fast link is cut
        wait_for(lambda: peers() == [[slow, fast]], seconds=20, what="the slow link chosen")
        assert fetched_from(documents[1]) == f"peer {slow}"
