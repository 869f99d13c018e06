"""Freed heap memory kept for the next array, where the C library is glibc: the codec's temporaries.

The codec makes and frees arrays of a few hundred KB to a few MB per layer (NumPy's passes over a
layer's rows and coefficients). glibc's malloc maps every block above its mmap threshold afresh
(after a free the threshold rises to that block's size, and a block of the same size is mapped
again), and trims the heap's top once twice that is free: so each such array's pages fault in
again. On a 2-core Linux VM that made a 177 x 1,023 quantization 1.39 ms where it takes 0.55 ms
with the pages reused, and SmolLM2's 1,024-token cache coded in 142, 133 and 142 ms against 157,
147 and 165 (three alternated pairs of runs; decoding did not move). With the thresholds set,
blocks up to `MMAP_THRESHOLD` come from the heap and up to `TRIM_THRESHOLD` of free heap is kept
per arena (a ceiling on what is kept, not an allocation). macOS's allocator keeps its own; a user
who sets glibc's `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` keeps theirs.
"""

import ctypes
import os
import platform

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; whether they were set (not on another C library,
    nor where the user set them)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    libc = ctypes.CDLL(None)  # (the C library the process runs on)
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(mapped and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
