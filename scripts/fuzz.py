#!/usr/bin/env python3
"""Run the fuzz harness (tests/unit/codec/test_fuzz.py) for longer than the test suite does.

    scripts/dev run python scripts/fuzz.py [--examples 20000]

Each property gets --examples inputs; hypothesis keeps failures it finds in .hypothesis/ and
replays them first next time.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20000, help="inputs per property")
    args = parser.parse_args()
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "test_fuzz.py"),
            "--hypothesis-show-statistics",
        ],
        env={**os.environ, "KVMESH_FUZZ_EXAMPLES": str(args.examples)},
        cwd=ROOT,
    )
    print(
        f"fuzz: {args.examples} inputs per property in {time.perf_counter() - start:.0f} s, "
        f"{'nothing found' if result.returncode == 0 else 'FAILURES above'}"
    )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
