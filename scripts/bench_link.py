#!/usr/bin/env python3
"""Fetches over shaped links: wall time and goodput of each codec at 1 and 10 Gbit/s, unshaped.

    sudo scripts/dev run python scripts/bench_link.py [--mb 128] [--repeat 3]

Two network namespaces joined by a veth pair (tests/support/namespaces.py); the server's side is
limited with `tbf` to 1 Gbit/s (1 GbE) and 10 Gbit/s (10 GbE), then left unshaped; the daemon serves
over mutual TLS there, as on a LAN. A last row set runs over loopback (plaintext, as a daemon serves
its own machine). The cache is real KV of the `small` preset (Llama-3.2-1B geometry, from
tests/support/bench_caches.py, in scripts/bench_codec.py's work dir) tiled to about --mb megabytes,
stored four ways: fp16 raw (none), fp16 zstd, bf16 byte-shuffled zstd, and 8-bit quantized. Each
figure is the median of --repeat fetches in a client process in the other namespace, after one
warm-up fetch.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from kvmesh.caches.presses import Press, make_press
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.store import CacheStore
from support import namespaces
from support.bench_caches import add_cache_arguments, tiled_cache
from support.daemons import start_daemon
from support.mesh import make_mesh

PORT = 7478

FETCH_CHILD = """
import json, sys, time
from pathlib import Path
import mlx.core as mx
from kvmesh.allocator import tune_allocator
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.net.client import PeerClient
from kvmesh.net.mesh.credentials import load_credentials
from kvmesh.v1 import model_pb2

address, data_dir, cache_id, fp_hex, repeat = sys.argv[1:6]
tune_allocator()  # as the kvmesh command does
fp = ModelFingerprint.from_proto(model_pb2.ModelFingerprint.FromString(bytes.fromhex(fp_hex)))
credentials = load_credentials(Path(data_dir)) if data_dir != "-" else None
seconds = []
with PeerClient(address, credentials=credentials) as client:
    client.info()  # connect first: time the transfer, not the handshake
    for i in range(int(repeat) + 1):
        start = time.perf_counter()
        fetched = fetch_cache(client, cache_id, ReceiverProfile(fp))
        mx.eval([t for layer in fetched.cache for t in layer.state])
        if i:  # the first is a warm-up
            seconds.append(time.perf_counter() - start)
        del fetched
print(json.dumps({"seconds": seconds}))
"""


@dataclasses.dataclass
class Stored:
    codec: str
    cache_id: str
    fp_hex: str
    raw: int
    wire: int


def store_codecs(store: CacheStore, cache: list, fp, tokens: list[int]) -> list[Stored]:
    """The cache four ways: fp16 raw and zstd, bf16 shuffle+zstd, 8-bit quantized."""
    bf16 = [
        SparseKVCache.from_arrays(c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16), c.offset) for c in cache
    ]
    bf16_fp = dataclasses.replace(fp, dtype="bfloat16")
    eight = make_press("quantize", {"kv_bits": 8})
    ways = [
        ("none (fp16)", cache, fp, Press(), EncodeOptions(codec="none")),
        ("zstd (fp16)", cache, fp, Press(), EncodeOptions(codec="zstd")),
        ("bf16 shuffle+zstd", bf16, bf16_fp, Press(), EncodeOptions(codec="zstd", byte_shuffle=True)),
        ("8-bit quantized", [c.to_quantized(64, 8) for c in cache], fp, eight, EncodeOptions(codec="none")),
    ]
    stored = []
    for name, layers, model, press, options in ways:
        m = store.add(*encode_cache(layers, model, tokens, press, options=options))
        raw = sum(c.nbytes for c in cache)  # what the receiver gets back, in the model's fp16
        stored.append(
            Stored(name, m.cache_id, model.to_proto().SerializeToString().hex(), raw, m.encoding.encoded_bytes)
        )
        print(f"stored {name}: {m.encoding.encoded_bytes / 1e6:.0f} MB on the wire", flush=True)
    return stored


def fetch_seconds(prefix: tuple[str, ...], address: str, data_dir: str, entry: Stored, repeat: int) -> float:
    out = subprocess.run(
        [*prefix, sys.executable, "-c", FETCH_CHILD, address, data_dir, entry.cache_id, entry.fp_hex, str(repeat)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"the fetch failed: {out.stderr.strip().splitlines()[-1]}")
    return statistics.median(json.loads(out.stdout)["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cache_arguments(parser, mb=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if why := namespaces.missing():
        sys.exit(f"bench_link: {why}")
    tiled, fp, tokens = tiled_cache(args)
    links = [("1 Gbit/s (tbf)", 1e9), ("10 Gbit/s (tbf)", 10e9), ("veth, unshaped", None), ("loopback", None)]
    table = Table(
        title=f"fetch of {sum(c.nbytes for c in tiled) / 1e6:.0f} MB of fp16 KV ({len(tokens)} tokens), "
        f"medians of {args.repeat}; mutual TLS between namespaces, plaintext on loopback"
    )
    columns = ["link", "codec", "wire MB", "ratio", "fetch s", "wire / link s", "fetch / ideal", "goodput / link"]
    for column in [*columns, "decoded MB/s", "decoded / (link × ratio)"]:
        table.add_column(column, justify="right")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = CacheStore(root / "store")
        stored = store_codecs(store, tiled, fp, tokens)
        del tiled
        server_dir, client_dir = root / "server", root / "client"
        make_mesh(server_dir, client_dir)
        with namespaces.Link(f"kvb{os.getpid() % 100000}") as link:
            common = ["--store", store.root, "--port", PORT, "--no-discovery", "--log-level", "warning"]
            remote = start_daemon(server_dir, "--interface", namespaces.SERVER_IP, *common, command=link.in_server())
            local = start_daemon(root / "loopback", "--interface", "127.0.0.1", *common)
            try:
                for name, rate in links:
                    loopback = name == "loopback"
                    if not loopback:
                        link.shape(rate)
                    for entry in stored:
                        seconds = fetch_seconds(
                            () if loopback else link.in_client(),
                            local.address if loopback else f"{namespaces.SERVER_IP}:{PORT}",
                            "-" if loopback else str(client_dir),
                            entry,
                            args.repeat,
                        )
                        ratio = entry.raw / entry.wire
                        ideal = entry.wire * 8 / rate if rate else None
                        decoded = entry.raw / seconds
                        table.add_row(
                            name,
                            entry.codec,
                            f"{entry.wire / 1e6:.0f}",
                            f"{ratio:.2f}",
                            f"{seconds:.3f}",
                            f"{ideal:.3f}" if ideal else "-",
                            f"{seconds / ideal:.2f}" if ideal else "-",
                            f"{entry.wire * 8 / seconds / rate:.2f}" if rate else "-",
                            f"{decoded / 1e6:.0f}",
                            f"{decoded * 8 / rate / ratio:.2f}" if rate else "-",
                        )
                        print(f"{name}, {entry.codec}: {seconds:.3f} s", flush=True)
            finally:
                remote.stop()
                local.stop()
    Console(width=160).print(table)
    print(
        "fetch s: request to caches ready in the client (warm). wire / link s: the stored bytes at the link rate, "
        "the ideal. goodput: stored bytes over the fetch time, against the link rate. decoded / (link × ratio): "
        "1.00 means compression bought exactly its ratio"
    )


if __name__ == "__main__":
    main()
