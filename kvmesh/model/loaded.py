"""A model ready to generate: its weights, its tokenizer and its fingerprint, loaded together.

The fingerprint is what the mesh trusts (caches are matched to it, never to a path), so it is taken
from the same files the weights are loaded from: a local directory, or a Hugging Face repo id's
snapshot in the local hub cache.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.compat.mlx_lm import tolerate_mlx_lm_descriptor_limit
from kvmesh.errors import KvmeshError
from kvmesh.model.fingerprint import ModelFingerprint, fingerprint


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # an mlx-lm model (mlx.nn.Module)
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    fingerprint: ModelFingerprint


def context_length(model_dir: Path) -> int:
    """The model's context (its config's max_position_embeddings), for a directory or a cached hub
    model's snapshot alike: every command refuses a prompt longer than it, wherever the model came
    from (past it mlx-lm only warns, and what it makes is of no use)."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", {})
    return int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 4096)


def local_model_dir(path: str) -> Path:
    """A model directory: `path` itself, or the local Hugging Face cache's snapshot of the repo id
    `path`. Never downloaded: a mistyped directory that looks like a repo id (`models/typo`) would
    otherwise dial the Hub and fail with a network error that names neither the path nor the fix."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    if path.startswith(("/", "./", "../", "~")) or path.count("/") != 1:
        raise KvmeshError(f"{path}: no such model directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # huggingface_hub raises several kinds for "not cached" and bad ids
        raise KvmeshError(
            f"{path}: no such model directory, nor a model in the local Hugging Face cache "
            f"(if it is a repo id, `hf download {path}` fetches it)"
        ) from None


def model_fingerprint(path: str) -> ModelFingerprint:
    """The fingerprint of a local model directory or of a repo id in the local Hugging Face cache."""
    return fingerprint(local_model_dir(path))


def load_model(path: str) -> LoadedModel:
    """Model, tokenizer and fingerprint of a local directory or a Hugging Face repo id in the local
    cache (local_model_dir: nothing is downloaded)."""
    tolerate_mlx_lm_descriptor_limit()
    import mlx_lm

    model_dir = local_model_dir(path)
    fp = fingerprint(model_dir)  # a hub snapshot's path names its repo and revision
    try:
        model, tokenizer = mlx_lm.load(str(model_dir))[:2]  # (its type also allows a third item, the config)
    except Exception as e:  # mlx-lm raises plain exceptions for missing files and unknown models
        raise KvmeshError(f"{path}: cannot load the model: {e}") from e
    return LoadedModel(model, tokenizer, fp)


def load_tokenizer(path: str) -> tuple[Any, ModelFingerprint]:
    """What file imports and exports need of a model (a directory or a cached repo id): no weights
    are loaded."""
    tolerate_mlx_lm_descriptor_limit()
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    model_dir = local_model_dir(path)
    return mlx_load_tokenizer(model_dir), fingerprint(model_dir)
