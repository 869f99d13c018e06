#!/usr/bin/env python3
"""What importing each kvmesh module costs: kvmesh modules loaded, whether MLX loads, seconds; and
how long `kvmesh --version` and `kvmesh status` (without a daemon) take.

    scripts/dev run python scripts/import_report.py

Each module is imported in a fresh interpreter, so the figures are what importing it costs alone.
"""

import json
import pkgutil
import statistics
import subprocess
import sys
import tempfile
import time

import kvmesh
from support.processes import KVMESH

PROBE = """
import importlib, json, sys, time
t = time.perf_counter()
importlib.import_module(sys.argv[1])
dt = time.perf_counter() - t
mods = sorted(m for m in sys.modules if m == "kvmesh" or m.startswith("kvmesh."))
print(json.dumps({"loaded": [m for m in mods if not m.startswith("kvmesh.v1")], "mlx": "mlx.core" in sys.modules,
                  "mlx_lm": "mlx_lm" in sys.modules, "seconds": dt}))
"""


def main() -> None:
    names = sorted(
        m.name
        for m in pkgutil.walk_packages(kvmesh.__path__, "kvmesh.")
        if not m.name.startswith("kvmesh.v1") and m.name != "kvmesh.__main__"
    )
    print(f"{'module':<34} {'kvmesh modules loaded':>21} {'mlx':>4} {'mlx_lm':>6} {'import s':>8}")
    for name in names:
        out = subprocess.run([sys.executable, "-c", PROBE, name], capture_output=True, text=True)
        if out.returncode:
            print(f"{name:<34} failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout)
        print(
            f"{name:<34} {len(r['loaded']) - 1:>21} {'yes' if r['mlx'] else '-':>4} "
            f"{'yes' if r['mlx_lm'] else '-':>6} {r['seconds']:>8.2f}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        for args in (["--version"], ["--data-dir", tmp, "status"]):
            times = []
            for _ in range(5):
                start = time.perf_counter()
                subprocess.run([KVMESH, *args], capture_output=True)
                times.append(time.perf_counter() - start)
            shown = " ".join(a if a != tmp else "DIR" for a in args)
            print(f"kvmesh {shown}: median {statistics.median(times):.3f} s of 5 runs")


if __name__ == "__main__":
    main()
