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
    # The largest steps that met the same bar with bases fitted before: with per-layer step factors
    # (kvmesh.codec.sensitivity) but without the attention's weights (kvmesh.codec.attention_metric),
    # and with one step for every layer; on those, this level's step would take the cache past the bar.
    factors_step: float
    one_step: float
    # The last `tail` coded rows at `tail_factor` times the step (kvmesh.codec.transform): for
    # every basis (on the older ones, a little more quality for a few more bytes).
    tail: int = 0
    tail_factor: float = 1.0
    # The step the level codes at with a basis that predicts each layer from the one before at that
    # step (kvmesh.codec.prediction; calibration fits the predictors at it), and what it measured
    # there; None: the level does not predict.
    predicted_step: float | None = None
    predicted_ratio: float = 0.0
    predicted_kl: float = 0.0

    def measured(self, *, predicts: bool = True) -> tuple[float, float]:
        """(x smaller than fp16, KL) on the bench's worst text, with a basis `kvmesh model calibrate`
        fits now (one that predicts, where the level does), or with one that `predicts` not."""
        if self.predicted_step is not None and predicts:
            return self.predicted_ratio, self.predicted_kl
        return self.ratio, self.kl

    def coded_bytes(self, fp16_bytes: float, *, predicts: bool = True) -> int:
        """What a cache of `fp16_bytes` in float16 is expected to take coded at this level: over
        its ratio on the bench's worst text (`measured`)."""
        return int(fp16_bytes / self.measured(predicts=predicts)[0])

    def step_for(self, *, factors: bool, weighted: bool, predicted_step: float | None = None) -> float:
        """The level's step for a basis with or without per-layer step factors, fitted with or
        without the attention's weights (`Basis.has_step_factors`, `Basis.weighted`), that predicts
        layers at `predicted_step` or not (`Basis.predicted_step`)."""
        if predicted_step is not None and predicted_step == self.predicted_step:
            return predicted_step
        if not factors:
            return self.one_step
        return self.step if weighted else self.factors_step


# scripts/bench_quality.py --methods full --steps 0.28 --cuts 512 768 1024 (the bench's default
# tail, --tail 48 --tail-factor 0.25), --steps 0.42 0.48 --tail 0 and --steps 0.43 --predict-at 0.43
# --tail 0, 2026-12-05 (worst of declaration / notes / code), with the basis fitted in the
# attention's weights (kvmesh.codec.attention_metric), its per-layer step factors
# (kvmesh.codec.sensitivity) and its predictors (kvmesh.codec.prediction_fit), the first row alone
# raw (kvmesh.codec.transform.SINKS), zstd with its smallest hash table
# (kvmesh.codec.layer_blob.ZSTD_HASH_LOG: 1.5-2.1% smaller than before it, at the same KL). `small`
# codes each layer after the first as the residual of its prediction from the layer before
# (kvmesh.codec.prediction) at step 0.43: 8.11x at KL 0.0167 with every fact kept (0.42: 8.00x at KL
# 0.0165; 0.44, before the hash table, lost one of the code text's facts at 7.94x); a basis without
# predictors (fitted before them, on the user's texts) codes it at step 0.48 as before: 7.04x at KL
# 0.0194. Before the predictors and the hash table (the same bench, earlier that day; with four rows
# raw, 4.94x and 6.68x at steps 0.28 and 0.48): the default codes the last 48 rows at a quarter of
# its step, which lets the rest take a coarser one: 5.07x at KL 0.0030 (5.14x with the hash table),
# where without the tail the bar was met at 4.27x (KL 0.0024, step 0.18, four rows raw). The cost: a
# prefix cut from the cache before its tail is worse than the whole (worst of the cuts at 512, 768
# and 1,024 tokens: KL 0.0080, against 0.0025 at step 0.18 without a tail), so a cut that drops tail
# rows claims no measured loss (kvmesh.codec.cut). `small` has no tail: there the facts bind, not
# the KL (with the tail and four raw rows, steps 0.57-0.63 lost a fact; 0.54 met the bars at 6.85x,
# KL 0.0106, its cuts at up to KL 0.0376), so the tail bought 2.5% for much worse cuts; step 0.5
# without it: 7.06x at KL 0.0222; step 0.48: 6.90x at KL 0.0194. Before the weights, with the
# factors alone: 3.74x at KL 0.0018 (step 0.15) and 6.27x at 0.0165 (step 0.5); with one step for
# every layer 3.68x at 0.0024 (step 0.12) and 5.10x at 0.0171 (step 0.28) (four rows raw).
LEVELS: dict[str, Level] = {
    "default": Level(
        step=0.28, max_kl=0.003, ratio=5.14, kl=0.00296, factors_step=0.15, one_step=0.12, tail=48, tail_factor=0.25
    ),
    "small": Level(
        step=0.48,
        max_kl=0.02,
        ratio=7.04,
        kl=0.0194,
        factors_step=0.5,
        one_step=0.28,
        predicted_step=0.43,
        predicted_ratio=8.11,
        predicted_kl=0.0167,
    ),
}
# The step calibration fits a basis's cross-layer predictors at (kvmesh.codec.prediction_fit): the
# one level that predicts.
PREDICTED_STEP = next(level.predicted_step for level in LEVELS.values() if level.predicted_step is not None)
