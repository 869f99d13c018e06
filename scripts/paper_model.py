#!/usr/bin/env python3
"""Time to first token on Macs, with and without the mesh, on paper: the decision model of
kvmesh.fetch_or_prefill fed with published prefill rates and nominal link rates.

    scripts/dev run python scripts/paper_model.py [--markdown]

Prefill rates are llama.cpp's Metal figures (llama-bench `pp N`: N tokens prefilled from an empty
context, Q4_K_M weights), one per prefix length where published:

- M1, M1 Max (32-core GPU), M2 Ultra (76-core), M3 Max (40-core), Llama 3 8B and 70B: XiongjieDai,
  GPU-Benchmarks-on-LLM-Inference, README, "Apple Silicon (snapshots in May 2024)", pp 512 to 8192.
  https://github.com/XiongjieDai/GPU-Benchmarks-on-LLM-Inference
- M4 (Mac mini, 10-core GPU), Llama 3.1 8B: brand-o/normiebench issue #3, pp512 224.81 t/s
  (2026-03-08). https://github.com/brand-o/normiebench/issues/3 (pp512 only: used at every length,
  so its long prefixes come out optimistic for prefilling)

KV bytes per token are the models' own geometry in fp16 (2 x layers x kv heads x head dim x 2 B):
Llama 3 8B 128 KiB (32 layers, 8 x 128), 70B 320 KiB (80 layers, 8 x 128). Links are nominal payload
rates: Wi-Fi at 600 Mbit/s of real throughput, 1 GbE at the 0.94 of line rate that
scripts/bench_link.py measured, 10 GbE at 1.1 GB/s, a Thunderbolt bridge at 2 GB/s. kvmesh's own
receive rate is not in the model (scripts/bench_transfer.py measures it): on 10 GbE and Thunderbolt
the mesh is faster on paper than a CPU-bound receiver may be.
"""

import argparse
from dataclasses import dataclass

from kvmesh.fetch_or_prefill import PrefillModel, choose

KIB = 1024
LLAMA3_8B_KV, LLAMA3_70B_KV = 128 * KIB, 320 * KIB
XIONGJIE = "XiongjieDai/GPU-Benchmarks-on-LLM-Inference (May 2024)"
NORMIEBENCH = "brand-o/normiebench #3"
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
    # The longest prefix this Mac holds (the source ran out of memory beyond it).
    max_tokens: int = max(LENGTHS)

    def rate(self, tokens: int) -> float:
        """The published rate at the nearest published length."""
        return self.rates[min(self.rates, key=lambda n: abs(n - tokens))]


PUBLISHED = [
    Published("M1 (8 GB)", "Llama 3 8B", LLAMA3_8B_KV, {512: 94.48, 1024: 87.26, 4096: 96.53}, XIONGJIE, 4096),
    Published("M4 (Mac mini)", "Llama 3.1 8B", LLAMA3_8B_KV, {512: 224.81}, NORMIEBENCH),
    Published(
        "M1 Max 32c", "Llama 3 8B", LLAMA3_8B_KV, {512: 408.23, 1024: 355.45, 4096: 329.84, 8192: 302.92}, XIONGJIE
    ),
    Published(
        "M3 Max 40c", "Llama 3 8B", LLAMA3_8B_KV, {512: 693.32, 1024: 678.04, 4096: 573.09, 8192: 505.32}, XIONGJIE
    ),
    Published(
        "M2 Ultra 76c", "Llama 3 8B", LLAMA3_8B_KV, {512: 994.04, 1024: 1023.89, 4096: 979.47, 8192: 913.55}, XIONGJIE
    ),
    Published(
        "M3 Max 40c", "Llama 3 70B", LLAMA3_70B_KV, {512: 70.19, 1024: 62.88, 4096: 64.90, 8192: 61.96}, XIONGJIE
    ),
    Published(
        "M2 Ultra 76c", "Llama 3 70B", LLAMA3_70B_KV, {512: 118.79, 1024: 117.76, 4096: 109.53, 8192: 108.57}, XIONGJIE
    ),
]


def rows() -> list[list[str]]:
    """One row per chip, model and prefix length: the prefill alone, then the time with the mesh on
    each link (the faster of fetching and prefilling; `=` where prefilling stays the faster)."""
    out = []
    for p in PUBLISHED:
        for tokens in (n for n in LENGTHS if n <= p.max_tokens):
            prefill = PrefillModel.at_rate(p.rate(tokens))
            wire = tokens * p.kv_bytes_per_token
            cells = [p.chip, p.model, f"{tokens:,}", f"{wire / 1e6:,.0f}", f"{prefill.seconds(tokens):.1f}"]
            for rate in LINKS.values():
                choice = choose(tokens, wire, rate, prefill)
                cells.append(f"{choice.fetch_s:.2f}" if choice.fetch else "=")
            out.append(cells)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (the README's)")
    args = parser.parse_args()
    header = ["Mac", "model", "prefix tokens", "KV MB", "prefill s (no mesh)", *(f"{k} s" for k in LINKS)]
    table = rows()
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
    print(f"\nsources: {XIONGJIE}; {NORMIEBENCH} (see this script's docstring)")


if __name__ == "__main__":
    main()
