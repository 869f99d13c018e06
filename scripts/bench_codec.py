#!/usr/bin/env python3
"""Wire-encoding speed and size, and decode peak memory, on a real cache of the `small` preset.

    scripts/dev run python scripts/bench_codec.py [--tokens 2048] [--repeat 3]

The first run builds the model and prefills (tests/support/bench_caches.py; minutes on a 2-core Linux
box); the fp16 cache is kept in --work-dir, so later runs measure the codec alone. Figures are medians
of --repeat runs.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from kvmesh.caches.presses import Press
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import EncodeOptions, build_manifest, encode_cache, encode_chunks
from kvmesh.codec.prefix import PrefixKey
from kvmesh.store import CacheStore
from support.bench_caches import default_work_dir, prepared_cache

SETTINGS = [("none", 0, False), ("zstd", 1, False), ("zstd", 1, True), ("zstd", 3, True)]

PEAK_MEMORY_CHILD = """
import json, sys
import mlx.core as mx
from kvmesh.codec.decode import decode_chunks
from kvmesh.store import CacheStore

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

store = CacheStore(sys.argv[1])
manifest = store.manifest(sys.argv[2])
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
mx.reset_peak_memory()
cache = decode_chunks(manifest, store.chunks(sys.argv[2]))
print(json.dumps({"grown": status("VmHWM:") - before, "mlx_peak": mx.get_peak_memory(),
                  "raw": manifest.encoding.raw_bytes}))
"""


def timed(fn, repeat: int):
    """(median seconds, the last result) of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=1 << 20)
    parser.add_argument("--work-dir", type=Path, default=default_work_dir())
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)

    cache, fp, ids = prepared_cache(args.work_dir, args.tokens)
    prefix = PrefixKey.of(ids)
    codec_table(cache, fp, prefix, args, "")
    # The same KV cast to bfloat16, the dtype most released models use.
    bf16 = [
        SparseKVCache.from_arrays(c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16), c.offset) for c in cache
    ]
    codec_table(bf16, dataclasses.replace(fp, dtype="bfloat16"), prefix, args, " (cast to bfloat16)")
    decode_peak_memory(cache, fp, prefix, args.chunk_size)


def codec_table(cache, fp, prefix, args, note: str):
    raw = sum(c.nbytes for c in cache)
    mb = raw / 1e6
    table = Table(
        title=f"small preset, {args.tokens} tokens, {mb:.0f} MB {fp.dtype} KV{note}, {args.chunk_size >> 10} KiB chunks"
    )
    for column in ("codec", "threads", "encoded MB", "ratio", "encode MB/s", "decode MB/s"):
        table.add_column(column, justify="right")
    for codec, level, shuffle in SETTINGS:
        for threads in (1, 2):
            options = EncodeOptions(codec, level, shuffle, args.chunk_size)
            manifest = build_manifest(cache, fp, prefix, Press(), options=options)
            encode_s, chunks = timed(lambda m=manifest, t=threads: list(encode_chunks(cache, m, t)), args.repeat)
            decode_s, _ = timed(lambda m=manifest, c=chunks, t=threads: decode_chunks(m, c, threads=t), args.repeat)
            encoded = manifest.encoding.encoded_bytes
            name = codec + (f"-{level}" if codec == "zstd" else "") + ("+shuffle" if shuffle else "")
            table.add_row(
                name,
                str(threads),
                f"{encoded / 1e6:.1f}",
                f"{raw / encoded:.3f}",
                f"{mb / encode_s:.0f}",
                f"{mb / decode_s:.0f}",
            )
    Console(width=120).print(table)


def decode_peak_memory(cache, fp, prefix, chunk_size: int):
    if not sys.platform.startswith("linux"):
        print("decode peak memory: measured on Linux only (it reads /proc)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        manifest = CacheStore(tmp).add(
            *encode_cache(cache, fp, prefix, Press(), options=EncodeOptions(chunk_size=chunk_size))
        )
        out = subprocess.run(
            [sys.executable, "-c", PEAK_MEMORY_CHILD, tmp, manifest.cache_id],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ},
        )
        peak = json.loads(out.stdout)
    grown, raw_bytes = peak["grown"], peak["raw"]
    print(
        f"decode from the store in a fresh process, {raw_bytes / 1e6:.0f} MB cache: peak RSS grew "
        f"{grown / 1e6:.0f} MB = {grown / raw_bytes:.2f}x the decoded size; MLX allocator peak "
        f"{peak['mlx_peak'] / 1e6:.0f} MB = {peak['mlx_peak'] / raw_bytes:.2f}x"
    )


if __name__ == "__main__":
    main()
