"""Many requests at once: mlx-lm's `BatchGenerator` decoding together the jobs whose caches it can
merge (the dense caches of memory, of a fresh prompt, of most peers' and the store's).

Each job keeps what it has alone: its own sampler and logits processors (penalties, logit bias),
its prefix from the prompt cache (`BatchGenerator.insert` takes it, and the tokens it covers, whose
history the penalties see), its stop strings and log probabilities (kvmesh.serve.engine.jobs.Output), and
its cache back into the prompt cache when it ends. Prompts are prefilled in chunks of
`prefill_step` tokens, one chunk per step, so a job whose client left is dropped within a chunk.
A cache from the store or a peer joins as one made here (`merge_ready`). Jobs it cannot take (a
cache with evicted or quantized positions, a seed: mlx-lm's random state is one for the whole
batch, a grammar) are generated one at a time by the engine (kvmesh.serve.engine.solo), a token at a time
between the batch's steps.
Every method runs on the generation thread.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

from kvmesh.caches.sparse import SparseKVCache
from kvmesh.reuse.records import CachedPrefix
from kvmesh.serve.engine.jobs import Abandoned, Job, Output


def batchable_model(model: nn.Module) -> bool:
    """Whether mlx-lm can batch this model's caches at all (as mlx_lm.server decides)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


def merge_ready(cache: list[Any] | None) -> list[Any] | None:
    """`cache` with each layer that holds every position it processed (a cache from the store or a
    peer that evicted nothing comes as kvmesh's SparseKVCache) as mlx-lm's own KVCache, which
    BatchGenerator merges: such a cache then joins a batch as one prefilled here does. Layers that
    evicted positions, or hold them quantized, stay as they are (mlx-lm merges neither)."""
    return None if cache is None else [dense_layer(layer) for layer in cache]


def dense_layer(layer: Any) -> Any:
    if isinstance(layer, CacheList):
        return CacheList(*(dense_layer(part) for part in layer.caches))
    if type(layer) is SparseKVCache and layer.keys is not None and layer.n_kept == layer.offset:
        dense = KVCache()
        dense.state = (*layer.keys_and_values(), layer.offset)
        return dense
    return layer


def batchable(job: Job, hit: CachedPrefix) -> bool:
    """Whether `job`, starting from `hit`, can join a batch."""
    if job.sampling.seed is not None or job.processors is not None:
        return False
    return hit.cache is None or all(hasattr(c, "merge") for c in hit.cache)


@dataclass
class Slot:
    job: Job
    hit: CachedPrefix
    output: Output
    detokenizer: Any


class Batch:
    """The jobs decoding together; `finished(job, output, hit, cache)` is called for each that ends
    (its cache, or None when it ended in its prefill)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        prefill_step: int,
        wanted: Callable[[Job], bool],
        finished: Callable[[Job, Output, CachedPrefix, list[Any] | None], None],
    ):
        self.tokenizer, self.wanted, self.finished = tokenizer, wanted, finished
        self.eos = set(tokenizer.eos_token_ids)
        self.generator = BatchGenerator(
            model, stop_tokens=[[t] for t in sorted(self.eos)], prefill_step_size=prefill_step
        )
        self.slots: dict[int, Slot] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, job: Job, hit: CachedPrefix) -> None:
        sampling = job.sampling
        # Greedy jobs share mlx-lm's default sampler (None): the whole batch is sampled in one call.
        sampler = None if sampling.temperature == 0 else sampling.sampler()
        processors = sampling.logits_processors()
        (uid,) = self.generator.insert(
            [job.tokens[hit.tokens :]],
            max_tokens=[job.max_tokens],
            caches=[hit.cache] if hit.cache is not None else None,
            all_tokens=[job.tokens[: hit.tokens]],
            samplers=[sampler] if sampler is not None else None,
            logits_processors=[processors],
        )
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        self.slots[uid] = Slot(job, hit, Output(job, self.eos), detokenizer)

    def step(self) -> None:
        """One step: a prefill chunk for the jobs prefilling, a token for each job decoding."""
        for slot in self.slots.values():
            slot.output.batch_size = max(slot.output.batch_size, len(self.slots))
        prompt_responses, responses = self.generator.next()
        leaving = [r.uid for r in prompt_responses if not self.wanted(self.slots[r.uid].job)]
        ended: list[int] = []
        for r in responses:
            slot = self.slots[r.uid]
            detokenizer = slot.detokenizer
            if r.finish_reason != "stop":  # (an end-of-turn token has no text)
                detokenizer.add_token(r.token)
            if r.finish_reason is not None:
                detokenizer.finalize()
            cut = slot.output.add(r.token, detokenizer.last_segment, r.logprobs, r.finish_reason)
            if r.finish_reason is not None:
                del self.slots[r.uid]
                self.finished(slot.job, slot.output, slot.hit, r.prompt_cache)
            elif cut or not self.wanted(slot.job):
                ended.append(r.uid)
        if leaving:
            self.generator.remove(leaving)
            for uid in leaving:
                slot = self.slots.pop(uid)
                self.finished(slot.job, slot.output, slot.hit, None)
        if ended:
            caches = self.generator.remove(ended, return_prompt_caches=True)
            for uid in ended:
                slot = self.slots.pop(uid)
                self.finished(slot.job, slot.output, slot.hit, caches[uid][0] if uid in caches else None)

    def abandon(self) -> None:
        """The server is stopping: every job here is told so."""
        self.generator.remove(list(self.slots))
        for slot in self.slots.values():
            slot.job.put(Abandoned("the server is stopping"))
        self.slots.clear()

    def close(self) -> None:
        self.generator.close()
