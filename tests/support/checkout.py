"""Where the checkout is, for tests that read its files (the README, proto/, the package's source)
from whichever folder of tests/ they live in."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
