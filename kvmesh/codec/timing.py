"""How long decoding or coding a model's caches takes on a machine: a fixed part and a part per token.

Each layer has fixed costs (its graph, its buffers, its chunks' framing) that weigh far more on a
short cache than on a long one: a single rate timed on 256 tokens put the decode of a 1,024-token
fetch of SmolLM2's transform coded copy at about 3x what it took. So times are fitted to timings
of two lengths or more: a receiver's decoding (kvmesh.reuse.calibration) and a sender's coding on
request (kvmesh.net.on_request). Needs nothing but the standard library.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CodecTime:
    """Decoding (or coding) a cache of `tokens` tokens of a model: fixed_s + per_token_s * tokens."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


def fit_codec_time(samples: Sequence[tuple[float, float]]) -> CodecTime:
    """The line through timings (tokens, seconds) of two lengths or more (least squares), with no
    term below zero: timings of a loaded machine may put the shorter one above the longer one, and
    then the longest's rate, all of it per token, is the fit (as when the line would cross zero, or
    every timing is of one length)."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_s = sum(s for _, s in samples) / n
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    slope = sum((t - mean_t) * (s - mean_s) for t, s in samples) / spread if spread else 0.0
    fixed = mean_s - slope * mean_t
    if slope > 0 and fixed >= 0:
        return CodecTime(fixed, slope)
    tokens, seconds = max(samples)
    return CodecTime(0.0, seconds / tokens)
