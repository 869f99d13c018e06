#!/usr/bin/env python3
"""Fetch throughput over loopback against raw TCP, time to a rejection, and receiver peak memory; or,
with --links, a transform coded cache of the real model over shaped links against a local prefill.

    scripts/dev run python scripts/bench_transfer.py [--mb 256] [--repeat 3]
    sudo scripts/dev run python scripts/bench_transfer.py --links 1000 200 [--prefix-tokens 1024] [--repeat 3]

The cache is real KV of the `small` preset (tests/support/bench_caches.py: in scripts/bench_codec.py's
work dir, prefilled on first use), tiled along the tokens to about --mb megabytes. A `kvmesh daemon`
process serves it (loopback, no TLS); fetches run in fresh client processes so their peak memory is
their own. The raw TCP transfer moves the same stored bytes between two processes in the same run,
as the ceiling to compare with.

With --links (root: network namespaces, scripts/bench_shaped.py): SmolLM2-135M's cache of a
document's first --prefix-tokens tokens, transform coded at the default level with the model's basis, and
as computed, served by a daemon in one namespace and fetched over a veth pair limited with `tbf` to
each rate in Mbit/s (mutual TLS); per copy the wire time, the decode time, the whole fetch and the
time to the first generated token, against prefilling the same tokens here.
"""

import argparse
import itertools
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.caches.presses import Press
from kvmesh.codec.encode import EncodeOptions, encode_cache
from kvmesh.store import CacheStore
from support.bench_caches import add_cache_arguments, tiled_cache
from support.daemons import loopback_daemon

FETCH_CHILD = """
import json, sys, time, dataclasses
import mlx.core as mx
from kvmesh.allocator import tune_allocator
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.errors import CacheRejected
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.client import PeerClient
from kvmesh.v1 import model_pb2

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

address, cache_id, fp_hex = sys.argv[1], sys.argv[2], sys.argv[3]
reject, tuned = sys.argv[4] == "reject", sys.argv[5] == "tuned"
if tuned:
    tune_allocator()  # as the kvmesh command does
fp = ModelFingerprint.from_proto(model_pb2.ModelFingerprint.FromString(bytes.fromhex(fp_hex)))
if reject:
    fp = dataclasses.replace(fp, weights_sha256="0" * 64)
client = PeerClient(address)
client.info()  # connect first: time the transfer, not the TCP handshake

def fetch():
    start = time.perf_counter()
    try:
        fetched = fetch_cache(client, cache_id, ReceiverProfile(fp))
        mx.eval([c.keys for c in fetched.cache])
        return time.perf_counter() - start, "fetched"
    except CacheRejected as e:
        return time.perf_counter() - start, str(e)

def drain():
    # The same frames over the same kind of gRPC stream, counted and dropped: what gRPC alone reaches.
    import queue
    from kvmesh.codec.compat import ReceiverProfile
    from kvmesh.net.messages import accept, profile_to_proto
    from kvmesh.net.transport import as_bytes, method, serialize
    from kvmesh.v1 import service_pb2 as spb
    from kvmesh.versions import PROTOCOL_VERSION

    outbox = queue.Queue()
    outbox.put(spb.FetchRequest(open=spb.FetchOpen(
        cache_id=cache_id, profile=profile_to_proto(ReceiverProfile(fp)), protocol_version=PROTOCOL_VERSION)))
    call = client.channel.stream_stream(method("Fetch"), request_serializer=serialize, response_deserializer=as_bytes)
    start = time.perf_counter()
    stream = iter(call(iter(outbox.get, None)))
    next(stream)  # the manifest
    outbox.put(spb.FetchRequest(decision=accept()))
    for _ in stream:
        pass
    outbox.put(None)
    return time.perf_counter() - start

before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
cold, outcome = fetch()
grown = status("VmHWM:") - before
# Again in the same process, as in a long-running `kvmesh serve`: memory the allocators already hold,
# HTTP/2 windows grown. The first few fetches of a process still warm up: the median of the 3rd to 5th.
fetch()
warm = sorted(fetch()[0] for _ in range(3))[1]
drained = None if reject else drain()
print(json.dumps({"cold": cold, "warm": warm, "grown": grown, "outcome": outcome, "drain": drained}))
"""

TCP_SENDER = """
import socket, sys
path = sys.argv[1]
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
connection, _ = listener.accept()
with open(path, "rb") as f:
    connection.sendfile(f)
connection.close()
"""


