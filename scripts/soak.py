#!/usr/bin/env python3
"""Fault-injection soak: several daemons on loopback, random faults, clients checking invariants.

    scripts/dev run python scripts/soak.py [--minutes 3] [--steps 400] [--daemons 3] [--seed 0]

Daemons (their own data dirs, static peers and mDNS on loopback, a store budget each; one store on a
24 MB tmpfs when this runs as root, so its disk can fill) are hit with random SIGKILL (then a
restart), SIGSTOP/SIGCONT, bytes flipped in store files and disk-full windows, while clients fetch,
publish, look up and generate. A stranger on the LAN sends spoofed mDNS adverts and goodbyes in the
daemons' names and holds idle connections to them; a misbehaving member answers lookups with bogus
candidates that stall, trickles the chunks it serves, and opens fetches it never opens or never
reads. After every step the invariants are checked: no wrong tokens ever (every generation equals
a full local prefill), stores verify (damage is quarantined, never served), budgets hold, daemon
memory stays bounded, no peer is bound to an address it does not own or dropped by a spoofed
goodbye, the mesh part of a generation keeps its time budget, a trickle is cut, and an unread
transfer frees its slot.

Beside them (issue 32): lying peers offer caches coded with a poisoned transform basis (NaN, inf or
huge numbers under the digest of their own bytes) and one announcing a 1 GiB basis: no daemon keeps
or passes one on, none is asked for past its bound, and generations that meet them still give the
right tokens. A mesh with mutual TLS (support.soak_mesh) has members joined and removed with the
`kvmesh mesh` commands; a removed member keeps running with its old certificate, and no member
lists it live or fetches from it after REMOVAL_INTERVALS health intervals. Strangers on 127.0.0.2
squat the authority's join port with idle Join and Renew calls, while a real join and a renewal
must still succeed. A `kvmesh serve` process gets clients that never read their streamed answers
(or read a byte a second) and big prompts just under its body limit, while /health and a small
request from another address must keep being answered and the server's memory stays bounded.

Bounded in steps and time; loopback only. Prints a summary; exits 1 if any invariant failed.
--only runs some of the actions (a comma-separated list of ACTIONS' names), for a short trial of them.
"""

import argparse
import collections
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import mlx_lm

from kvmesh.caches.prefill import prefill
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.daemon.control import DaemonProcess, control_status
from kvmesh.errors import KvmeshError, PeerError
from kvmesh.model.fingerprint import fingerprint
from kvmesh.model.testmodels import make_test_model
from kvmesh.net.client import PeerClient
from kvmesh.net.transport import method, serialize
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.generate import generate
from kvmesh.store import CacheStore
from kvmesh.v1 import control_pb2 as cpb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PROTOCOL_VERSION
from support import hostile_peer
from support.daemons import ServerProcess, start_daemon, start_server
from support.http_clients import SlowReader, big_prompt, health_from, never_reading, post_from, small_request_from
from support.poisoned_basis import Offer, PoisonedPeers
from support.processes import ENV, KVMESH, rss
from support.references import greedy_tokens, tokens_after
from support.soak_mesh import HEALTH, REMOVAL_INTERVALS, REVOCATION, SoakMesh, wait_until
from support.stranger import Stranger

BUDGET = 6 << 20
MAX_RSS = 1 << 30
# The daemons' sender idle limit (--idle-timeout), the mesh part's budget of each generation, and
# what one call in flight when the budget ends may add to it.
IDLE = 5.0
MESH_BUDGET = 5.0
OVERSHOOT = 3.0
# Each step's action, and how often it is drawn (disk-full windows only with a tmpfs).
ACTIONS = {
    "kill": 1, "stop": 1, "cont": 2, "damage": 1, "disk": 1, "fetch": 4, "publish": 2, "lookup": 3, "generate": 4,
    # A stranger on the LAN, and a misbehaving member.
    "spoof advert": 1, "spoof goodbye": 1, "idle connections": 1, "trickle": 1, "unread fetches": 1, "no open": 1,
    # Issue 32: lying peers, the mesh's membership, and the HTTP server's clients.
    "poisoned basis": 1, "removed member": 1, "join squatters": 1, "never-reading clients": 1, "big prompts": 1,
}  # fmt: skip
BIG_PROMPTS = ("text", "messages", "token ids")


