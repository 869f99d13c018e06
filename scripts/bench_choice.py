#!/usr/bin/env python3
"""Fetch or prefill, judged: over a grid of shaped link rates and prefix lengths, is kvmesh's choice
within 10% of the faster option's measured time?

    sudo scripts/dev run python scripts/bench_choice.py [--rates 15 30 60 120 1000] [--lengths 128 256 512 1024]

The real model (SmolLM2-135M-Instruct, float32: 46 KB of KV per token) on this machine's CPU. A
daemon in one network namespace holds the caches of a document's first 128, 256, ... tokens; a
client in another reaches it over a veth pair limited with `tbf` to each rate in Mbit/s (mutual TLS,
as on a LAN). For each point the client first makes the choice exactly as `kvmesh generate` does
(kvmesh.reuse.weigh.fetch_or_prefill: the link rate from earlier transfers, else a probe; the prefill
model fitted to this machine's timed prefills, calibrated once at the start), then measures both:
the fetch (a new connection, lookup excluded, until the cache is decoded) and a local prefill of the
same tokens. Both measurements then feed the rates, as real use does. Each rate is a new peer: its
link history starts empty, so its first choice rests on a probe.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from support.real_model import blas_name, fast_blas, smollm2_dir

fast_blas()

import mlx_lm  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvmesh.caches.prefill import prefill  # noqa: E402
from kvmesh.codec.encode import EncodeOptions, encode_cache  # noqa: E402
from kvmesh.model.fingerprint import fingerprint  # noqa: E402
from kvmesh.paths import rates_file  # noqa: E402
from kvmesh.store import CacheStore  # noqa: E402
from support import namespaces  # noqa: E402
from support.daemons import start_daemon  # noqa: E402

PORT = 7479
TOLERANCE = 1.10

CHILD = """
import json, sys, time
from pathlib import Path
import mlx.core as mx
import mlx_lm
from kvmesh.caches.prefill import run_prompt
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.reuse.calibration import ensure_calibrated
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.rates import Rates
from kvmesh.reuse.weigh import fetch_or_prefill
from kvmesh.model.fingerprint import fingerprint
from kvmesh.net.client import PeerClient
from kvmesh.net.credentials import load_credentials

