"""The threads that code and decode transform-coded layers: one pool for the whole process.

On a CPU MLX runs each operation of a layer's graph on one core, one after another, so layers coded
or decoded two at a time keep two cores busy (SmolLM2's cache decoded at 0.172 GB/s on one thread,
0.275 on two, on a 2-core box); on a GPU a second layer overlaps one layer's zstd and header with
another's kernels.

The pool is made once because MLX gives every thread that evaluates a stream of its own, whose
worker thread outlives it (mlx 0.32: 50 short-lived pools of 2 threads left 100 threads behind): a
pool per fetch would leave two threads behind each, for as long as a daemon or server runs. Work
that is already on one of these threads runs in place, so a layer's work never waits for a thread
its own caller holds.

Each layer's products run on one BLAS thread: where the codec's products are NumPy's (on a CPU:
kvmesh.codec.transform_decode), OpenBLAS's own threads would spin between products and take the
other layer's core (a 1,024-token SmolLM2 cache, as the daemon runs it, no OpenBLAS preloaded, three
runs each on a 2-core box: decoding at 0.18-0.20 GB/s against 0.23-0.24 on one BLAS thread, coding at
0.08-0.12 against 0.13-0.15). So the pool, when made where the products are NumPy's, sets NumPy's
BLAS to one thread for the process (threadpoolctl). Where MLX computes on a GPU (a Mac), NumPy's BLAS
runs none of the codec's work, and is left as it is for whatever else the process computes with it.
Where the C library is glibc, the pool also tunes its allocator as the `kvmesh` command does
(kvmesh.allocator): a layer's arrays reuse the last layer's pages.
"""

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import mlx.core as mx
from threadpoolctl import threadpool_limits

from kvmesh.allocator import tune_allocator

T = TypeVar("T")
R = TypeVar("R")

# Layers coded or decoded at once.
LAYER_THREADS = min(4, os.cpu_count() or 1)
THREAD_PREFIX = "kvmesh-coded"

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: its parent's threads are not there, so it makes a pool of its own."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def numpy_by_default() -> bool:
    """Whether the codec's elementwise steps and matrix products run in NumPy (where MLX computes on
    the CPU: NumPy's passes are several times quicker there than MLX's, which run one after another
    on one core, and its products far quicker: kvmesh.codec.transform_decode's `_synthesised`)
    rather than in MLX's graphs (what a GPU runs)."""
    return mx.default_device() == mx.cpu


def layer_pool() -> ThreadPoolExecutor:
    """The process's pool of `LAYER_THREADS` threads (made on first use, kept for the process)."""
    global _pool
    with _lock:
        if _pool is None:
            if numpy_by_default():
                threadpool_limits(1, user_api="blas")
            tune_allocator()
            _pool = ThreadPoolExecutor(LAYER_THREADS, thread_name_prefix=THREAD_PREFIX)
        return _pool


def on_layer_thread() -> bool:
    return threading.current_thread().name.startswith(THREAD_PREFIX)


def map_layers(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """fn over items on the pool, results in order (in place when called from the pool itself)."""
    if LAYER_THREADS <= 1 or on_layer_thread():
        return [fn(item) for item in items]
    return list(layer_pool().map(fn, items))
