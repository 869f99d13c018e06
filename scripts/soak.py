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
transfer frees its slot. Bounded in steps and time; loopback only. Prints a summary; exits 1 if any
invariant failed.
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
from kvmesh.generation import fetch_cache, generate
from kvmesh.model.fingerprint import fingerprint
from kvmesh.model.testmodels import make_test_model
from kvmesh.net.client import PeerClient
from kvmesh.net.transport import method, serialize
from kvmesh.store import CacheStore
from kvmesh.v1 import control_pb2 as cpb
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PROTOCOL_VERSION
from support import hostile_peer
from support.daemons import start_daemon
from support.processes import rss
from support.references import greedy_tokens, tokens_after
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
}  # fmt: skip


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    faults: collections.Counter = collections.Counter()
    operations: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()

    logging.basicConfig(level=logging.ERROR)  # quarantines are counted below, not logged one by one
    root = Path(tempfile.mkdtemp(prefix="kvmesh-soak-"))
    model_dir = make_test_model(root / "model", "tiny")
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
        filler: Path | None = None
        start = time.monotonic()
        step = 0
        while step < args.steps and time.monotonic() - start < args.minutes * 60:
            step += 1
            node = rng.choice(nodes)
            action = rng.choices(
                list(ACTIONS), weights=[0 if a == "disk" and not mounted else w for a, w in ACTIONS.items()]
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
                        victim = rng.choice(files)
                        data = bytearray(victim.read_bytes())
                        data[rng.randrange(len(data))] ^= 1 + rng.randrange(255)
                        victim.write_bytes(bytes(data))
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
                    # Stopped ones too: they must cost only the timeout; and the hostile peer's lies.
                    peers = [n.address for n in nodes] + [misbehaviour.hostile_address]
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
