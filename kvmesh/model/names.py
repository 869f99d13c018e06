"""The names this Mac knows its models by, for people: a model directory's name, or a repo id.

A cache's manifest names its model by content hashes, with a repo id only when the model came from
the Hugging Face cache (a name in it would make the same cache's id differ from Mac to Mac), so
`kvmesh cache list` called every directory's model `llama (<id>)`. The commands that load a model
by the name a user gave keep that name here, in the data directory, by the model's id.
"""

import json
import logging
from pathlib import Path

from kvmesh.files.atomic import write_atomic
from kvmesh.model.fingerprint import ModelFingerprint

log = logging.getLogger(__name__)


def names_file(data_dir: Path) -> Path:
    return data_dir / "model-names.json"


def model_names(data_dir: Path) -> dict[str, str]:
    """model id -> the name it was last loaded by here; {} when none was kept (or the file is damaged:
    the names are only for people, and come back as models are loaded)."""
    try:
        names = json.loads(names_file(data_dir).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): models are named by their type", names_file(data_dir), e)
        return {}
    return {str(k): str(v) for k, v in names.items()} if isinstance(names, dict) else {}


def remember_name(data_dir: Path, fp: ModelFingerprint, given: str) -> None:
    """Keep the name the model `fp` was loaded by (`given`: a directory or a repo id): its repo id
    when known, else the directory's own name. Written atomically; a write that fails (a read-only
    data dir) only costs the name."""
    name = fp.repo_id or Path(given).expanduser().resolve().name
    names = model_names(data_dir)
    if not name or names.get(fp.model_id) == name:
        return
    path = names_file(data_dir)
    try:
        write_atomic(path, json.dumps({**names, fp.model_id: name}, indent=1, sort_keys=True))
    except OSError as e:  # (a read-only file system: EROFS)
        log.warning("cannot keep the model's name in %s: %s", path, e.strerror or e)
