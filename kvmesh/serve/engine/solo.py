"""One job generated on its own with mlx-lm's `stream_generate`, a token per `step`, so that the
engine interleaves it with the batch: a job that cannot be batched (a seed, a grammar or thinking
budget, a sparse or quantized cache) never holds batchable work behind it, nor waits behind it.

Its prompt is prefilled in the first step, in chunks of `prefill_step` tokens with a look between
chunks at whether the job is still wanted. Every method runs on the generation thread.
"""

from collections.abc import Callable, Generator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from kvmesh.reuse.records import CachedPrefix
from kvmesh.serve.engine.jobs import Abandoned, Job, Output


class Solo:
    """One job's generation; `finished(job, output, hit, cache)` is called when it ends (its cache,
    or None when it ended in its prefill), `prefilled(response, hit)` once its prefill is done."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        job: Job,
        hit: CachedPrefix,
        *,
        prefill_step: int,
        wanted: Callable[[Job], bool],
        prefilled: Callable[[GenerationResponse, CachedPrefix], None],
        finished: Callable[[Job, Output, CachedPrefix, list[Any] | None], None],
    ):
        self.job, self.hit, self.wanted, self.prefilled, self.finished = job, hit, wanted, prefilled, finished
        self.cache = hit.cache if hit.cache is not None else make_prompt_cache(model)
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        processors = job.sampling.logits_processors()
        if job.processors is not None:
            processors += job.processors()

        def still_wanted(done: int, total: int) -> None:  # between prefill chunks
            if not wanted(job):
                raise Abandoned()

        self.output = Output(job, set(tokenizer.eos_token_ids))
        self._tokens: Generator[GenerationResponse, None, None] = stream_generate(
            model,
            tokenizer,
            mx.array(job.tokens[hit.tokens :]),
            max_tokens=job.max_tokens,
            sampler=job.sampling.sampler(),
            logits_processors=processors or None,
            prompt_cache=self.cache,
            prefill_step_size=prefill_step,
            prompt_progress_callback=still_wanted,
        )

    def step(self) -> bool:
        """One token (the first step prefills the prompt first); False once the job has ended.
        Abandoned, raised when it was left in its prefill, ends it too (after `finished`)."""
        try:
            response = next(self._tokens)
        except StopIteration:
            self.finished(self.job, self.output, self.hit, self.cache)
            return False
        except Abandoned:
            self.finished(self.job, self.output, self.hit, None)
            raise
        if not self.output.generated:
            self.prefilled(response, self.hit)
        if self.output.add(response.token, response.text, response.logprobs, response.finish_reason) or not (
            self.wanted(self.job)
        ):
            self.close()
            return False
        return True

    def close(self) -> None:
        """End it here (a stop string, its client left, the server stops): its cache is kept as far
        as it went."""
        self._tokens.close()
        self.finished(self.job, self.output, self.hit, self.cache)
