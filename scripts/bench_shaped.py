"""A transform coded cache over shaped links, against a local prefill (`bench_transfer.py --links`).

SmolLM2-135M (float32) on this CPU; its cache of a document's first N tokens as computed (zstd) and
transform coded at the default level with the model's basis (fitted as `kvmesh model calibrate`
fits it). A daemon in one network namespace serves both; a client in another fetches each over a
veth pair limited with `tbf` to each rate (mutual TLS, as on a LAN): the coded copy first into a
receiver without the basis (it travels first), then again with it held (--repeat times: a fetch of
a tenth of a second on a shared 2-core box varies by half between runs, so the table gives each
figure's median over them, and below it each fetch's ratio to the slower of its wire and decode),
then the full copy, then a copy the daemon codes on request from a full one
(kvmesh.net.on_request; a full copy of its own for each link, stored with another zstd level, so
that each is coded anew: the row's fetch counts the coding, and "coding s" is that fetch less the
median of the stored coded copy's with the basis held: one fetch's noise). Each fetch follows a
lookup over the same channel, as `kvmesh.reuse.find.find_prefix` fetches: lookup s (connecting,
mutual TLS and the lookup), then per fetch: wire s (request to the last byte, the basis included),
decode s (the same copy decoded again here, from the receiver's store, which then drops it: each
fetch is into a store without the cache), fetch s (request to caches ready), first token s (lookup
and fetch, then the next token fed), and the CPU seconds the fetch took here (the receiving
process, every thread) and there (the daemon): both ends share this machine's cores, which a pair
of Macs would not; against a prefill of the same tokens here, then the next token.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from support.real_model import blas_name, fast_blas, smollm2_dir

PORT = 7481

CHILD = """
import json, os, sys, tempfile, time
from pathlib import Path
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache
from kvmesh.caches.prefill import generate_from_cache
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.model.fingerprint import fingerprint
from kvmesh.net.client import PeerClient
from kvmesh.net.mesh.credentials import load_credentials
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.find import load_prefix
from kvmesh.store import CacheStore
from kvmesh.v1.service_pb2 import CodeRequest

from kvmesh.allocator import tune_allocator
from kvmesh.collector import freeze_startup_objects

tune_allocator()  # as the kvmesh command does
model_dir, address, mesh_dir, prompt_file, copies, daemon_pid = sys.argv[1:7]

def daemon_threads():
    # each of the daemon's threads' nanoseconds on a CPU (the first field of its schedstat: /proc/PID/stat
    # counts clock ticks of 10 ms, a tenth of a fetch)
    times = {}
    for task in Path(f"/proc/{daemon_pid}/task").iterdir():
        try:
            times[task.name] = int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # (a thread that ended)
    return times

def daemon_cpu_since(before):
    # the daemon's CPU seconds since `before`, of the threads alive now (one that ended meanwhile, a
    # read's or a watch's of a few ms, is not counted)
    return sum(ns - before.get(tid, 0) for tid, ns in daemon_threads().items()) / 1e9
model, _ = mlx_lm.load(model_dir)
fp = fingerprint(Path(model_dir))
credentials = load_credentials(Path(mesh_dir))
prompt = json.loads(Path(prompt_file).read_text())  # the prefix's tokens, then one more

def first_token(cache, feed):
    start = time.perf_counter()
    next(iter(generate_from_cache(model, cache, feed, max_tokens=1)))
    seconds = time.perf_counter() - start
    # mlx-lm computes the next token on its stream while this one is handed out: let it end, or it
    # runs into what is timed next (the decode) and, at the end, into the process's exit (where the
    # preloaded OpenBLAS frees its buffers under it: a crash, 1 run in 5 once exits got quicker)
    mx.synchronize(generation_stream)
    return seconds

def ready(cache):
    mx.eval([t for layer in cache for t in layer.state])
    return cache

first_token(make_prompt_cache(model), prompt[:8])  # weights read, kernels built
freeze_startup_objects()  # as kvmesh serve does once the model is loaded


