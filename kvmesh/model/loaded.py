"""A model ready to generate: its weights, its tokenizer and its fingerprint, loaded together.

The fingerprint is what the mesh trusts (caches are matched to it, never to a path), so it is taken
from the same files the weights are loaded from: a local directory, or a Hugging Face repo id's
snapshot in the local hub cache.
"""

import importlib.abc
import importlib.machinery
import json
import logging
import resource
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvmesh.errors import KvmeshError
from kvmesh.model.fingerprint import ModelFingerprint, fingerprint

log = logging.getLogger(__name__)
# mlx_lm.utils, as it is imported, sets the descriptor limit to (2048, 4096) "for large models with
# lots of files"; under a lower hard limit that raises ValueError, unless the process may raise it.
MLX_LM_UTILS = "mlx_lm.utils"
MLX_LM_HARD_LIMIT = 4096


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # an mlx-lm model (mlx.nn.Module)
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    fingerprint: ModelFingerprint


def tolerate_mlx_lm_descriptor_limit() -> None:
    """Let mlx-lm load under a hard descriptor limit below 4,096 (a service's, `ulimit -Hn 1024`).

    mlx_lm.utils raises the limit to (2048, 4096) on import, and without the privilege to raise a
    hard limit that fails: every model command ended in "unexpected ValueError". Call this before
    mlx-lm is first imported (any `mlx_lm` import loads mlx_lm.utils): where the hard limit is that
    low, that one import keeps within it (the soft limit goes as high as the hard one allows).
    Loads nothing itself; elsewhere, and once mlx-lm is loaded, it does nothing.
    """
    if MLX_LM_UTILS in sys.modules or any(isinstance(f, _WithinDescriptorLimit) for f in sys.meta_path):
        return
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= MLX_LM_HARD_LIMIT:
        return
    sys.meta_path.insert(0, _WithinDescriptorLimit())


class _WithinDescriptorLimit(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds mlx_lm.utils as the other finders do, and runs it with its descriptor-limit call
    kept within the hard limit; gone from sys.meta_path after that one import."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MLX_LM_UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner  # the module looks loaded as any other
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        with _descriptor_limit_within_hard_limit():
            self.inner.exec_module(module)


@contextmanager
def _descriptor_limit_within_hard_limit() -> Iterator[None]:
    """While it lasts, a request for more descriptors than the hard limit allows gets that limit."""
    setrlimit = resource.setrlimit

    def within(which: int, limits: tuple[int, int]) -> None:
        try:
            setrlimit(which, limits)
        except ValueError:
            if which != resource.RLIMIT_NOFILE:
                raise
            hard = resource.getrlimit(which)[1]
            log.debug("mlx-lm asked for %s descriptors; the hard limit is %s", limits, hard)
            setrlimit(which, (min(limits[0], hard), hard))

    resource.setrlimit = within
    try:
        yield
    finally:
        resource.setrlimit = setrlimit


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