model_dir, address, mesh_dir, rates_dir, tokens_file = sys.argv[1:6]
model, _ = mlx_lm.load(model_dir)
fp = fingerprint(Path(model_dir))
credentials = load_credentials(Path(mesh_dir))
rates = Rates(rates_dir)
ensure_calibrated(model, fp, rates)
document = json.loads(Path(tokens_file).read_text())
for n in json.loads(sys.argv[6]):
    tokens = document[:n]
    with PeerClient(address, credentials=credentials) as client:
        [match] = [m for m in client.lookup(fp.model_id, tokens + [0]) if m.candidate.num_tokens == n]
        choice = fetch_or_prefill(rates, fp, [(client, match.candidate)], tokens=n, held=0)
    start = time.perf_counter()
    with PeerClient(address, credentials=credentials) as client:
        fetched = fetch_cache(client, match.candidate.cache_id, ReceiverProfile(fp, prompt=tokens + [0]))
    mx.eval([t for layer in fetched.cache for t in layer.state])
    fetch_s = time.perf_counter() - start
    rates.record_transfer(address, fetched.wire_bytes, fetch_s)
    start = time.perf_counter()
    run_prompt(model, tokens)
    prefill_s = time.perf_counter() - start
    rates.record_prefill(fp.model_id, n, prefill_s)
    print(json.dumps({
        "tokens": n, "wire": fetched.wire_bytes, "fetch_s": fetch_s, "prefill_s": prefill_s,
        "fetch": choice.fetch, "expected_fetch_s": choice.fetch_s, "expected_prefill_s": choice.prefill_s,
    }), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[15, 30, 60, 120, 1000], help="link rates, Mbit/s")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024], help="prefix tokens")
    args = parser.parse_args()
    if why := namespaces.missing():
        sys.exit(f"bench_choice: {why}")

    model_dir = smollm2_dir()
    model, tokenizer = mlx_lm.load(str(model_dir))
    fp = fingerprint(model_dir)
    text = (Path(__file__).parent / "data" / "declaration.txt").read_text()
    document = tokenizer.encode(text)
    if len(document) < max(args.lengths):
        sys.exit(f"the document has {len(document)} tokens; lengths go up to {max(args.lengths)}")

    table = Table(title=f"fetch or prefill: SmolLM2-135M float32 on this CPU ({blas_name()}), mutual TLS over tbf")
    for column in ("link Mbit/s", "tokens", "wire MB", "fetch s", "prefill s", "expected f / p s", "chose", "ok"):
        table.add_column(column, justify="right")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = CacheStore(root / "store")
        for n in args.lengths:
            tokens = document[:n]
            store.add(*encode_cache(prefill(model, tokens).cache, fp, tokens, options=EncodeOptions(codec="none")))
        (root / "tokens.json").write_text(json.dumps(document))
        server_dir, client_dir = root / "server", root / "client"
        namespaces.make_mesh(server_dir, client_dir)
        with namespaces.Link(f"kvc{os.getpid() % 100000}") as link:
            daemon = start_daemon(
                server_dir,
                *("--store", store.root, "--interface", namespaces.SERVER_IP, "--port", PORT, "--no-discovery"),
                command=link.in_server(),
            )
            try:
                rates_dir = root / "rates"
                for i, mbit in enumerate(args.rates):
                    link.shape(mbit * 1e6)
                    # A new peer on this link: the machine's timed prefills stay, the link history does not.
                    peer_rates = root / f"rates-{i}"
                    peer_rates.mkdir()
                    if rates_file(rates_dir).exists():
                        kept = json.loads(rates_file(rates_dir).read_text())
                        rates_file(peer_rates).write_text(json.dumps({"links": {}, "prefill": kept["prefill"]}))
                    out = subprocess.run(
                        [
                            *link.in_client(),
                            sys.executable,
                            "-c",
                            CHILD,
                            str(model_dir),
                            f"{namespaces.SERVER_IP}:{PORT}",
                            str(client_dir),
                            str(peer_rates),
                            str(root / "tokens.json"),
                            json.dumps(args.lengths),
                        ],
                        capture_output=True,
                        text=True,
                    )
                    if out.returncode:
                        sys.exit(f"the client failed: {out.stderr.strip()}")
                    rates_dir = peer_rates
                    for line in out.stdout.splitlines():
                        row = {**json.loads(line), "mbit": mbit}
                        chosen = row["fetch_s"] if row["fetch"] else row["prefill_s"]
                        row["ok"] = chosen <= TOLERANCE * min(row["fetch_s"], row["prefill_s"])
                        rows.append(row)
                        table.add_row(
                            f"{mbit:g}",
                            str(row["tokens"]),
                            f"{row['wire'] / 1e6:.1f}",
                            f"{row['fetch_s']:.2f}",
                            f"{row['prefill_s']:.2f}",
                            f"{row['expected_fetch_s']:.2f} / {row['expected_prefill_s']:.2f}",
                            "fetch" if row["fetch"] else "prefill",
                            "yes" if row["ok"] else "NO",
                        )
                        print(f"{mbit:g} Mbit/s, {row['tokens']} tokens: {'fetch' if row['fetch'] else 'prefill'}")
            finally:
                daemon.stop()
    Console(width=140).print(table)
    good = sum(r["ok"] for r in rows)
    print(
        f"the choice was within {TOLERANCE - 1:.0%} of the faster option at {good} of {len(rows)} points "
        f"({good / len(rows):.0%}); fetch s includes connecting (TLS) and decoding, prefill s is the same "
        "tokens prefilled here"
    )


if __name__ == "__main__":
    main()
