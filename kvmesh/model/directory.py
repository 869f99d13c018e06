"""A model directory written whole or not at all, for the models kvmesh builds (random-weight
presets, converted GGUF files)."""

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvmesh.errors import ModelDirError


def write_model_dir(out_dir: Path | str, write: Callable[[Path], None]) -> Path:
    """Fill a new model directory with `write(tmp)` beside `out_dir`, then rename it into place, so a
    half-built model is never left where a loader would find it."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelDirError(out_dir, "exists and is not an empty directory; choose a new one")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        write(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
