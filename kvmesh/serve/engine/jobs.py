"""A request as the engine sees it (`Job`), the events it answers with, and `Output`, which turns
generated tokens into those events: text streamed as it is made, stop strings cut and never
streamed, log probabilities riding on their text. One job's tokens come from mlx-lm's
`stream_generate` (one at a time) or its `BatchGenerator` (many at once): both paths share this.
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from kvmesh.reuse.records import CachedPrefix


class Abandoned(Exception):
    """A job stopped in its prefill: its client left, or the server is stopping."""


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

    def sampler(self) -> Callable[[mx.array], mx.array]:
        """mlx-lm's sampler for these settings."""
        return make_sampler(temp=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)

    def logits_processors(self) -> list["LogitsProcessor"]:
        """mlx-lm's logits processors for these settings (logit bias, penalties)."""
        return make_logits_processors(
            dict(self.logit_bias) or None,
            self.repetition_penalty,
            presence_penalty=self.presence_penalty or None,
            frequency_penalty=self.frequency_penalty or None,
        )


# A logits processor as mlx-lm's generate_step calls it: (the tokens so far, logits) -> logits.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Job:
    """One request: its prompt tokens and settings; `events` carries Delta, then Done (or an exception).

    `listener`, when set, is called after each event is put: an HTTP handler wakes on it instead of
    holding a thread blocked on the queue, so a client that leaves (queued or not) holds nothing.
    `partition`: the prompt-cache partition of a salted request (None: the shared one); `client`:
    who sent it (its address), whose own caches in the shared one serve it to the token.
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
    client: str = ""
    processors: Callable[[], list[LogitsProcessor]] | None = None
    top_logprobs: int | None = None
    # Set by the engine: the prefix found off the generation thread, and when the job came in.
    found: CachedPrefix | None = None
    submitted: float = 0.0

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
    # The cached prefix generation started from, and where it came from (its cache released).
    prefix: CachedPrefix
    # The stop string that ended the text, when one did.
    stop_string: str | None = None

    @property
    def cached_tokens(self) -> int:
        return self.prefix.tokens


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` might begin a stop string: not sent yet."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


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


class Output:
    """One job's generated tokens, as they come, made into its Delta events; then its Done."""

    def __init__(self, job: Job, eos: set[int]):
        self.job, self.eos = job, eos
        self.generated: list[int] = []
        self.text, self.sent, self.finish = "", 0, "length"
        self.stopped_by: str | None = None
        self.pending: list[TokenLogprob] = []  # the log probabilities of tokens whose text is not sent yet
        self.first_token = 0.0  # when the first token came (monotonic seconds), 0 before
        # Decoded in mlx-lm's BatchGenerator: the most jobs it was decoded with at once (0: alone).
        self.batch_size = 0
        self.last_token = 0.0

    def add(self, token: int, text: str, logprobs: mx.array, finish: str | None) -> bool:
        """Take one token (its text, log probabilities, mlx-lm's finish reason); True when a stop
        string ends the job here."""
        self.last_token = time.monotonic()
        if not self.generated:
            self.first_token = self.last_token
        self.generated.append(token)
        if self.job.top_logprobs is not None and token not in self.eos:
            self.pending.append(token_logprob(token, logprobs, self.job.top_logprobs))
        self.text += text
        self.finish = finish or self.finish
        cut, stopped_by = min(((i, s) for s in self.job.stop if (i := self.text.find(s)) >= 0), default=(-1, None))
        if cut >= 0:
            self.text, self.finish, self.stopped_by = self.text[:cut], "stop", stopped_by
            return True
        ready = len(self.text) - held_back(self.text, self.job.stop)
        if ready > self.sent:
            self.job.put(Delta(self.text[self.sent : ready], tuple(self.pending)))
            self.sent, self.pending = ready, []
        return False

    def flush(self) -> None:
        """Send what was held back (the end of the text cannot begin a stop string any more)."""
        if len(self.text) > self.sent or self.pending:
            self.job.put(Delta(self.text[self.sent :], tuple(self.pending)))
            self.sent, self.pending = len(self.text), []

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, less a final end-of-turn token."""
        return len(self.generated) - (1 if self.generated and self.generated[-1] in self.eos else 0)

    def done(self, prefix: CachedPrefix) -> Done:
        return Done(
            self.finish,
            len(self.job.tokens),
            self.completion_tokens,
            prefix=prefix.released(),
            stop_string=self.stopped_by,
        )

    def tokens_per_second(self) -> float:
        seconds = self.last_token - self.first_token
        return (len(self.generated) - 1) / seconds if len(self.generated) > 1 and seconds > 0 else 0.0