def raw_tcp_seconds(path: Path, size: int) -> float:
    """Send `path` over loopback TCP from another process into one reused buffer."""
    sender = subprocess.Popen([sys.executable, "-c", TCP_SENDER, str(path)], stdout=subprocess.PIPE, text=True)
    port = int(sender.stdout.readline())
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.perf_counter()
        received = 0
        while n := s.recv_into(view):
            received += n
        elapsed = time.perf_counter() - start
    sender.wait()
    assert received == size, (received, size)
    return elapsed


def fetch_in_child(address: str, cache_id: str, fp, reject: bool = False, tuned: bool = True) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            FETCH_CHILD,
            address,
            cache_id,
            fp.to_proto().SerializeToString().hex(),
            "reject" if reject else "accept",
            "tuned" if tuned else "stock",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cache_arguments(parser, mb=256)
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per figure (medians); with --links, fetches of the held-basis coded copy",
    )
    parser.add_argument("--links", type=float, nargs="+", help="shaped link rates in Mbit/s: the coded cache bench")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="with --links: the prefix's tokens")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, not {args.repeat}")
    if args.links:
        from bench_shaped import shaped

        return shaped(args.links, args.prefix_tokens, args.repeat)
    if not sys.platform.startswith("linux"):
        sys.exit("bench_transfer reads /proc for peak memory: run it on Linux")
    tiled, fp, tokens = tiled_cache(args)
    table = Table(
        title=f"fetch over loopback, {sum(c.nbytes for c in tiled) / 1e6:.0f} MB {fp.dtype} KV "
        f"({len(tokens)} tokens), medians of {args.repeat}"
    )
    for column in (
        "codec",
        "allocator",
        "wire MB",
        "cold fetch MB/s",
        "warm fetch MB/s",
        "gRPC drain MB/s",
        "raw TCP MB/s",
        "warm / TCP",
        "cold / TCP",
        "warm / drain",
        "peak RSS / cache",
    ):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        store = CacheStore(Path(tmp) / "store")
        manifests = {
            codec: store.add(*encode_cache(tiled, fp, tokens, Press(), options=EncodeOptions(codec=codec)))
            for codec in ("none", "zstd")
        }
        del tiled
        server = loopback_daemon(Path(tmp) / "daemon", "--store", store.root, "--log-level", "warning")
        address = server.address
        try:
            for (codec, manifest), tuned in itertools.product(manifests.items(), (False, True)):
                raw = manifest.encoding.raw_bytes
                entry = store.entries_dir / f"{manifest.cache_id}.kvc"
                runs = [fetch_in_child(address, manifest.cache_id, fp, tuned=tuned) for _ in range(args.repeat)]
                tcp = statistics.median(raw_tcp_seconds(entry, entry.stat().st_size) for _ in range(args.repeat))
                cold = statistics.median(r["cold"] for r in runs)
                warm = statistics.median(r["warm"] for r in runs)
                grown = statistics.median(r["grown"] for r in runs)
                drained = statistics.median(r["drain"] for r in runs)
                wire = manifest.encoding.encoded_bytes
                table.add_row(
                    codec,
                    "tuned" if tuned else "glibc default",
                    f"{wire / 1e6:.0f}",
                    f"{raw / 1e6 / cold:.0f}",
                    f"{raw / 1e6 / warm:.0f}",
                    f"{raw / 1e6 / drained:.0f}",
                    f"{entry.stat().st_size / 1e6 / tcp:.0f}",
                    f"{tcp / warm:.2f}",
                    f"{tcp / cold:.2f}",
                    f"{drained / warm:.2f}",
                    f"{grown / raw:.2f}",
                )
            rejected = [
                fetch_in_child(address, manifests["zstd"].cache_id, fp, reject=True) for _ in range(args.repeat)
            ]
        finally:
            server.stop()
    Console(width=160).print(table)
    print(
        "fetch MB/s counts decoded cache bytes, from request to caches ready: cold is a fresh process "
        "(first touch of new memory), warm the median of its 3rd to 5th fetches; gRPC drain receives the "
        "same frames on the same kind of stream and drops them (gRPC's own ceiling); raw TCP moves the "
        "stored entry file once, into one reused buffer, with no decoding"
    )
    print(
        f"request to rejection (other weights), median: {statistics.median(r['warm'] for r in rejected) * 1000:.1f} ms "
        f"({rejected[0]['outcome']})"
    )


if __name__ == "__main__":
    main()
