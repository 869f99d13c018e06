#!/usr/bin/env python3
"""Fault-injection soak: several daemons on loopback, random faults, clients checking invariants.

    scripts/dev run python scripts/soak.py [--minutes 3] [--steps 400] [--daemons 3] [--seed 0]

Daemons (their own data dirs, static peers, a store budget each; one store on a 24 MB tmpfs when this
runs as root, so its disk can fill) are hit with random SIGKILL (then a restart), SIGSTOP/SIGCONT,
bytes flipped in store files and disk-full windows, while clients fetch, publish, look up and
generate. After every step the invariants are checked: no wrong tokens ever (every generation equals
a full local prefill), stores verify (damage is quarantined, never served), budgets hold, daemon
memory stays bounded. Bounded in steps and time; loopback only. Prints a summary; exits 1 if any
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
import time
from pathlib import Path

import mlx_lm

from kvmesh.caches.prefill import prefill
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.encode import encode_cache
from kvmesh.daemon.control import DaemonProcess
from kvmesh.errors import KvmeshError
from kvmesh.generation import fetch_cache, generate
from kvmesh.model.fingerprint import fingerprint
from kvmesh.model.testmodels import make_test_model
from kvmesh.net.client import PeerClient
from kvmesh.store import CacheStore
from support.daemons import start_daemon
from support.processes import rss
from support.references import greedy_tokens, tokens_after

BUDGET = 6 << 20
MAX_RSS = 1 << 30


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
            "--no-discovery",
            "--store",
            self.store_dir,
            "--store-budget",
            BUDGET,
            "--health-interval",
            "0.5",
            "--idle-timeout",
            "5",
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
        filler: Path | None = None
        start = time.monotonic()
        step = 0
        while step < args.steps and time.monotonic() - start < args.minutes * 60:
            step += 1
            node = rng.choice(nodes)
            action = rng.choices(
                ["kill", "stop", "cont", "damage", "disk", "fetch", "publish", "lookup", "generate"],
                weights=[1, 1, 2, 1, 1 if mounted else 0, 4, 2, 3, 4],
            )[0]
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
                    peers = [n.address for n in nodes]  # stopped ones too: they must cost only the timeout
                    result = generate(model, fp, prompts[i], client_store, peers=peers, max_tokens=4, idle_timeout=3.0)
                    if result.tokens != references[i]:
                        failures["wrong tokens from generate"] += 1
                    operations[f"generate from {result.source.where.split(' ')[0]}"] += 1
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
