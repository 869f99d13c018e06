"""The engine of `kvmesh serve`: the generation thread and what it works with, beneath the APIs and
the HTTP layer: `generation` (the thread, its lookups and its store writes), `jobs` (a request as the
engine runs it: sampling, output, events), `batch` (requests decoded together in mlx-lm's
`BatchGenerator`), `solo` (a request generated alone between the batch's steps) and `prompt_cache`
(memory, the store and the mesh as one prompt cache). The layers above take its vocabulary from here.
"""

from kvmesh.serve.engine.generation import RETRY_AFTER_S, Busy, Engine, Place
from kvmesh.serve.engine.jobs import (
    Abandoned,
    Delta,
    Done,
    Job,
    LogitsProcessor,
    Sampling,
    Started,
    TokenLogprob,
    held_back,
    token_logprob,
)

__all__ = [
    "RETRY_AFTER_S",
    "Abandoned",
    "Busy",
    "Delta",
    "Done",
    "Engine",
    "Job",
    "LogitsProcessor",
    "Place",
    "Sampling",
    "Started",
    "TokenLogprob",
    "held_back",
    "token_logprob",
]
