"""What several test modules share that is not a fixture: running the `kvmesh` command."""

import os
import subprocess
import sys
from pathlib import Path

# The console script the package installs, beside the interpreter running the tests.
KVMESH = str(Path(sys.executable).with_name("kvmesh"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def cli(*args, data_dir=None, check=True, prefix=(), timeout=300, env=None) -> subprocess.CompletedProcess:
    """`kvmesh [--data-dir DATA_DIR] ARGS` as a user runs it; `prefix` wraps it (`ip netns exec NS`),
    `env` adds environment variables."""
    data = ["--data-dir", str(data_dir)] if data_dir is not None else []
    command = [*prefix, KVMESH, *data, *map(str, args)]
    environment = {**ENV, **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=environment, check=check, timeout=timeout)


def mlx_lm_cli(*args) -> subprocess.CompletedProcess:
    """`python -m mlx_lm ARGS` (mlx-lm's own command line), never raising on failure."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=300
    )


def put(store, cache, fp, tokens, press=None, **options):
    """Encode a sparse cache into a store (EncodeOptions from keywords); returns its manifest."""
    from kvmesh.codec.encode import EncodeOptions, encode_cache

    return store.add(*encode_cache(cache, fp, tokens, press, EncodeOptions(**options)))


def load(store, cache_id):
    """(manifest, decoded sparse cache) of a stored entry."""
    from kvmesh.codec.decode import decode_chunks

    manifest = store.manifest(cache_id)
    return manifest, decode_chunks(manifest, store.chunks(cache_id))
