"""The server's generation thread: one request at a time, mlx-lm's generation, the mesh's prompt cache.

MLX work stays on this one thread; HTTP handlers hand it jobs and read events back from a queue.
A request's text streams as it is made; the request completes (finish reason, usage) once its cache
is in memory and, when long enough, in the local store.
Concurrent requests are served one after another, in arrival order (no batching: sparse and
quantized caches from the mesh cannot be batched by mlx-lm, and one Mac's GPU is one resource).
Sampling and stopping are mlx-lm's: `make_sampler`, `make_logits_processors` (penalties, logit
bias), `stream_generate` (EOS ids from the tokenizer), plus stop strings, which are cut from the text
and never streamed. A job may add logits processors of its own (a grammar: kvmesh.serve.grammar),
and ask for each token's log probability (and the most likely alternatives) from mlx-lm's.
"""

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from kvmesh.generation import calibrate
from kvmesh.serve.prompt_cache import MeshPromptCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """mlx-lm's sampler and logits processors, with their settings (0 or None: off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


# A logits processor as mlx-lm's generate_step calls it: (the tokens so far, logits) -> logits.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Job:
    """One request: its prompt tokens and settings; `events` carries Delta, then Done (or an exception).

    `listener`, when set, is called after each event is put: an HTTP handler wakes on it instead of
    holding a thread blocked on the queue, so a client that leaves (queued or not) holds nothing.
    `partition`: the prompt-cache partition of a salted request (None: the shared one).
    `processors`, when set, makes the job's own logits processors (a grammar), on the generation
    thread (MLX arrays stay there). `top_logprobs`: None for no log probabilities, else each
    token's and that many alternatives' (0: the token's only).
    """

    tokens: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: list[str] = field(default_factory=list)
    events: "queue.Queue[Started | Delta | Done | Exception]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    listener: Callable[[], None] | None = None
    partition: bytes | None = None
    processors: Callable[[], list[LogitsProcessor]] | None = None
    top_logprobs: int | None = None

    def put(self, event: "Started | Delta | Done | Exception") -> None:
        self.events.put(event)
        if self.listener is not None:
            self.listener()


@dataclass(frozen=True)
class Started:
    """The prefix is found and generation starts: what an API that reports cached tokens up front
    (Anthropic's message_start) needs before the first token."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability, and the most likely tokens at its place."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    # The tokens whose text this is, with their log probabilities (when the job asked for them).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Where the cached prefix came from ("memory", "local store", "peer ADDRESS", "none"), bytes moved, seconds.
    prefix_from: str
    wire_bytes: int
    prefix_seconds: float
    skipped: list[str]
    # Each choice between fetching a peer's cache and prefilling here, with its figures.
    choices: list[str]
    # The stop string that ended the text, when one did.
    stop_string: str | None = None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` might begin a stop string: not sent yet."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class Engine:
    """Runs jobs on one thread, in order."""

    def __init__(self, model: nn.Module, tokenizer: Any, prompt_cache: MeshPromptCache):
        self.model, self.tokenizer, self.prompt_cache = model, tokenizer, prompt_cache
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvmesh-generate", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> Job:
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        if (rates := self.prompt_cache.rates) is not None:
            calibrate(self.model, self.prompt_cache.model_fp, rates)  # before the first request's choice
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            try:
                self._generate(job)
            except Exception as e:  # reported to this request; the thread serves the next one
                log.exception("generation failed")
                job.put(e)

    def _generate(self, job: Job) -> None:
        hit = self.prompt_cache.fetch(job.tokens, partition=job.partition)
        cache = hit.cache if hit.cache is not None else make_prompt_cache(self.model)
        job.put(Started(len(job.tokens), hit.tokens))
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        sampling = job.sampling
        sampler = make_sampler(
            temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p
        )
        processors = make_logits_processors(
            dict(sampling.logit_bias) or None,
            sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty or None,
            frequency_penalty=sampling.frequency_penalty or None,
        )
        if job.processors is not None:
            processors += job.processors()
        generated: list[int] = []
        text, sent, finish, stopped_by = "", 0, "length", None
        pending: list[TokenLogprob] = []  # the log probabilities of tokens whose text is not sent yet
        eos = set(self.tokenizer.eos_token_ids)
        for response in stream_generate(
            self.model,
            self.tokenizer,
            mx.array(job.tokens[hit.tokens :]),
            max_tokens=job.max_tokens,
            sampler=sampler,
            logits_processors=processors or None,
            prompt_cache=cache,
        ):
            if not generated and self.prompt_cache.rates is not None:  # the prefill is done: its rate
                self.prompt_cache.rates.record_prefill(
                    self.prompt_cache.model_fp.model_id,
                    response.prompt_tokens,
                    response.prompt_tokens / response.prompt_tps if response.prompt_tps else 0.0,
                    context=hit.tokens,
                )
            generated.append(response.token)
            if job.top_logprobs is not None and response.token not in eos:
                pending.append(token_logprob(response.token, response.logprobs, job.top_logprobs))
            text += response.text
            finish = response.finish_reason or finish
            cut, stopped_by = min(((i, s) for s in job.stop if (i := text.find(s)) >= 0), default=(-1, None))
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            ready = len(text) - held_back(text, job.stop)
            if ready > sent:
                job.put(Delta(text[sent:ready], tuple(pending)))
                sent, pending = ready, []
            if job.cancelled.is_set():
                break
        if len(text) > sent or pending:
            job.put(Delta(text[sent:], tuple(pending)))
        completion = len(generated) - (1 if generated and generated[-1] in eos else 0)
        # The text is out; the request completes once its cache is kept, so that the next request,
        # here or on any peer, finds it.
        covered = self.prompt_cache.insert(job.tokens + generated, cache, partition=job.partition)
        if job.partition is None:  # a salted request's cache stays in its own partition of memory
            self.prompt_cache.persist(covered, cache)
        job.put(
            Done(
                finish,
                len(job.tokens),
                completion,
                hit.tokens,
                hit.where,
                hit.wire_bytes,
                hit.seconds,
                hit.skipped,
                hit.choices,
                stop_string=stopped_by,
            )
        )


def token_logprob(token: int, logprobs: mx.array, top: int) -> TokenLogprob:
    """`token`'s log probability in mlx-lm's `logprobs` (after the logits processors: a grammar's
    masked tokens are -inf), and the `top` most likely tokens with theirs, most likely first."""
    chosen = cast(float, logprobs[token].item())
    if top <= 0:
        return TokenLogprob(token, chosen)
    best = mx.argpartition(-logprobs, kth=top - 1)[:top]
    values = logprobs[best]
    order = mx.argsort(-values)
    ids, lps = cast(list[int], best[order].tolist()), cast(list[float], values[order].tolist())
    return TokenLogprob(token, chosen, tuple(zip(ids, lps)))
