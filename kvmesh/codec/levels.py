"""The named settings of `--compress`: transform-codec steps chosen by measurement on the real model.

Each level is the largest quantization step (so the smallest cache) that met its quality bar on
every text of `scripts/bench_quality.py` (SmolLM2-135M-Instruct, three texts with five facts each):
the mean KL of a teacher-forced continuation at most `max_kl`, and every fact the full cache
retrieves still retrieved. The README quotes the frontier these were read from.
"""

from dataclasses import dataclass

# Tokens of each calibration text a basis is fitted on (kvmesh.codec.calibration); here, where the
# command line reads it without loading MLX.
CALIBRATION_TOKENS = 1024


@dataclass(frozen=True)
class Level:
    step: float
    # The bar it was chosen by, and what it measured (x smaller than fp16 on the worst text, worst KL).
    max_kl: float
    ratio: float
    kl: float
    # The largest step that met the same bar with one step for every layer: for a basis fitted before
    # per-layer step factors (kvmesh.codec.sensitivity), which coarser steps would take past the bar.
    one_step: float

    def coded_bytes(self, fp16_bytes: float) -> int:
        """What a cache of `fp16_bytes` in float16 is expected to take coded at this level: over
        its ratio on the bench's worst text."""
        return int(fp16_bytes / self.ratio)

    def step_for(self, factors: bool) -> float:
        """The level's step for a basis with per-layer step factors, or for one without."""
        return self.step if factors else self.one_step


# scripts/bench_quality.py --methods full --steps ..., 2026-12-03 (worst of declaration / notes / code),
# with the basis's per-layer step factors (kvmesh.codec.sensitivity); one step for every layer had
# reached 3.68x at KL 0.0024 (step 0.12) and 5.10x at KL 0.0171 (step 0.28).
LEVELS: dict[str, Level] = {
    "default": Level(step=0.15, max_kl=0.003, ratio=3.74, kl=0.0018, one_step=0.12),
    "small": Level(step=0.5, max_kl=0.02, ratio=6.27, kl=0.0165, one_step=0.28),
}
