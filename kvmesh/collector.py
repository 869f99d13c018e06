"""Python's cyclic garbage collector, kept off what a kvmesh process made at start.

A full collection walks every object the collector tracks while every Python thread waits, and it
comes whenever enough objects have outlived the younger collections: inside whatever runs then. With
mlx-lm and a model loaded a process tracks about 90,000 objects, a full collection 31-57 ms on this
2-core box: over a shaped 1 Gbit/s link one fetch of ten of SmolLM2's coded cache (each about
110 ms) took 185 ms, both its decoding threads stopped for the 57 ms of one (a throwaway trace of
`scripts/bench_transfer.py --links 1000 --repeat 10`). The model, its tokenizer, the server and the
modules live as long as the process, so once they are made `gc.freeze()` moves them out of the
collector's walks (as servers that fork their workers do: CPython's documentation of `gc.freeze`),
and a full collection walks only what came after.
"""

import gc


def freeze_startup_objects() -> int:
    """Collect what starting left behind, then keep every object alive now out of all later
    collections (objects that die are still freed when their last reference goes); how many were
    moved. For a long-running process, once its model is loaded and its server made."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
