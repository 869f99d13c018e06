"""A model ready to generate: its weights, its tokenizer and its fingerprint, loaded together.

The fingerprint is what the mesh trusts (caches are matched to it, never to a path), so it is taken
from the same files the weights are loaded from: a local directory, or a Hugging Face repo id's
snapshot in the local hub cache.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import KvmeshError
from kvmesh.model.fingerprint import ModelFingerprint, fingerprint


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # an mlx-lm model (mlx.nn.Module)
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    fingerprint: ModelFingerprint


def load_model(path: str) -> LoadedModel:
    """Model, tokenizer and fingerprint of a local directory or a Hugging Face repo id (via its cache)."""
    import mlx_lm

    if not Path(path).exists() and path.startswith(("/", "./", "../", "~")):
        raise KvmeshError(f"{path}: no such model directory")
    fp = fingerprint(path) if Path(path).exists() else None
    try:
        model, tokenizer = mlx_lm.load(path)[:2]  # (its type also allows a third item, the config)
    except Exception as e:  # mlx-lm raises plain exceptions for missing files and unknown models
        raise KvmeshError(f"{path}: cannot load the model: {e}") from e
    if fp is None:
        from mlx_lm.utils import hf_repo_to_path

        fp = fingerprint(hf_repo_to_path(path), repo_id=path)
    return LoadedModel(model, tokenizer, fp)


def load_tokenizer(path: str) -> tuple[Any, ModelFingerprint]:
    """What file imports and exports need of a local model directory: no weights are loaded."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    fp = fingerprint(path)
    return mlx_load_tokenizer(Path(path)), fp
