"""Freed heap memory kept for the next array (kvmesh.allocator), where the codec's layer pool is
made: measured as the pages a fresh process faults in while it makes a few arrays of 1 MB and frees
them, again and again, as the codec's passes do.
"""

import json
import os
import platform
import subprocess
import sys

import pytest

from kvmesh.allocator import USER_SETTINGS

pytestmark = [
    pytest.mark.slow,  # (Python children: the thresholds hold for a whole process)
    pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"),
]

FAULTS_AROUND_THE_POOL = """
import json, resource, sys
import numpy as np
from kvmesh.codec.layer_pool import layer_pool

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):  # four 1 MB arrays alive at once, every page written, then all freed
        alive = [np.ones(1 << 18, np.float32) for _ in range(4)]
        del alive
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

first = faults()
layer_pool()
print(json.dumps({"before": first, "after": faults()}))
"""


def faults_around_the_pool(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_AROUND_THE_POOL], capture_output=True, text=True, env={**clean, **env}, check=True
    )
    return json.loads(done.stdout)


def test_the_layer_pool_keeps_freed_arrays_pages_for_the_next():
    """Before the pool is made the arrays' pages fault in afresh each time (the heap's top was
    trimmed, or they were mapped: about 1,000 faults a round); after, they are the last round's."""
    seen = faults_around_the_pool()
    assert seen["before"] > 40 * 900, seen
    assert seen["after"] < 40 * 100, seen


def test_a_user_s_own_malloc_settings_are_kept():
    """Where the user set glibc's threshold the pool leaves it: their setting, not kvmesh's, decides."""
    seen = faults_around_the_pool(MALLOC_TRIM_THRESHOLD_="131072")
    assert seen["after"] > 40 * 900, seen