class Node:
    def __init__(self, root: Path, name: str, disk: Path | None):
        self.name, self.data = name, root / name
        self.store_dir = (disk or self.data) / "store"
        self.log = root / f"{name}.log"
        self.daemon: DaemonProcess | None = None
        self.stopped = False
        self.disk = disk

    def start(self, peers: list[str], port: int = 0) -> None:
        args = [
            "--interface",
            "127.0.0.1",
            "--port",
            port,
            "--store",
            self.store_dir,
            "--store-budget",
            BUDGET,
            "--health-interval",
            "0.5",
            "--idle-timeout",
            IDLE,
        ]
        for peer in peers:
            args += ["--peer", peer]
        self.daemon = start_daemon(self.data, *args, log=self.log)
        self.stopped = False

    @property
    def address(self) -> str:
        assert self.daemon is not None
        return self.daemon.address

    def signal(self, sig: int) -> None:
        assert self.daemon is not None
        os.kill(self.daemon.process.pid, sig)

    @property
    def node_id(self) -> str:
        assert self.daemon is not None
        return self.daemon.state.node_id

    def mdns_peers(self) -> dict[str, list[str]]:
        """node id -> addresses of the peers this daemon found by mDNS (and bound, once proven)."""
        peers = control_status(self.data).peers
        return {p.node_id: list(p.addresses) for p in peers if p.source == cpb.PEER_SOURCE_MDNS}


class Misbehaviour:
    """The stranger and the misbehaving member of the soak, and the invariants they test."""

    def __init__(self, root: Path, trickle_store: Path):
        self.lan = Stranger()
        self.hostile, self.hostile_address = hostile_peer.start(root / "hostile", "--bogus", 6, "--stall", 9.5)
        self.trickler, self.trickle_address = hostile_peer.start(trickle_store, "--trickle", 8.5)
        self._holding: threading.Event | None = None

    def spoof_advert(self, victim: "Node") -> None:
        """An advert in `victim`'s name at the hostile peer's address."""
        host, port = self.hostile_address.rsplit(":", 1)
        self.lan.advertise(victim.node_id, host, int(port))

    def hold_connections(self, target: "Node", count: int = 100) -> None:
        """Idle connections to `target`, held until the next call (then released)."""
        if self._holding is not None:
            self._holding.set()
            self._holding = None
            return
        self._holding = threading.Event()
        threading.Thread(target=self.lan.hold, args=(target.address, count, self._holding), daemon=True).start()

    def close(self) -> None:
        if self._holding is not None:
            self._holding.set()
        self.lan.close()
        for process in (self.hostile, self.trickler):
            process.kill()
            process.wait()


def open_unread_fetches(address: str, cache_id: str, count: int) -> list:
    """`count` fetches of `cache_id` that accept the manifest and never read a chunk; their channels."""
    channels = []
    for _ in range(count):
        channel = grpc.insecure_channel(address)
        opened = [
            spb.FetchRequest(open=spb.FetchOpen(cache_id=cache_id, protocol_version=PROTOCOL_VERSION)),
            spb.FetchRequest(decision=spb.Decision(accept=True)),
        ]
        gate = threading.Event()

        def requests(opened=opened, gate=gate):
            yield from opened
            gate.wait(60)

        call = channel.stream_stream(method("Fetch"), request_serializer=serialize, response_deserializer=bytes)(
            requests(), timeout=60
        )
        channels.append((channel, call, gate))
    return channels


