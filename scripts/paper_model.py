#!/usr/bin/env python3
"""Time to first token on Macs, with and without the mesh, on paper: the decision model of
kvmesh.reuse.choice fed with published prefill rates, nominal link rates and a decode rate.

    scripts/dev run python scripts/paper_model.py [--markdown] [--decode-gbps 0.15] [--basis-mb 0]

Prefill rates are llama.cpp's Metal figures (llama-bench `pp N`: N tokens prefilled from an empty
context, Q4_K_M weights), one per prefix length where published:

- M1, M1 Max (32-core GPU), M2 Ultra (76-core), M3 Max (40-core), Llama 3 8B and 70B: XiongjieDai,
  GPU-Benchmarks-on-LLM-Inference, README, "Apple Silicon (snapshots in May 2024)", pp 512 to 8192.
  https://github.com/XiongjieDai/GPU-Benchmarks-on-LLM-Inference
- M4 (Mac mini, 10-core GPU), Llama 3.1 8B: brand-o/normiebench issue #3, pp512 224.81 t/s
  (2026-03-08). https://github.com/brand-o/normiebench/issues/3 (pp512 only: used at every length,
  so its long prefixes come out optimistic for prefilling)

And MLX's own rates as issue 21 quotes them: Llama 3.1 8B fp16 on an M3 Ultra, 1,471 tokens/s at 8K;
Qwen3-30B-A3B 4-bit on an M4 Max, 1,754 tokens/s at 2K.

KV bytes per token are the models' own geometry in fp16 (2 x layers x kv heads x head dim x 2 B):
Llama 3 8B 128 KiB (32 layers, 8 x 128), 70B 320 KiB (80 layers, 8 x 128), Qwen3-30B-A3B 96 KiB (48
layers, 4 x 128). On the wire they are that divided by the codec's ratio: each cell gives the time
with fp16 caches, then with `--compress` (kvmesh.codec.levels: the ratio measured on the worst text of
scripts/bench_quality.py; a real 8B model's caches may compress better, its basis spanning 8 heads).
Links are nominal payload rates: Wi-Fi at 600 Mbit/s of real throughput, 1 GbE at the 0.94 of line rate that
scripts/bench_link.py measured, 10 GbE at 1.1 GB/s, a Thunderbolt bridge at 2 GB/s. kvmesh's own
receive rate is not in the model (scripts/bench_transfer.py measures it): on 10 GbE and Thunderbolt
the mesh is faster on paper than a CPU-bound receiver may be. A transform-coded cache must also be
decoded: counted as the choice counts it (the slower of the wire and decoding, then the last layer's
decode), at --decode-gbps of fp16 produced (default 0.15: measured here at 0.13-0.17 GB/s on 2 shared
CPU cores; a Mac's is not measured), its basis (--basis-mb: ~135 MB for an 8B model; 0, a receiver
holding it; `small`'s predictors make it ~460 MB) sent first. The fp16 copy's decode (a copy into
MLX arrays) is not counted.
"""

import argparse
from dataclasses import dataclass

from kvmesh.codec.levels import LEVELS
from kvmesh.reuse.choice import Copy, choose
from kvmesh.reuse.rates import PrefillModel

KIB = 1024
LLAMA3_8B_KV, LLAMA3_70B_KV, QWEN3_30B_KV = 128 * KIB, 320 * KIB, 96 * KIB
XIONGJIE = "XiongjieDai/GPU-Benchmarks-on-LLM-Inference (May 2024)"
NORMIEBENCH = "brand-o/normiebench #3"
MLX = "MLX rates quoted in kvmesh issue 21"
LINKS = {"Wi-Fi 6": 75e6, "1 GbE": 117.5e6, "10 GbE": 1.1e9, "Thunderbolt": 2e9}
LENGTHS = (1024, 4096, 8192)


@dataclass(frozen=True)
class Published:
    chip: str
    model: str
    kv_bytes_per_token: int
    # tokens -> prefill tokens/s (llama-bench pp N)
    rates: dict[int, float]
    source: str
    layers: int
    # The longest prefix this Mac holds (the source ran out of memory beyond it).
    max_tokens: int = max(LENGTHS)

    def rate(self, tokens: int) -> float:
        """The published rate at the nearest published length."""
        return self.rates[min(self.rates, key=lambda n: abs(n - tokens))]


