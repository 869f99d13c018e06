"""Measure what a press costs: bytes kept, and how far generation drifts from the uncompressed cache."""

import time
from dataclasses import dataclass, fields

import mlx.nn as nn

from kvmesh.caches.prefill import generate_from_cache, prefill
from kvmesh.caches.presses import Press
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache


@dataclass
class PressResult:
    press: Press
    positions_kept: int
    positions: int
    dense_nbytes: int
    nbytes: int
    prefill_s: float
    # Greedy tokens generated after the suffix, and how many equal the uncompressed cache's.
    tokens: list[int]
    tokens_matching: int

    @property
    def label(self) -> str:
        """The method and the options that differ from their defaults."""
        options = [
            f"{f.name}={getattr(self.press, f.name)}"
            for f in fields(self.press)
            if getattr(self.press, f.name) != f.default
        ]
        return " ".join([self.press.method, *options])


def compare_presses(
    model: nn.Module, prefix: list[int], suffix: list[int], presses: list[Press], *, steps: int = 16
) -> list[PressResult]:
    """Prefill `prefix` with each press, continue with `suffix`, compare against the first press.

    Put `Press()` (keep everything) first to compare against the uncompressed cache.
    """
    results: list[PressResult] = []
    for press in presses:
        start = time.perf_counter()
        cached = prefill(model, prefix, press)
        elapsed = time.perf_counter() - start
        # Positions kept per pressed (full-attention) layer; windows and recurrent state are not pressed.
        pressed = [c.n_kept for c in cached.cache if isinstance(c, (SparseKVCache, SparseQuantizedKVCache))]
        kept = sum(pressed) // max(1, len(pressed))
        tokens = [t for t, _ in generate_from_cache(model, cached.cache, suffix, max_tokens=steps)]
        baseline = results[0].tokens if results else tokens
        results.append(
            PressResult(
                press=press,
                positions_kept=kept,
                positions=cached.num_tokens,
                dense_nbytes=cached.dense_nbytes,
                nbytes=cached.nbytes,
                prefill_s=elapsed,
                tokens=tokens,
                tokens_matching=sum(a == b for a, b in zip(tokens, baseline)),
            )
        )
    return results


def results_table(results: list[PressResult], title: str):
    from rich.table import Table

    table = Table(title=title)
    for column in ("method", "kept / tokens", "bytes", "of dense", "prefill s", "tokens = dense"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for r in results:
        table.add_row(
            r.label,
            f"{r.positions_kept} / {r.positions}",
            f"{r.nbytes:,}",
            f"{r.nbytes / r.dense_nbytes:.3f}",
            f"{r.prefill_s:.2f}",
            f"{r.tokens_matching} / {len(r.tokens)}",
        )
    return table
