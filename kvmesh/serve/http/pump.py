"""A job's events carried from the generation thread to the event loop and read into an answer's
pieces. No thread waits on them: the engine sets an event on the loop when it has news, so a client
that leaves while its job is queued or running leaves nothing behind."""

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request

from kvmesh.serve.answer import AnswerSplitter, Reasoning
from kvmesh.serve.api_errors import ApiError
from kvmesh.serve.engine import RETRY_AFTER_S, Abandoned, Busy, Delta, Done, Engine, Job, Place, Started, TokenLogprob
from kvmesh.serve.tools import ToolCall
from kvmesh.serve.turns import Outcome, Piece, Text

# How often a non-streaming request that waits on its job checks that its client is still there.
DISCONNECT_CHECK_S = 0.5
T = TypeVar("T")


@dataclass
class Ticket:
    """A job the engine holds, and the event set (on the loop) whenever it has news."""

    job: Job
    news: asyncio.Event


def busy_or(work: Callable[[], T]) -> T:
    """`work`'s result, or the 429 that refuses the request when the engine holds all it may."""
    try:
        return work()
    except Busy as e:
        raise ApiError(
            429,
            f"{e}: try again in a moment",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None


def start(engine: Engine, job: Job, place: Place) -> Ticket:
    """Submit `job` in the place its request took (a 429 when the server is stopping)."""
    loop = asyncio.get_running_loop()
    news = asyncio.Event()

    def notify() -> None:  # on the generation thread
        with contextlib.suppress(RuntimeError):  # the loop has closed (the server stopped): nobody waits
            loop.call_soon_threadsafe(news.set)

    job.listener = notify
    busy_or(lambda: engine.submit(job, place))
    return Ticket(job, news)


async def events(ticket: Ticket, request: Request | None = None) -> AsyncIterator[Started | Delta | Done]:
    """The job's events as they come. With `request` (a non-streaming one), a client that went away
    is noticed within DISCONNECT_CHECK_S too."""
    job, news = ticket.job, ticket.news
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            if request is not None and loop.time() - checked >= DISCONNECT_CHECK_S:
                if await request.is_disconnected():
                    return
                checked = loop.time()
            try:
                event = job.events.get_nowait()
            except queue.Empty:
                news.clear()
                if job.events.empty():  # (the engine's next put sets `news` after this clear)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(news.wait(), DISCONNECT_CHECK_S)
                continue
            if isinstance(event, Abandoned):
                raise ApiError(503, str(event), code="unavailable")
            if isinstance(event, Exception):
                raise ApiError(500, f"generation failed: {event}", code="generation_failed")
            yield event
            if isinstance(event, Done):
                return
    finally:
        job.cancelled.set()  # a client that went away stops its generation, or skips it when queued


async def pieces(ticket: Ticket, splitter: AnswerSplitter, request: Request | None = None) -> AsyncIterator[Piece]:
    """The job's answer as it comes: Started, then reasoning, text and tool calls (read by
    `splitter`), then Done. Each delta's log probabilities ride on its first text."""
    async for event in events(ticket, request):
        if isinstance(event, Delta):
            logprobs = event.logprobs
            for piece in splitter.feed(event.text):
                if isinstance(piece, str):
                    yield Text(piece, logprobs)
                    logprobs = ()
                else:
                    yield piece
            if logprobs:
                yield Text("", logprobs)
        elif isinstance(event, Done):
            for piece in splitter.finish():
                yield Text(piece) if isinstance(piece, str) else piece
            yield event
        else:
            yield event


def leave(ticket: Ticket) -> BackgroundTask:
    """Run once a streamed answer ends, however it ends: a client that left before its stream
    began (so no `finally` of it ran) holds no place either."""
    return BackgroundTask(ticket.job.cancelled.set)


async def collect(stream: AsyncIterator[Piece]) -> Outcome | None:
    """The whole answer, or None when the client went away first."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    logprobs: list[TokenLogprob] = []
    async for piece in stream:
        if isinstance(piece, Reasoning):
            thoughts.append(piece.text)
        elif isinstance(piece, Text):
            texts.append(piece.text)
            logprobs.extend(piece.logprobs)
        elif isinstance(piece, ToolCall):
            calls.append(piece)
        elif isinstance(piece, Done):
            return Outcome("".join(texts), calls, logprobs, piece, reasoning="".join(thoughts))
    return None