PUBLISHED = [
    Published("M1 (8 GB)", "Llama 3 8B", LLAMA3_8B_KV, {512: 94.48, 1024: 87.26, 4096: 96.53}, XIONGJIE, 32, 4096),
    Published("M4 (Mac mini)", "Llama 3.1 8B", LLAMA3_8B_KV, {512: 224.81}, NORMIEBENCH, 32),
    Published(
        "M1 Max 32c", "Llama 3 8B", LLAMA3_8B_KV, {512: 408.23, 1024: 355.45, 4096: 329.84, 8192: 302.92}, XIONGJIE, 32
    ),
    Published(
        "M3 Max 40c", "Llama 3 8B", LLAMA3_8B_KV, {512: 693.32, 1024: 678.04, 4096: 573.09, 8192: 505.32}, XIONGJIE, 32
    ),
    Published(
        "M2 Ultra 76c",
        "Llama 3 8B",
        LLAMA3_8B_KV,
        {512: 994.04, 1024: 1023.89, 4096: 979.47, 8192: 913.55},
        XIONGJIE,
        32,
    ),
    Published(
        "M3 Max 40c", "Llama 3 70B", LLAMA3_70B_KV, {512: 70.19, 1024: 62.88, 4096: 64.90, 8192: 61.96}, XIONGJIE, 80
    ),
    Published(
        "M2 Ultra 76c",
        "Llama 3 70B",
        LLAMA3_70B_KV,
        {512: 118.79, 1024: 117.76, 4096: 109.53, 8192: 108.57},
        XIONGJIE,
        80,
    ),
    Published("M3 Ultra (MLX)", "Llama 3.1 8B fp16", LLAMA3_8B_KV, {8192: 1471.0}, MLX, 32),
    Published("M4 Max (MLX)", "Qwen3-30B-A3B 4-bit", QWEN3_30B_KV, {2048: 1754.0}, MLX, 48),
]


def rows(ratio: float, decode_gbps: float, basis_mb: float) -> list[list[str]]:
    """One row per chip, model and prefix length: the prefill alone, then the time with the mesh on
    each link (the faster of fetching and prefilling; `=` where prefilling stays the faster), with
    fp16 caches and with caches `ratio` times smaller, decoded at `decode_gbps` of fp16 after a basis
    of `basis_mb`."""
    out = []
    for p in PUBLISHED:
        for tokens in (n for n in LENGTHS if n <= p.max_tokens):
            prefill = PrefillModel.at_rate(p.rate(tokens))
            fp16 = tokens * p.kv_bytes_per_token
            cells = [p.chip, p.model, f"{tokens:,}", f"{fp16 / 1e6:,.0f}", f"{prefill.seconds(tokens):.1f}"]
            decode_s = fp16 / (decode_gbps * 1e9)
            cells.append(f"{decode_s:.2f}")  # the coded copy's decode, here
            for rate in LINKS.values():
                times = []
                coded = Copy(
                    "link", "", "transform", int(fp16 / ratio), rate,
                    basis_bytes=int(basis_mb * 1e6), decode_s=decode_s, layers=p.layers,
                )  # fmt: skip
                for copy in (Copy("link", "", "full", fp16, rate), coded):
                    choice = choose(tokens, [copy], prefill)
                    times.append(f"{choice.fetch_s:.2f}" if choice.fetch else "=")
                cells.append(" / ".join(times))
            out.append(cells)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (the README's)")
    parser.add_argument("--level", default="default", choices=list(LEVELS), help="the --compress level compared")
    parser.add_argument(
        "--decode-gbps", type=float, default=0.15, help="the transform codec's decode rate, GB/s of fp16 produced"
    )
    parser.add_argument("--basis-mb", type=float, default=0.0, help="the basis a receiver lacks, MB (sent first)")
    args = parser.parse_args()
    ratio = LEVELS[args.level].measured()[0]
    header = [
        "Mac",
        "model",
        "prefix tokens",
        "fp16 KV MB",
        "prefill s (no mesh)",
        f"{ratio:.2f}x decode s",
        *(f"{k} s: fp16 / {ratio:.2f}x" for k in LINKS),
    ]
    table = rows(ratio, args.decode_gbps, args.basis_mb)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|")
        for row in table:
            print("| " + " | ".join(row) + " |")
    else:
        from rich.console import Console
        from rich.table import Table

        out = Table(title="time to the prefix's cache on paper: prefill here, or fetch over the link (= prefill wins)")
        for column in header:
            out.add_column(column, justify="right")
        for row in table:
            out.add_row(*row)
        Console(width=140).print(out)
    print(
        f"\nthe {ratio:.2f}x copy decodes at {args.decode_gbps:g} GB/s of fp16 ({args.decode_gbps * 1e3 / ratio:.0f} "
        f"MB/s of wire) after a basis of {args.basis_mb:g} MB; the fp16 copy's decode is not counted"
    )
    print(f"sources: {XIONGJIE}; {NORMIEBENCH}; {MLX} (see this script's docstring)")


if __name__ == "__main__":
    main()