def fetch_once(store, cache_id, code):
    with PeerClient(address, credentials=credentials) as client:
        start = time.perf_counter()
        client.lookup(fp.model_id, prompt[:-1])
        lookup_s = time.perf_counter() - start
        there, cpu_here = daemon_threads(), time.process_time()  # (read before the fetch's time: 0.6 ms)
        start = time.perf_counter()
        fetched = fetch_cache(client, cache_id, ReceiverProfile(fp, prompt=prompt), store=store, code=code)
        ready(fetched.cache)
        fetch_s = time.perf_counter() - start
        cpu_here, cpu_there = time.process_time() - cpu_here, daemon_cpu_since(there)
    ttft = lookup_s + fetch_s + first_token(fetched.cache, prompt[-1:])
    start = time.perf_counter()
    ready(load_prefix(store, fetched.manifest.cache_id, len(prompt) - 1))
    decode_s = time.perf_counter() - start
    # The next fetch comes to a store without it, as a receiver fetches (one that held it would write it
    # again and drop the copy: a 4.6 MB file deleted on the fetch's path, 1.7 ms of its 0.1 s here)
    store.delete(fetched.manifest.cache_id)
    return {
        "wire_bytes": fetched.wire_bytes, "basis_bytes": fetched.basis_bytes, "lookup_s": lookup_s,
        "wire_s": fetched.wire_s, "decode_s": decode_s, "fetch_s": fetch_s, "ttft_s": ttft,
        "cpu_here_s": cpu_here, "cpu_there_s": cpu_there,
    }


with tempfile.TemporaryDirectory() as tmp:
    store = CacheStore(Path(tmp))
    for name, cache_id, level, rounds in json.loads(copies):
        for _ in range(rounds):
            row = fetch_once(store, cache_id, CodeRequest(level=level) if level else None)
            print(json.dumps({"copy": name, **row}), flush=True)