def slots_free_within(address: str, seconds: float) -> bool:
    """Whether the daemon at `address` runs no transfer within `seconds` (its slots were freed)."""
    deadline = time.monotonic() + seconds
    with PeerClient(address, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if client.info().transfers.transfers_active == 0:
                return True
            time.sleep(0.2)
    return False


# Issue 32's faults: lying peers with poisoned bases, a removed member that keeps serving, join-port
# squatters, and clients of `kvmesh serve` that never read or send big prompts.

# The serve process's limits (its body limit smaller than the default 32 MiB, so big prompts cost the
# shared CPUs seconds, not minutes), and how far its memory may grow over what it held once warm.
BODY_LIMIT = 8 << 20
SEND_TIMEOUT = 3.0
PER_ADDRESS = 12
SERVE_GROWTH = 768 << 20
OTHER = "127.0.0.2"  # the well-behaved client's address; the misbehaving ones call from 127.0.0.1


class Server:
    """A `kvmesh serve` of the tiny model (no mesh), restarted if it dies, and its memory bound."""

    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir = root, model_dir
        help_text = subprocess.run([KVMESH, "serve", "--help"], capture_output=True, text=True, env=ENV).stdout
        # The send timeout and per-address cap are being built (issue 32): without them the server
        # runs with what it has, and the invariants say whether that is enough.
        self.guarded = "--send-timeout" in help_text and "--max-connections-per-address" in help_text
        self.process: ServerProcess | None = None
        self.baseline = 0
        self.starts = 0
        self.start()

    def start(self) -> None:
        args: list[object] = ["--no-mesh", "--max-body-bytes", BODY_LIMIT, "--max-requests", 32]
        if self.guarded:
            args += ["--send-timeout", SEND_TIMEOUT, "--max-connections-per-address", PER_ADDRESS]
        self.starts += 1  # a log each, kept: one restarted for its memory is the evidence
        log = self.root / f"serve-{self.starts}.log"
        self.process = start_server(self.root / "serve", self.model_dir, *args, log=log)
        small_request_from(self.url, OTHER, 120)  # warm: the first request loads what the rest reuse
        self.baseline = max(self.baseline, rss(self.pid))

    @property
    def url(self) -> str:
        assert self.process is not None
        return self.process.url

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.process.pid

    def over_bound(self, peak: int = 0) -> bool:
        return max(peak, rss(self.pid, missing=0)) > self.baseline + SERVE_GROWTH

    def bounded(self, failures: collections.Counter, during: str, peak: int = 0) -> None:
        """The memory invariant (`peak`: the most seen meanwhile). A server over its bound is
        counted once and restarted, so that later steps test a fresh one rather than count it again
        (memory a process took is seldom given back)."""
        if self.over_bound(peak):
            failures[f"serve: memory more than {SERVE_GROWTH >> 20} MiB over its warm size {during}"] += 1
            self.close()
            self.start()

    def answers_others(self, failures: collections.Counter, during: str) -> None:
        """The invariants while misbehaving clients are at it: /health and a small request from
        another address are answered (its memory: `bounded`)."""
        if health_from(self.url, OTHER, 10) != 200:
            failures[f"serve: /health not answered {during}"] += 1
        if not small_request_from(self.url, OTHER, 60):
            failures[f"serve: a small request from another client not answered {during}"] += 1

    def close(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=60)


def never_reading_clients(server: Server, operations: collections.Counter, failures: collections.Counter) -> None:
    """A client reads its big streamed answer a byte a second, then PER_ADDRESS + 3 more from its
    address ask for theirs and never read them (the last few past the per-address cap); others must
    still be answered, and (with a send timeout) the slow reader is cut."""
    slow = SlowReader(server.url)  # first: within the cap, so it is answered, not refused
    stuck = []
    for _ in range(PER_ADDRESS + 3):
        try:
            stuck.append(never_reading(server.url))
        except OSError:  # refused at once (the address's cap): nothing of it stays
            operations["never-reading client refused at once"] += 1
    try:
        time.sleep(1.0)  # their answers are under way
        server.answers_others(failures, "while clients never read")
        if server.guarded and not slow.cut_within(SEND_TIMEOUT + 20):
            failures["serve: a byte-a-second reader not cut by the send timeout"] += 1
    finally:
        slow.close()
        for sock in stuck:
            sock.close()
    server.bounded(failures, "with never-reading clients")


def big_prompts(server: Server, kind: str, operations: collections.Counter, failures: collections.Counter) -> None:
    """Two prompts of `kind` just under the body limit at once from 127.0.0.1, while another client
    asks; each is answered (refused or not) without a server error, and memory stays bounded."""
    path, body = big_prompt(kind, BODY_LIMIT - 1024)
    answers: list[int] = []

    def send() -> None:
        answers.append(post_from(server.url, path, body, "127.0.0.1", 120)[0])

    senders = [threading.Thread(target=send) for _ in range(2)]
    for sender in senders:
        sender.start()
    peak = [0]

    def sample() -> None:  # the most memory the server holds while the prompts are in
        while any(s.is_alive() for s in senders):
            peak[0] = max(peak[0], rss(server.pid, missing=0))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        time.sleep(0.5)  # their bodies are arriving or being read
        server.answers_others(failures, "while big prompts arrive")
    finally:
        sampler.join()
    server.bounded(failures, "with big prompts", peak[0])
    for status in answers:
        operations[f"big prompt ({kind}) answered {status}"] += 1
        if status == 0:
            failures["serve: a big prompt not answered within 120 s"] += 1
        elif status >= 500 and status != 503:
            failures["serve: a big prompt answered with a server error"] += 1


def poisoned_offer(
    liars: PoisonedPeers,
    offer: Offer,
    target: "Node",
    nodes: list["Node"],
    fp,
    operations: collections.Counter,
    failures: collections.Counter,
) -> None:
    """A fetch of a lying peer's cache into `target`'s store, as `kvmesh fetch --store` does: it is
    refused for its basis (reason `artifact`), an announced 1 GiB basis before any byte is asked for;
    then no live daemon offers that cache or serves that basis."""
    asked = liars.artifact_calls(offer)
    try:
        with PeerClient(offer.address, timeout=5.0) as client:
            fetch_cache(
                client,
                offer.cache_id,
                ReceiverProfile(fp, prompt=[*offer.tokens, 5]),
                store=CacheStore(target.store_dir, max_bytes=BUDGET),
                idle_timeout=5.0,
            )
        failures["a cache of a poisoned basis fetched"] += 1
    except KvmeshError as e:
        reason = "artifact" if "artifact" in str(e) else type(e).__name__  # a disk-full window may come first
        operations[f"poisoned basis refused ({reason})"] += 1
    if offer.poison == "1 GiB announced" and liars.artifact_calls(offer) > asked:
        failures["a basis announced past its bound was asked for"] += 1
    for node in nodes:
        if node.stopped or node.daemon is None or node.daemon.process.poll() is not None:
            continue
        try:
            with PeerClient(node.address, timeout=5.0) as client:
                if any(m.candidate.cache_id == offer.cache_id for m in client.lookup(fp.model_id, offer.tokens)):
                    failures["a daemon offers a cache of a poisoned basis"] += 1
                try:
                    client.artifact(offer.digest, 1 << 20, lambda piece: None, idle_timeout=5.0)
                    failures["a daemon serves a poisoned basis"] += 1
                except PeerError as e:
                    if e.code is not None and e.code != grpc.StatusCode.NOT_FOUND:
                        raise
        except PeerError:
            continue  # a daemon just killed or frozen: it offers nothing


def keeps_poison(liars: PoisonedPeers, stores: list[Path]) -> bool:
    """Whether any of `stores` holds a lying peer's cache or basis (or a temporary file of one)."""
    ids = {offer.cache_id for offer in liars.offers}
    digests = {offer.digest for offer in liars.offers}
    for root in stores:
        # Steps run one at a time, so no arrival is under way now: a temporary file is one left over.
        if any(p.name in digests or p.name.startswith(".incoming-") for p in (root / "artifacts").rglob("*")):
            return True
        if ids & {e.cache_id for e in CacheStore(root, max_bytes=BUDGET).entries()}:
            return True
    return False


class RemovedMember:
    """The removed-member fault: a member joined (or a spare joined under squatters) that holds a
    cache of its own, dialled by B, removed with `kvmesh mesh remove` and left running."""

    def __init__(self, mesh: SoakMesh, model, fp, document: list[int], suffix: list[int]):
        self.mesh, self.model, self.fp = mesh, model, fp
        self.document, self.prompt = document, document + suffix
        self.cache = prefill(model, document).cache
        self.reference = greedy_tokens(model, self.prompt, 4)

    def run(self, root: Path, operations: collections.Counter, failures: collections.Counter) -> None:
        mesh = self.mesh
        x = mesh.spares.pop() if mesh.spares else mesh.joined()
        # Encoded afresh: the encoder's chunks are an iterator, consumed by the store that takes them.
        CacheStore(x.store, max_bytes=BUDGET).add(*encode_cache(self.cache, self.fp, self.document))
        x.start([mesh.a.address, mesh.b.address])
        for old in mesh.removed:  # one removed member at a time keeps running: the newest
            old.stop()
        mesh.removed = []
        mesh.restart_b(x.address)
        if wait_until(lambda: x.address in mesh.b.live_peers(), 20) is None:
            failures["a joined member never became a live peer"] += 1
            x.stop()
            return
        before = self.generate_from_b(root, failures)
        operations[f"removed member: generation before removal from {before.split(' ')[0]}"] += 1
        mesh.remove(x)
        mesh.removed = [x]
        bound = REVOCATION + REMOVAL_INTERVALS * HEALTH
        took = wait_until(lambda: not any(x.address in m.live_peers() for m in (mesh.a, mesh.b)), bound)
        if took is None:
            failures[f"a removed member listed live after {REMOVAL_INTERVALS} health intervals"] += 1
        else:
            operations[f"removed member dropped within {int(took) + 1} s"] += 1
        if self.generate_from_b(root, failures) == f"peer {x.address}":
            failures["a member fetched from a removed member"] += 1

    def generate_from_b(self, root: Path, failures: collections.Counter) -> str:
        """Where a generation of the member's prompt found its prefix, with B's live peers as the
        sources (as `kvmesh generate` on B takes them) and B's credentials, into a fresh client store
        (one holding the member's cache would answer from itself)."""
        store_dir = Path(tempfile.mkdtemp(dir=root, prefix="via-b-"))
        try:
            result = generate(
                self.model,
                self.fp,
                self.prompt,
                CacheStore(store_dir, max_bytes=BUDGET),
                peers=sorted(self.mesh.b.live_peers()),
                credentials=self.mesh.b.credentials(),
                max_tokens=4,
                idle_timeout=3.0,
                mesh_budget=MESH_BUDGET,
            )
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)
        if result.tokens != self.reference:
            failures["wrong tokens from a generation through the mesh"] += 1
        return result.prefix.where


