"""Python's cyclic garbage collector, kept off what a long-running kvmesh process made at start.

A full collection walks every object the collector tracks while every Python thread waits, and it
comes whenever enough objects have outlived the younger collections: inside whatever runs then. With
mlx-lm and a model loaded a process tracks 90,000-112,000 objects and a full collection takes
40-57 ms on this 2-core box (the daemon, without MLX: 48,000 and 11 ms): over a shaped 1 Gbit/s link
one fetch of ten of SmolLM2's coded cache (each about 110 ms) took 185 ms, both its decoding threads
stopped for the 57 ms of one (a throwaway trace of `scripts/bench_transfer.py --links 1000`). The
model, its tokenizer, the server and the modules live as long as the process, so once they are made
`gc.freeze()` moves them out of the collector's walks, and a full collection walks only what came
after. (CPython documents `gc.freeze` for servers that fork workers, to spare their pages copies;
here it is the walks it spares.)
"""

import gc


def freeze_startup_objects() -> None:
    """Collect what starting left behind, then keep every object alive now out of all later
    collections (one that dies is still freed when its last reference goes; a cycle among them never
    is). For a long-running process, once its model is loaded and its server made."""
    gc.collect()
    gc.freeze()
