"""What `--compress LEVEL` does to a cache before it is stored and shared.

The level's transform coding (kvmesh.codec.levels) with the model's basis: the one this Mac fitted
before, kept beside the store (kvmesh.store.artifacts), or one fitted now, once per model, from
Python's help topics (`kvmesh model calibrate` makes it ahead of time, from texts of your choosing).
The loss it costs is measured here, as a press's is (kvmesh.caches.quality), and travels in the
manifest for receivers' quality floors.
"""

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn

from kvmesh.caches.quality import tail_kl
from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.calibration import Calibrated, default_texts, fit_model_basis
from kvmesh.codec.coded import CodedLayer, code_at_level, decoded, parse_basis
from kvmesh.codec.levels import CALIBRATION_TOKENS, PREDICTED_STEP
from kvmesh.errors import IntegrityError, StoreError
from kvmesh.model.loaded import LoadedModel
from kvmesh.progress import Progress
from kvmesh.store.artifacts import artifact_store

log = logging.getLogger(__name__)


@dataclass
class Compressed:
    """A cache list with its full-attention layers transform coded, and the loss that cost (None when
    nothing could be coded)."""

    cache: list
    tail_kl: float | None


def model_basis(
    store_root: Path,
    loaded: LoadedModel,
    *,
    texts: Mapping[str, str] | None = None,
    tokens_per_text: int = CALIBRATION_TOKENS,
    refit: bool = False,
    progress: Progress | None = None,
    on_fit: Callable[[], None] | None = None,
) -> tuple[Basis, Calibrated | None]:
    """The basis this Mac codes `loaded`'s caches with, and the calibration when one ran now (on
    first use, with `refit`, or with `texts`); `on_fit` is called just before a calibration starts
    (to tell the user why this takes a while)."""
    artifacts = artifact_store(store_root)
    model_id = loaded.fingerprint.model_id
    try:
        digest = artifacts.model_basis(model_id)
        data = artifacts.get(digest) if digest and not refit and texts is None else None
    except (StoreError, IntegrityError) as e:  # a damaged basis or pointer: fitted again below
        log.warning("%s: fitting the model's basis again", e)
        digest = data = None
    if digest and data is not None:
        try:
            basis = parse_basis(data, digest)
        except BasisError as e:  # (kept by an older kvmesh, or damaged): fitted again below
            log.warning("%s: fitting the model's basis again", e)
        else:
            missing = [
                name
                for name, has in (
                    ("per-layer steps", basis.has_step_factors),
                    ("attention weights", basis.weighted),
                    ("small's predictors", basis.predicted_step == PREDICTED_STEP),
                )
                if not has
            ]
            if not missing or not fitted_on(basis, default_texts()):
                if missing:
                    log.warning(
                        "the model's basis (fitted on your texts) predates %s, so --compress codes larger "
                        "caches at the same quality; run `kvmesh model calibrate MODEL --text ...` again to fit "
                        "a current one",
                        " and ".join(missing),
                    )
                return basis, None
            log.info("the model's basis predates %s: fitting it again", " and ".join(missing))
    if on_fit is not None:
        on_fit()
    calibrated = fit_model_basis(
        loaded.model,
        loaded.tokenizer,
        texts,
        tokens_per_text=tokens_per_text,
        info={"model": model_id},
        progress=progress,
    )
    basis = calibrated.basis
    artifacts.put(basis.to_bytes(), basis.digest)
    artifacts.set_model_basis(model_id, basis.digest)
    return basis, calibrated


def fitted_on(basis: Basis, texts: Mapping[str, str]) -> bool:
    """Whether `basis` was fitted on `texts` (as far as the names it records say)."""
    return sorted(basis.info.get("texts", ())) == sorted(Path(name).name for name in texts)


def compress(model: nn.Module, cache: list, tokens: Sequence[int], level: str, basis: Basis) -> Compressed:
    """`cache` transform coded at `level`, its loss measured on the prompt's own tail."""
    coded = code_at_level(cache, basis, level)
    if not any(isinstance(layer, CodedLayer) for layer in coded):
        return Compressed(coded, None)
    return Compressed(coded, tail_kl(model, cache, decoded(coded), list(tokens)))