def join_squatters(mesh: SoakMesh, failures: collections.Counter) -> None:
    """Idle Join and Renew calls from 127.0.0.2 on the authority's join port, while a new member joins
    with a fresh token and renews; the squatters' calls are cut within their deadline."""
    squatter = mesh.squat()
    try:
        joined = None
        try:
            joined = mesh.joined()
            mesh.spares.append(joined)
        except KvmeshError:
            failures["a join failed while squatters held the join port"] += 1
        try:
            mesh.renew(joined or mesh.b)
        except KvmeshError:
            failures["a renewal failed while squatters held the join port"] += 1
        if not squatter.wait_ended(16, 15):
            failures["idle calls on the join port not cut"] += 1
    finally:
        squatter.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="run only these actions (comma-separated names of ACTIONS)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else set(ACTIONS)
    if only - set(ACTIONS):
        parser.error(f"no such action: {', '.join(sorted(only - set(ACTIONS)))}")
    rng = random.Random(args.seed)
    faults: collections.Counter = collections.Counter()
    operations: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()

    logging.basicConfig(level=logging.ERROR)  # quarantines are counted below, not logged one by one
    root = Path(tempfile.mkdtemp(prefix="kvmesh-soak-"))
    model_dir = make_test_model(root / "tiny", "tiny")  # served as "tiny" too
    model, tokenizer = mlx_lm.load(str(model_dir))[:2]
    fp = fingerprint(model_dir)
    corpus = tokenizer.encode((Path(__file__).parent.parent / "kvmesh" / "data" / "corpus.txt").read_text())
    documents = [corpus[i * 100 : i * 100 + n] for i, n in enumerate((200, 260, 300, 384, 420))]
    prompts = [doc + corpus[-20:-10] for doc in documents]
    references = [greedy_tokens(model, p, 4) for p in prompts]
    caches = [prefill(model, doc).cache for doc in documents]

    disk = root / "disk"
    disk.mkdir()
    mounted = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], capture_output=True).returncode
        == 0
    )
    nodes = [Node(root, f"n{i}", disk if mounted and i == 0 else None) for i in range(args.daemons)]
    closing: list = []  # what the misbehaviour started, stopped at the end
    try:
        for node in nodes:
            node.start([])
        addresses = [n.address for n in nodes]
        for node in nodes:  # restart with each other as static peers, on the same ports
            port = node.address.rsplit(":", 1)[1]
            assert node.daemon is not None
            node.daemon.stop()
            node.start([a for a in addresses if a != node.address], port=int(port))
        for i, cache in enumerate(caches):
            store = CacheStore(nodes[i % len(nodes)].store_dir, max_bytes=BUDGET)
            store.add(*encode_cache(cache, fp, documents[i]))
        client_store = CacheStore(root / "client", max_bytes=BUDGET)
        big = list(range(4, 2052))  # 8 MB, more than sockets and HTTP/2 windows hold
        big_cache = prefill(model, big).cache
        trickle_store = CacheStore(root / "trickle")
        big_options = EncodeOptions(codec="none", chunk_size=16 << 10)
        big_id = trickle_store.add(*encode_cache(big_cache, fp, big, options=big_options)).cache_id
        misbehaviour = Misbehaviour(root, trickle_store.root)
        closing.append(misbehaviour.close)
        liars = PoisonedPeers(root / "liars")
        closing.append(liars.close)
        liars.start(model, tokenizer, fp, [p[:-1] for p in prompts[:4]])  # the soak's own prompts
        liar_addresses = sorted({offer.address for offer in liars.offers})
        mesh = SoakMesh(root / "mesh")
        closing.append(mesh.close)
        removal = RemovedMember(mesh, model, fp, corpus[50:290], corpus[-20:-10])  # held by no other
        server = Server(root, model_dir)
        closing.append(server.close)
        if not server.guarded:
            print("soak: this kvmesh serve has no --send-timeout nor --max-connections-per-address yet")
        filler: Path | None = None
        start = time.monotonic()
        step = 0
        while step < args.steps and time.monotonic() - start < args.minutes * 60:
            step += 1
            node = rng.choice(nodes)
            action = rng.choices(
                list(ACTIONS),
                weights=[0 if (a == "disk" and not mounted) or a not in only else w for a, w in ACTIONS.items()],
            )[0]
            if all(n.stopped for n in nodes) and action not in ("cont", "damage", "disk"):
                action = "cont"  # every daemon is stopped: wake one (`node` is one of them)
            try:
                if action == "kill" and not node.stopped:
                    node.signal(signal.SIGKILL)
                    assert node.daemon is not None
                    node.daemon.process.wait()
                    node.start([a for a in addresses if a != node.address], port=int(node.address.rsplit(":", 1)[1]))
                    faults["sigkill + restart"] += 1
                elif action == "stop" and not node.stopped:
                    node.signal(signal.SIGSTOP)
                    node.stopped = True
                    faults["sigstop"] += 1
                elif action == "cont" and node.stopped:
                    node.signal(signal.SIGCONT)
                    node.stopped = False
                    faults["sigcont"] += 1
                elif action == "damage":
                    files = sorted((node.store_dir / "entries").glob("*.kvc"))
                    if files:
                        damaged = rng.choice(files)
                        data = bytearray(damaged.read_bytes())
                        data[rng.randrange(len(data))] ^= 1 + rng.randrange(255)
                        damaged.write_bytes(bytes(data))
                        faults["byte flipped in a store file"] += 1
                elif action == "disk":
                    if filler is None:
                        filler = disk / "filler"
                        with open(filler, "wb", buffering=0) as f:
                            try:
                                while True:
                                    f.write(b"\0" * (256 << 10))
                            except OSError:
                                pass
                        faults["disk full window opened"] += 1
                    else:
                        filler.unlink()
                        filler = None
                        faults["disk full window closed"] += 1
                elif action in ("fetch", "lookup", "publish"):
                    live = [n for n in nodes if not n.stopped]
                    target = rng.choice(live)
                    i = rng.randrange(len(prompts))
                    with PeerClient(target.address, timeout=5.0) as client:
                        matches = client.lookup(fp.model_id, prompts[i][:-1])
                        if action == "fetch" and matches:
                            fetched = fetch_cache(
                                client,
                                matches[0].candidate.cache_id,
                                ReceiverProfile(fp, prompt=prompts[i]),
                                num_tokens=matches[0].tokens,
                                idle_timeout=5.0,
                            )
                            suffix = prompts[i][fetched.manifest.prefix.num_tokens :]
                            tokens = tokens_after(model, fetched.cache, suffix, 4)
                            if tokens != references[i]:
                                failures["wrong tokens after a fetch"] += 1
                        elif action == "publish":
                            source = CacheStore(rng.choice(nodes).store_dir, max_bytes=BUDGET)
                            entries = source.entries()
                            if entries:
                                client.publish(source, rng.choice(entries).cache_id)
                    operations[f"{action} ok"] += 1
                elif action == "generate":
                    i = rng.randrange(len(prompts))
                    # Stopped ones too: they must cost only the timeout; and the hostile peer's lies,
                    # and the lying peers' caches of these prompts coded with poisoned bases.
                    peers = [n.address for n in nodes] + [misbehaviour.hostile_address, *liar_addresses]
                    result = generate(
                        model,
                        fp,
                        prompts[i],
                        client_store,
                        peers=peers,
                        max_tokens=4,
                        idle_timeout=3.0,
                        mesh_budget=MESH_BUDGET,
                    )
                    if result.tokens != references[i]:
                        failures["wrong tokens from generate"] += 1
                    if result.prefix.seconds > MESH_BUDGET + OVERSHOOT:
                        failures["the mesh part of a generation over its budget"] += 1
                    operations[f"generate from {result.prefix.where.split(' ')[0]}"] += 1
                elif action in ("spoof advert", "spoof goodbye", "idle connections"):
                    live = [n for n in nodes if not n.stopped]
                    victim = rng.choice(live)
                    if action == "spoof advert":
                        misbehaviour.spoof_advert(victim)
                    elif action == "spoof goodbye":
                        watchers = [n for n in live if n is not victim and victim.node_id in n.mdns_peers()]
                        misbehaviour.lan.goodbye(victim.node_id)
                        time.sleep(2.0)  # browsers act on a goodbye after 1 s; no event crosses processes
                        if not victim.stopped and any(victim.node_id not in n.mdns_peers() for n in watchers):
                            failures["a live peer dropped by a spoofed goodbye"] += 1
                    else:
                        misbehaviour.hold_connections(victim)
                    faults[f"stranger: {action}"] += 1
                elif action == "trickle":
                    began = time.monotonic()
                    try:
                        with PeerClient(misbehaviour.trickle_address) as client:
                            fetch_cache(client, big_id, ReceiverProfile(fp, prompt=big))
                        failures["a trickled fetch completed"] += 1
                    except PeerError as e:
                        if "trickle" not in str(e) or time.monotonic() - began > 15:
                            failures["a trickle not cut like a stall"] += 1
                    faults["member: trickle"] += 1
                elif action in ("unread fetches", "no open"):
                    live = [n for n in nodes if not n.stopped]
                    target = rng.choice(live)
                    entries = CacheStore(target.store_dir, max_bytes=BUDGET).entries()
                    if action == "unread fetches" and entries:
                        held = open_unread_fetches(target.address, entries[0].cache_id, 2)
                        try:
                            if not slots_free_within(target.address, IDLE + 10):
                                failures["an unread transfer kept its slot"] += 1
                        finally:
                            for channel, _, gate in held:
                                gate.set()
                                channel.close()
                    elif action == "no open":
                        with grpc.insecure_channel(target.address) as channel:
                            never = threading.Event()

                            def silent(never=never):
                                never.wait(30)
                                yield spb.FetchRequest()

                            fetch = channel.stream_stream(
                                method("Fetch"), request_serializer=serialize, response_deserializer=bytes
                            )
                            calls = [fetch(silent(), timeout=30) for _ in range(40)]
                            try:
                                with PeerClient(target.address, timeout=5.0) as client:
                                    client.info()  # answered while 40 fetches wait for their open
                            except PeerError:
                                if not target.stopped:
                                    failures["calls starved by fetches that never open"] += 1
                            finally:
                                never.set()
                                for call in calls:
                                    call.cancel()
                    faults[f"member: {action}"] += 1
                elif action == "poisoned basis":
                    offer = rng.choice(liars.offers)
                    target = rng.choice([n for n in nodes if not n.stopped])
                    poisoned_offer(liars, offer, target, nodes, fp, operations, failures)
                    i = liars.offers.index(offer)  # the offers cover prompts[:4], in order
                    peers = [n.address for n in nodes if not n.stopped] + [offer.address]
                    result = generate(
                        model, fp, prompts[i], client_store, peers=peers, max_tokens=4, mesh_budget=MESH_BUDGET
                    )
                    if result.tokens != references[i]:
                        failures["wrong tokens from a generation offered a poisoned basis"] += 1
                    faults[f"liar: {offer.poison} basis"] += 1
                elif action == "removed member":
                    removal.run(root, operations, failures)
                    faults["mesh: member removed, still serving"] += 1
                elif action == "join squatters":
                    join_squatters(mesh, failures)
                    faults["mesh: join port squatted"] += 1
                elif action == "never-reading clients":
                    never_reading_clients(server, operations, failures)
                    faults["serve: never-reading clients"] += 1
                elif action == "big prompts":
                    kind = rng.choice(BIG_PROMPTS)
                    big_prompts(server, kind, operations, failures)
                    faults[f"serve: big prompts ({kind})"] += 1
            except KvmeshError as e:
                operations[f"{action} refused or failed cleanly ({type(e).__name__})"] += 1

            # Invariants.
            for n in nodes:
                if n.daemon is not None and n.daemon.process.poll() is not None and not n.stopped:
                    failures["a daemon died on its own"] += 1
                    n.start([a for a in addresses if a != n.address], port=int(n.address.rsplit(":", 1)[1]))
                if n.daemon is not None and rss(n.daemon.process.pid, missing=0) > MAX_RSS:
                    failures["daemon memory over 1 GiB"] += 1
                if CacheStore(n.store_dir, max_bytes=BUDGET).total_bytes() > BUDGET:
                    failures["a store over its budget"] += 1
            if client_store.total_bytes() > BUDGET:
                failures["the client store over its budget"] += 1
            if keeps_poison(liars, [n.store_dir for n in nodes] + [client_store.root]):
                failures["a store keeps a lying peer's cache, basis or a part of one"] += 1
            for member in (mesh.a, mesh.b):
                assert member.daemon is not None
                if member.daemon.process.poll() is not None:
                    failures["a mesh daemon died on its own"] += 1
                    member.start([mesh.a.address] if member is mesh.b else [])
                if rss(member.daemon.process.pid, missing=0) > MAX_RSS:
                    failures["daemon memory over 1 GiB"] += 1
            for x in mesh.removed:
                try:
                    if any(x.address in m.live_peers() for m in (mesh.a, mesh.b)):
                        failures["a removed member listed live"] += 1
                except KvmeshError:
                    pass  # a member just restarted: its control port comes back with it
            assert server.process is not None
            if server.process.process.poll() is not None:
                failures["the HTTP server died on its own"] += 1
                server.start()
            else:
                server.bounded(failures, "between its faults")
            owners = {n.node_id: n.address for n in nodes if n.daemon is not None}
            for n in nodes:
                if n.stopped or n.daemon is None or n.daemon.process.poll() is not None:
                    continue
                try:
                    bound = n.mdns_peers()
                except KvmeshError:
                    continue
                if any(peer in owners and addresses != [owners[peer]] for peer, addresses in bound.items()):
                    failures["a peer bound to an address it does not own"] += 1

        for node in nodes:
            if node.stopped:
                node.signal(signal.SIGCONT)
        if filler is not None:
            filler.unlink()
        # Stores verify: what is damaged goes to quarantine; what is left verifies.
        for node in nodes:
            store = CacheStore(node.store_dir, max_bytes=BUDGET)
            problems = store.verify_all()
            operations["damaged entries quarantined at the end"] += len(problems)
            if store.verify_all():
                failures["a store does not verify after quarantine"] += 1
        elapsed = time.monotonic() - start
    finally:
        for close in closing:
            close()
        for node in nodes:
            if node.daemon is not None:
                if node.stopped:
                    node.signal(signal.SIGCONT)
                try:
                    node.daemon.stop(timeout=60)
                except subprocess.TimeoutExpired:
                    failures[f"daemon {node.name} did not stop within 60 s of SIGTERM"] += 1
                    node.daemon.process.kill()
        if mounted and subprocess.run(["umount", str(disk)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(disk)], check=False)
        if failures:
            print(f"soak: logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    print(
        f"soak: {step} steps in {elapsed:.0f} s, {args.daemons} daemons, seed {args.seed}"
        f"{'' if mounted else ' (no tmpfs: disk-full windows skipped; run as root for them)'}"
    )
    print("faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(faults.items())) or "none"))
    print("operations: " + ", ".join(f"{k} {v}" for k, v in sorted(operations.items())))
    print("invariant failures: " + (", ".join(f"{k} {v}" for k, v in sorted(failures.items())) or "none"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
