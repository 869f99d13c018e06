"""Typed errors. Every message names what went wrong and what the user can do about it."""

from pathlib import Path


class KvmeshError(Exception):
    """Base of every error kvmesh raises on purpose; the CLI prints these as one line."""


class ModelDirError(KvmeshError):
    """A model directory is missing, incomplete or unreadable."""

    def __init__(self, path: Path | str, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedCacheError(KvmeshError):
    """A cache of a kind kvmesh cannot make sparse (e.g. a rotating or SSM cache)."""


class PressConfigError(KvmeshError):
    """An unknown compression method or a bad value in its config."""
