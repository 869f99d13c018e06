"""One atomic write for every small file kvmesh keeps (state, ids, credentials, lists, rates, names).

A reader (another daemon, a command, a server) sees the old file or the new one, never half of
either: the bytes go to a temporary file beside the target, unique to this process and thread so
two writers never share one, then `os.replace` swaps it in. A failed write removes its temporary
file and raises the OSError, so the caller decides whether that is fatal (credentials) or only
advice (rates, names).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path | str, data: bytes | str, *, mode: int = 0o644, durable: bool = False) -> None:
    """Write `data` to `path` atomically, creating its folder; `mode` 0o600 keeps a secret this user's
    (the file is created with it, never widened first); `durable` fsyncs before the swap, for files
    whose loss after a power cut would cost more than a recomputation."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