prefill_ttft = first_token(make_prompt_cache(model), prompt)
print(json.dumps({"copy": "prefill here", "ttft_s": prefill_ttft}), flush=True)
"""


def shaped(links: list[float], tokens: int, rounds: int) -> None:
    """Print the table of the module docstring for each link rate in Mbit/s, the coded copy with its
    basis held fetched `rounds` times (medians)."""
    fast_blas()
    import mlx_lm
    from rich.console import Console
    from rich.table import Table

    from kvmesh.caches.prefill import prefill
    from kvmesh.codec.calibration import fit_model_basis
    from kvmesh.codec.coded import TransformCoding, transform_code
    from kvmesh.codec.encode import EncodeOptions, encode_cache
    from kvmesh.codec.levels import LEVELS
    from kvmesh.daemon.control import read_state
    from kvmesh.model.fingerprint import fingerprint
    from kvmesh.store import CacheStore
    from kvmesh.store.artifacts import artifact_store
    from support import namespaces

    if why := namespaces.missing():
        sys.exit(f"bench_transfer --links: {why}")
    model_dir = smollm2_dir()
    model, tokenizer = mlx_lm.load(str(model_dir))
    fp = fingerprint(model_dir)
    document = tokenizer.encode((Path(__file__).parent / "data" / "declaration.txt").read_text())
    if len(document) <= tokens:
        sys.exit(f"the document has {len(document)} tokens; --tokens must be fewer")
    prefix = document[:tokens]
    cache = prefill(model, prefix).cache
    basis = fit_model_basis(model, tokenizer).basis
    coded = transform_code(cache, TransformCoding.at_level(basis, LEVELS["default"]))
    title = f"a {tokens}-token cache of SmolLM2-135M float32 over tbf-shaped links, {blas_name()}, mutual TLS"
    table = Table(title=title)
    columns = (
        "link Mbit/s",
        "copy",
        "fetches",
        "wire MB",
        "basis MB",
        "lookup s",
        "wire s",
        "decode s",
        "fetch s",
        "coding s",
        "fetch / slower",
        "first token s",
        "CPU s here / there",
    )
    for column in columns:
        table.add_column(column, justify="right")
    slower: list[str] = []  # per link, the basis-held coded fetch over the slower of its wire and decode
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = CacheStore(root / "store")
        full_id = store.add(*encode_cache(cache, fp, prefix)).cache_id
        coded_id = store.add(*encode_cache(coded, fp, prefix)).cache_id
        artifacts = artifact_store(store.root)
        artifacts.put(basis.to_bytes(), basis.digest)
        artifacts.set_model_basis(fp.model_id, basis.digest)  # (what lets the daemon code on request)
        to_code = [
            store.add(*encode_cache(cache, fp, prefix, options=EncodeOptions(level=2 + i))).cache_id
            for i in range(len(links))
        ]
        (root / "prompt.json").write_text(json.dumps(document[: tokens + 1]))
        across = namespaces.member_daemon_across_a_link(root, store.root, f"kvt{os.getpid() % 100000}", PORT)
        with across as (link, client_dir):
            daemon_pid = read_state(client_dir.parent / "server").pid
            for mbit, source in zip(links, to_code, strict=True):
                link.shape(mbit * 1e6)
                copies = [
                    ["coded, basis fetched", coded_id, "", 1],
                    ["coded, basis held", coded_id, "", rounds],
                    ["full", full_id, "", 1],
                    ["coded on request", source, "default", 1],
                ]
                out = subprocess.run(
                    [
                        *link.in_client(),
                        sys.executable,
                        "-c",
                        CHILD,
                        str(model_dir),
                        f"{namespaces.SERVER_IP}:{PORT}",
                        str(client_dir),
                        str(root / "prompt.json"),
                        json.dumps(copies),
                        str(daemon_pid),
                    ],
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    sys.exit(f"the client failed: {out.stderr.strip()}")
                runs: dict[str, list[dict]] = {}
                for line in out.stdout.splitlines():
                    row = json.loads(line)
                    print(json.dumps({"mbit": mbit, **row}))
                    runs.setdefault(row["copy"], []).append(row)
                for name, fetches in runs.items():
                    median = {key: statistics.median(f[key] for f in fetches) for key in fetches[0] if key != "copy"}
                    if name == "coded on request":
                        median["coding_s"] = median["fetch_s"] - statistics.median(
                            f["fetch_s"] for f in runs["coded, basis held"]
                        )
                    ratios = [f["fetch_s"] / max(f["wire_s"], f["decode_s"]) for f in fetches if "decode_s" in f]
                    if name == "coded, basis held":
                        listed = ", ".join(f"{x:.2f}" for x in ratios)
                        slower.append(f"{mbit:g} Mbit/s: {statistics.median(ratios):.2f}x (each fetch: {listed})")
                    times = ("lookup_s", "wire_s", "decode_s", "fetch_s", "coding_s")
                    cells = [f"{median[k]:.3f}" if k in median else "-" for k in times]
                    table.add_row(
                        f"{mbit:g}",
                        name,
                        str(len(fetches)),
                        f"{median['wire_bytes'] / 1e6:.2f}" if "wire_bytes" in median else "-",
                        f"{median['basis_bytes'] / 1e6:.2f}" if "basis_bytes" in median else "-",
                        *cells,
                        f"{statistics.median(ratios):.2f}" if ratios else "-",
                        f"{median['ttft_s']:.3f}",
                        f"{median['cpu_here_s']:.3f} / {median['cpu_there_s']:.3f}" if "cpu_here_s" in median else "-",
                    )
    Console(width=180).print(table)
    print(
        "lookup s: connecting, TLS and the lookup before the fetch, on the same channel; wire s: the fetch's "
        "request to its last byte (the basis when fetched included); decode s: the same copy decoded again from "
        "the receiver's store; fetch s: request to caches ready (decoding overlaps the wire); times are medians "
        "over the fetches; first token s: lookup and fetch, then the next token fed; fetch / slower: the median of "
        "each fetch's fetch s over the larger of its wire s and decode s (not the ratio of the row's medians; issue "
        "33 asks 1.15x of a coded fetch at 1 Gbit/s); CPU s: the fetch's, "
        "in the receiving process and in the daemon (the same cores); prefill here: all the tokens and the next"
    )
    for line in slower:
        print(f"coded, basis held, fetch / slower at {line}")
