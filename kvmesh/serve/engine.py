"""The server's generation thread: one request at a time, mlx-lm's generation, the mesh's prompt cache.

MLX work stays on this one thread; HTTP handlers hand it jobs and read events back from a queue.
A request's text streams as it is made; the request completes (finish reason, usage) once its cache
is in memory and, when long enough, in the local store.
Concurrent requests are served one after another, in arrival order (no batching: sparse and
quantized caches from the mesh cannot be batched by mlx-lm, and one Mac's GPU is one resource).
Sampling and stopping are mlx-lm's: `make_sampler`, `stream_generate` (EOS ids from the tokenizer),
plus stop strings, which are cut from the text and never streamed.
"""

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from kvmesh.generation import calibrate
from kvmesh.serve.prompt_cache import MeshPromptCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Job:
    """One request: its prompt tokens and settings; `events` carries Delta, then Done (or an exception).

    `listener`, when set, is called after each event is put: an HTTP handler wakes on it instead of
    holding a thread blocked on the queue, so a client that leaves (queued or not) holds nothing.
    `partition`: the prompt-cache partition of a salted request (None: the shared one).
    """

    tokens: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: list[str] = field(default_factory=list)
    events: "queue.Queue[Delta | Done | Exception]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    listener: Callable[[], None] | None = None
    partition: bytes | None = None

    def put(self, event: "Delta | Done | Exception") -> None:
        self.events.put(event)
        if self.listener is not None:
            self.listener()


@dataclass(frozen=True)
class Delta:
    text: str


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
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        sampler = make_sampler(temp=job.sampling.temperature, top_p=job.sampling.top_p)
        generated: list[int] = []
        text, sent, finish = "", 0, "length"
        eos = set(self.tokenizer.eos_token_ids)
        for response in stream_generate(
            self.model,
            self.tokenizer,
            mx.array(job.tokens[hit.tokens :]),
            max_tokens=job.max_tokens,
            sampler=sampler,
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
            text += response.text
            finish = response.finish_reason or finish
            cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            ready = len(text) - held_back(text, job.stop)
            if ready > sent:
                job.put(Delta(text[sent:ready]))
                sent = ready
            if job.cancelled.is_set():
                break
        if len(text) > sent:
            job.put(Delta(text[sent:]))
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
            )
        )
