"""The HTTP APIs of `kvmesh serve` (Starlette; streaming as server-sent events).

Routes: POST /v1/chat/completions and /v1/completions (OpenAI), /v1/messages and
/v1/messages/count_tokens (Anthropic), /v1/responses (OpenAI's Responses API), all streaming or not;
GET /v1/models, /v1/models/{id} and /health. Each API's body becomes a `Turn`
(kvmesh.serve.turns), which runs the same way for all; its module writes the answer back in the
API's shape. Errors have the API's shape (OpenAI's `{"error": {"message", "type", "param", "code"}}`,
Anthropic's `{"type": "error", "error": {...}}`) with the matching HTTP status, and never stop the
server. `usage` carries the prefix that was not prefilled (`prompt_tokens_details.cached_tokens`,
`cache_read_input_tokens`, `input_tokens_details.cached_tokens`), chat's a `kvmesh` object too.

The event loop only moves bytes: a body's JSON and a prompt's tokens are made on a small pool of
threads, so /health and every other request are answered meanwhile. The work is counted before it
is done: a prompt whose characters or messages alone cannot fit the context is refused before it is
rendered (a 30 MB one took the tokenizer two minutes), a request takes its place among the held
ones (or its 429) before its prompt is made, and a request's tools are bounded
(kvmesh.serve.tools). A request's `cache_salt` (vLLM's field) keeps its caches apart: see
`kvmesh.serve.prompt_cache`, which explains what a salted request shares and what it does not.
"""

import asyncio
import contextlib
import hashlib
import json
import queue
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.serve import anthropic, openai_api, responses
from kvmesh.serve.answer import AnswerSplitter, Reasoning, starts_in_reasoning
from kvmesh.serve.api_errors import ApiError, refuse
from kvmesh.serve.engine import (
    RETRY_AFTER_S,
    Abandoned,
    Busy,
    Delta,
    Done,
    Engine,
    Job,
    Place,
    Started,
    TokenLogprob,
)
from kvmesh.serve.grammar import GrammarError, Grammars, json_object_grammar, json_schema_grammar
from kvmesh.serve.thinking_budget import ThinkingBudget, marker_ids
from kvmesh.serve.tools import ToolCall, check_model_calls_tools, forced_call_grammar
from kvmesh.serve.turns import Outcome, Text, Turn


@dataclass(frozen=True)
class ServedModel:
    """The model this server answers for: the names a client may use, and its context length."""

    name: str
    aliases: frozenset[str]
    context_length: int

    def serves(self, name: str, claude_names: bool = False) -> bool:
        """Whether `name` is this model. With `claude_names` (the Anthropic API), any "claude-..."
        name is too: Claude Code asks for Claude models by name (its main and its small fast model),
        and both are the one model served here."""
        return name in self.aliases or (claude_names and name.startswith("claude"))


__all__ = ["ApiError", "ServedModel", "make_app"]

# What a running turn yields: the prefix found, reasoning, text, calls, and the end.
Piece = Started | Reasoning | Text | ToolCall | Done


# How often a non-streaming request that waits on its job checks that its client is still there.
DISCONNECT_CHECK_S = 0.5
# Names a loopback server answers to. A web page's request to 127.0.0.1 that arrives under another
# Host (DNS rebinding) or from another Origin (a page's script) is refused: without an API key the
# loopback API is open to whatever reaches it, and a browser reaches it for any page it shows.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# The names by which a container on this Mac reaches its loopback (Docker Desktop's and OrbStack's,
# Podman's, Lima's and so Colima's): Open WebUI in Docker calls http://host.docker.internal:8080/v1.
# No public DNS name is one of them (.internal is reserved for private use), so a rebinding page
# cannot take them; and a browser's request under them still carries its Origin, which is checked.
CONTAINER_HOSTS = frozenset(
    {
        "host.docker.internal",
        "gateway.docker.internal",
        "host.orb.internal",
        "host.containers.internal",
        "host.lima.internal",
    }
)
# Threads that parse bodies and tokenize prompts, off the event loop. Few: each may hold a huge
# prompt, and tokenizing is the tokenizer's (Rust) work, which more threads would not speed up here.
PARSE_THREADS = 2


@dataclass
class Ticket:
    """A job the engine holds, and the event set (on the loop) whenever it has news."""

    job: Job
    news: asyncio.Event


# A prompt of C characters is at least C / (TOKEN_CHARS_MARGIN x the longest token's characters)
# tokens: a byte-level vocabulary's token of k characters stands for k bytes, and a character is one
# or more; the margin covers a normalizer that composes two characters into one (NFKC).
TOKEN_CHARS_MARGIN = 2
# The longest cache_salt taken (vLLM suggests 43 characters, 256 random bits in base64).
MAX_SALT_CHARS = 1024
T = TypeVar("T")


def host_name(value: str) -> str:
    """`127.0.0.1:8080` -> `127.0.0.1`, `[::1]:8080` -> `[::1]`, `http://localhost:3000` -> `localhost`."""
    value = value.lower().split("://", 1)[-1].split("/", 1)[0]
    if value.startswith("["):
        return value.split("]", 1)[0] + "]"
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def cache_partition(body: dict) -> bytes | None:
    """The prompt-cache partition a request's `cache_salt` names (a digest: the salt itself is not
    kept), or None for the one every unsalted request shares."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT_CHARS:
        raise ApiError(
            400,
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters (a random secret)",
            "cache_salt",
            "invalid_value",
        )
    return hashlib.sha256(salt.encode()).digest()


def prompt_chars(turn: Turn) -> int:
    """Characters of `turn` that any rendering writes out: a raw prompt's, or the text of the
    messages other than the assistant's (a template may drop an earlier answer's reasoning)."""
    if turn.messages is None:
        return len(turn.prompt or "")
    return sum(
        len(m["content"]) for m in turn.messages if m.get("role") != "assistant" and isinstance(m.get("content"), str)
    )


def make_app(
    engine: Engine,
    model: ServedModel,
    api_key: str | None = None,
    default_max_tokens: int = 512,
    *,
    max_body_bytes: int = 32 << 20,
    read_timeout: float = 30.0,
    loopback: bool = True,
    cors_origins: tuple[str, ...] = (),
    allowed_hosts: tuple[str, ...] = (),
) -> Starlette:
    """The ASGI application; requests go to `engine` (a 429 past its bound). A body over `max_body_bytes`
    is refused unread, one that pauses for `read_timeout` seconds gets a 408; on `loopback`,
    requests under a Host other than a loopback name, a container's name for the host or one of
    `allowed_hosts` are refused too, and so are those from another Origin, except from `cors_origins`
    ("*": any), which browsers may call (CORS). `default_max_tokens` 0: a request that gives no
    limit may generate to the end of the context."""
    tokenizer = engine.tokenizer
    words = tokenizer.get_vocab()
    vocab = len(words)
    token_chars = max(map(len, words), default=1)  # (an added token's text counts: a prompt may hold it)
    grammars = Grammars(tokenizer)
    parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kvmesh-parse")
    host_names = LOOPBACK_NAMES | CONTAINER_HOSTS | {name.lower() for name in allowed_hosts}

    async def off_loop(work: Callable[[], T]) -> T:
        """`work`'s result, made on a parsing thread while the loop serves others."""
        return await asyncio.get_running_loop().run_in_executor(parse_pool, work)

    def origin_allowed(origin: str) -> bool:
        return "*" in cors_origins or origin in cors_origins or host_name(origin) in LOOPBACK_NAMES

    def check(request: Request) -> None:
        if loopback:
            host = host_name(request.headers.get("host", ""))
            origin = request.headers.get("origin")
            if host not in host_names:
                raise ApiError(
                    403,
                    f"this server answers loopback requests only, and {host!r} is not a name of this machine: "
                    "call it as 127.0.0.1, localhost, [::1] or host.docker.internal (from a container), or "
                    "give --allowed-host NAME; serve with --host and --api-key to be reached from elsewhere",
                    code="forbidden",
                )
            if origin is not None and not origin_allowed(origin):
                raise ApiError(
                    403,
                    f"this server does not answer web pages of {origin}: give --web-origin {origin} to let "
                    "that page call it from a browser",
                    code="forbidden",
                )
        if api_key is None:
            return
        # OpenAI's clients send `Authorization: Bearer`, Anthropic's `x-api-key` (Claude Code either).
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        given = given or request.headers.get("x-api-key", "").strip()
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer ..., or x-api-key)", code="invalid_api_key"
            )

    async def read_body(request: Request) -> bytes:
        """The body, refused as soon as it is known to pass `max_body_bytes` (by its Content-Length,
        or as it arrives), so a huge body is never held; and refused when it stops arriving for
        `read_timeout` seconds, so a client that never finishes it holds nothing for long."""
        too_large = ApiError(413, f"the body is over {max_body_bytes:,} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        parts: list[bytes] = []
        size = 0
        stream = request.stream()
        while True:
            try:
                part = await asyncio.wait_for(anext(stream), read_timeout)
            except StopAsyncIteration:
                return b"".join(parts)
            except asyncio.TimeoutError:
                raise ApiError(
                    408, f"the body stopped arriving for {read_timeout:g} s", code="request_timeout"
                ) from None
            except ClientDisconnect:  # nobody reads the answer; it only ends the request quietly
                raise ApiError(400, "the client went away before its body arrived", code="client_gone") from None
            size += len(part)
            if size > max_body_bytes:
                raise too_large
            parts.append(part)

    def parse(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
            message = "nested too deep" if isinstance(e, RecursionError) else str(e)
            raise ApiError(400, f"the body is not valid JSON: {message}", code="invalid_json") from None

    async def body_of(request: Request, claude_names: bool = False) -> dict:
        check(request)
        raw = await read_body(request)
        body = await off_loop(lambda: parse(raw))
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        if not isinstance(body.get("model"), str):
            raise ApiError(400, "model must be a string: the served model's name", "model", "invalid_type")
        if not model.serves(body["model"], claude_names):
            raise ApiError(
                404,
                f"the model {body.get('model')!r} is not served here; this server serves {model.name!r}",
                "model",
                "model_not_found",
            )
        return body

    def render(turn: Turn, *, thinking: bool | None) -> list[int]:
        """The prompt's tokens: the chat through the template, tools and all (on a parsing thread:
        a long prompt takes seconds). `thinking` sets a reasoning model's `enable_thinking` (as
        mlx-lm names it for every template); None leaves the template's default."""
        if turn.messages is None:
            return list(tokenizer.encode(turn.prompt or ""))
        extra: dict[str, Any] = dict(turn.template_kwargs)
        if turn.tools:
            extra["tools"] = [t.spec for t in turn.tools]
        if thinking is not None:
            extra["enable_thinking"] = thinking
        try:
            if turn.continues is None:
                return list(tokenizer.apply_chat_template(turn.messages, add_generation_prompt=True, **extra))
            text = tokenizer.apply_chat_template(turn.messages, add_generation_prompt=False, tokenize=False, **extra)
        except Exception as e:  # the template's own error, about these messages
            raise ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        return continued(text, turn.continues)

    def continued(text: str, prefill: str) -> list[int]:
        """The chat rendered up to the end of its last (assistant) message, without the end of the
        turn the template writes after it: what transformers' `continue_final_message` does."""
        at = text.rfind(prefill)
        if at < 0:
            raise ApiError(
                400,
                "the chat template does not write the last assistant message as given: it cannot be continued",
                "messages",
            )
        return list(tokenizer.encode(text[: at + len(prefill)], add_special_tokens=False))

    def check_fits(turn: Turn) -> None:
        """Refuse, before it is rendered or tokenized (30 MB took the tokenizer two minutes and 8 GB),
        a prompt that even its fewest possible tokens keep out of the context: one a character count
        allows, and one for each message (its role's marker)."""
        chars = prompt_chars(turn)
        fewest = max(chars // (TOKEN_CHARS_MARGIN * token_chars), len(turn.messages or ()))
        if fewest + (turn.max_tokens or 1) <= model.context_length:
            return
        what = (
            f"{chars:,} characters"
            if turn.messages is None
            else f"{len(turn.messages):,} messages, {chars:,} characters"
        )
        raise ApiError(
            400,
            f"the prompt ({what}) has at least {fewest:,} tokens, and this model's context is "
            f"{model.context_length:,}: shorten it",
            "messages" if turn.messages is not None else "prompt",
            "context_length_exceeded",
        )

    def grammar_of(turn: Turn) -> str | None:
        """The grammar the output is held to: a forced call's, else the response format's."""
        check_model_calls_tools(tokenizer, turn.tools, turn.tool_choice)
        forced = forced_call_grammar(tokenizer, turn.tools, turn.tool_choice)
        if forced is not None:
            return forced
        if turn.response_format.kind == "json_object":
            return json_object_grammar()
        if turn.response_format.kind == "json_schema":
            return json_schema_grammar(turn.response_format.schema or {})
        return None

    def processors_of(turn: Turn, tokens: list[int], grammar: Any) -> Callable[[], list[Any]] | None:
        """What makes the job's own logits processors (on the generation thread): the grammar's, or
        the thinking budget's, which keeps state of its own for each job."""
        if grammar is not None:
            return lambda: [grammar]
        if turn.thinking_budget is None or not tokenizer.has_thinking or turn.thinking is False:
            return None
        start, end = marker_ids(tokenizer)
        thinking = starts_in_reasoning(tokenizer, tokens)
        budget = turn.thinking_budget
        return lambda: [ThinkingBudget(budget, start_id=start, end_id=end, thinking=thinking)]

    def job_of(turn: Turn) -> tuple[Job, AnswerSplitter]:
        """The engine's job for `turn`, and the splitter that reads its reasoning and calls (on a
        parsing thread: rendering and compiling a grammar take a while)."""
        try:
            grammar = grammar_of(turn)
            processor = grammars.processor(grammar) if grammar is not None else None
        except GrammarError as e:
            param = "tools" if turn.tool_choice.forced else "response_format"
            raise refuse(f"the grammar cannot be made: {e}", param) from None
        # A grammar holds the output from its first token: there is no thinking to hold it to.
        tokens = render(turn, thinking=turn.thinking if grammar is None else False)
        room = model.context_length - len(tokens)
        max_tokens = turn.max_tokens or (min(default_max_tokens, room) if default_max_tokens else room)
        if max_tokens < 1 or len(tokens) + max_tokens > model.context_length:
            raise ApiError(
                400,
                f"the prompt has {len(tokens)} tokens"
                + (f" and {max_tokens} more were asked for" if max_tokens > 0 else ", which leave no room to answer")
                + f"; this model's context is {model.context_length}",
                "messages",
                "context_length_exceeded",
            )
        if not tokens:
            raise ApiError(400, "the prompt is empty", "prompt", "invalid_value")
        job = Job(
            tokens,
            max_tokens,
            turn.sampling,
            turn.stop,
            partition=turn.partition,
            processors=processors_of(turn, tokens, processor),
            top_logprobs=turn.top_logprobs,
        )
        # A raw completion's text comes back as written, and so does JSON a response format holds
        # to (a string in it may hold any marker); a forced call is read as a call, with no thinking.
        free = grammar is None
        splitter = AnswerSplitter(
            tokenizer,
            turn.tools,
            calls=turn.tool_choice.mode != "none" and (free or turn.tool_choice.forced),
            reasoning=turn.messages is not None and free,
            prompt=tokens,
        )
        return job, splitter

    async def prepare(request: Request, make_turn: Callable[[dict], Turn], claude_names: bool = False):
        """(body, turn, ticket, splitter) of a request, its job held by the engine, or the ApiError
        that refuses it (a 429 past the engine's bound: before any answer starts)."""
        body = await body_of(request, claude_names)
        turn = await off_loop(lambda: make_turn(body))  # (copies the messages: a long chat takes a while)
        turn.partition = cache_partition(body)
        if not tokenizer.has_thinking:  # (this model does not reason: what acts on reasoning does nothing)
            turn.ignored = sorted({*turn.ignored, *turn.reasoning_fields})
        check_fits(turn)
        place = busy_or(engine.take_place)  # before the prompt is made: past the bound, no work is done
        try:
            job, splitter = await off_loop(lambda: job_of(turn))
            job.client = request.client.host if request.client else ""
            if not engine.alive:
                raise ApiError(503, "the generation thread has stopped; restart the server", code="unavailable")
            return body, turn, start(job, place), splitter
        finally:
            engine.release(place)  # (nothing, once the job holds it)

    def usage(done: Done, ignored: list[str] | None = None) -> dict:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "kvmesh": {**done.prefix.report(), "ignored": ignored or []},
        }

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

    def start(job: Job, place: Place) -> Ticket:
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
        """The job's events as they come. No thread waits on them: a client that leaves while its job
        is queued or running leaves nothing behind. With `request` (a non-streaming one), a client
        that went away is noticed within DISCONNECT_CHECK_S too."""
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

    def ignored_header(turn: Turn) -> dict[str, str]:
        return {"x-kvmesh-ignored": ", ".join(turn.ignored)} if turn.ignored else {}

    async def complete(request: Request, chat: bool) -> Response:
        try:
            body, turn, ticket, splitter = await prepare(
                request,
                lambda b: openai_api.chat_turn(b, vocab) if chat else openai_api.completion_turn(b, vocab),
            )
        except ApiError as e:
            return e.response()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        headers = ignored_header(turn)

        if not body.get("stream"):
            try:
                outcome = await collect(pieces(ticket, splitter, request))
            except ApiError as e:
                return e.response()
            if outcome is None:
                return Response(status_code=499)  # nobody reads it
            done = outcome.done
            if chat:
                content = outcome.text if outcome.text or not outcome.calls else None  # OpenAI's null
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if outcome.reasoning:  # (mlx-lm's server's name for it, and vLLM's)
                    message["reasoning"] = outcome.reasoning
                if outcome.calls:
                    message["tool_calls"] = openai_api.tool_calls_json(outcome.calls)
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": message,
                    "finish_reason": openai_api.chat_finish(done.finish_reason, outcome.calls),
                    "logprobs": openai_api.chat_logprobs(tokenizer, outcome.logprobs)
                    if turn.top_logprobs is not None
                    else None,
                }
            else:
                choice = {
                    "index": 0,
                    "text": outcome.text,
                    "finish_reason": done.finish_reason,
                    "logprobs": openai_api.completion_logprobs(tokenizer, outcome.logprobs)
                    if turn.top_logprobs is not None
                    else None,
                }
            return JSONResponse(
                {
                    "id": ident,
                    "object": kind,
                    "created": created,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage(done, turn.ignored),
                },
                headers=headers,
            )

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        async def stream() -> AsyncIterator[str]:
            def chunk(choices: list, extra: dict | None = None) -> str:
                return json.dumps(
                    {
                        "id": ident,
                        "object": chunk_kind,
                        "created": created,
                        "model": body["model"],
                        "choices": choices,
                        **(extra or {}),
                    }
                )

            calls: list[ToolCall] = []
            offset = 0
            try:
                async for piece in pieces(ticket, splitter):
                    delta: dict[str, Any]
                    if isinstance(piece, Reasoning):
                        delta = {"role": "assistant", "reasoning": piece.text}
                        yield chunk([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])
                    elif isinstance(piece, Text):
                        if chat:
                            delta = {"role": "assistant", "content": piece.text}
                            lp = openai_api.chat_logprobs(tokenizer, list(piece.logprobs))
                            one = {"index": 0, "delta": delta, "finish_reason": None}
                        else:
                            lp = openai_api.completion_logprobs(tokenizer, list(piece.logprobs), offset)
                            one = {"index": 0, "text": piece.text, "finish_reason": None}
                        one["logprobs"] = lp if turn.top_logprobs is not None else None
                        offset += len(piece.text)
                        yield chunk([one])
                    elif isinstance(piece, ToolCall):
                        delta = {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": openai_api.tool_calls_json([piece], len(calls), streaming=True),
                        }
                        calls.append(piece)
                        yield chunk([{"index": 0, "delta": delta, "finish_reason": None}])
                    elif isinstance(piece, Done):
                        finish = openai_api.chat_finish(piece.finish_reason, calls) if chat else piece.finish_reason
                        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
                        if chat:
                            last["delta"] = {}
                        else:
                            last["text"] = ""
                        yield chunk([last])
                        if include_usage:
                            yield chunk([], {"usage": usage(piece, turn.ignored)})
            except ApiError as e:
                yield json.dumps({"error": {"message": e.message, "type": "server_error", "code": e.code}})
            yield "[DONE]"

        return EventSourceResponse(stream(), ping=15, headers=headers, background=leave(ticket))

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def messages(request: Request) -> Response:
        """The Anthropic Messages API (kvmesh.serve.anthropic)."""
        try:
            body, turn, ticket, splitter = await prepare(
                request, lambda b: anthropic.turn_of(b, vocab), claude_names=True
            )
        except ApiError as e:
            return anthropic.error_response(e)
        ident = f"msg_{uuid.uuid4().hex[:24]}"
        headers = ignored_header(turn)
        if not body.get("stream"):
            try:
                outcome = await collect(pieces(ticket, splitter, request))
            except ApiError as e:
                return anthropic.error_response(e)
            if outcome is None:
                return Response(status_code=499)
            return JSONResponse(anthropic.message_of(outcome, body["model"], ident), headers=headers)
        sse = anthropic.events(pieces(ticket, splitter), body["model"], ident)
        return EventSourceResponse(sse, ping=15, headers=headers, background=leave(ticket))

    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count: the prompt as this server would render it."""
        try:
            body = await body_of(request, claude_names=True)
            turn = anthropic.turn_of({**body, "max_tokens": body.get("max_tokens", 1)}, vocab)
            check_fits(turn)
            tokens = await off_loop(lambda: render(turn, thinking=turn.thinking))
        except ApiError as e:
            return anthropic.error_response(e)
        return JSONResponse({"input_tokens": len(tokens)})

    async def responses_api(request: Request) -> Response:
        """OpenAI's Responses API (kvmesh.serve.responses)."""
        try:
            body, turn, ticket, splitter = await prepare(request, lambda b: responses.turn_of(b, vocab))
        except ApiError as e:
            return e.response()
        answer = responses.Answer(
            body,
            f"resp_{uuid.uuid4().hex}",
            int(time.time()),
            count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)) if text else 0,
        )
        headers = ignored_header(turn)
        if not body.get("stream"):
            try:
                outcome = await collect(pieces(ticket, splitter, request))
            except ApiError as e:
                return e.response()
            if outcome is None:
                return Response(status_code=499)
            return JSONResponse(answer.complete(outcome), headers=headers)
        return EventSourceResponse(
            answer.events(pieces(ticket, splitter)), ping=15, headers=headers, background=leave(ticket)
        )

    def model_object() -> dict:
        # vLLM's name for the context; a request without a limit may generate all of it that its
        # prompt leaves, or up to the server's --max-tokens.
        limits = {"max_model_len": model.context_length}
        if default_max_tokens:
            limits["max_tokens"] = default_max_tokens
        return {"id": model.name, "object": "model", "created": 0, "owned_by": "kvmesh", **limits}

    async def models(request: Request) -> Response:
        try:
            check(request)
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def model_detail(request: Request) -> Response:
        try:
            check(request)
            name = request.path_params["name"]
            if not model.serves(name):
                raise ApiError(404, f"the model {name!r} is not served here", "model", "model_not_found")
        except ApiError as e:
            return e.response()
        return JSONResponse({**model_object(), "id": name})

    async def health(request: Request) -> Response:
        if not engine.alive:
            return JSONResponse({"status": "generation thread stopped"}, status_code=503)
        if not engine.ready.is_set():  # calibrating: requests are taken, and wait for it
            return JSONResponse({"status": "starting", "requests": engine.held()}, status_code=503)
        return JSONResponse({"status": "ok", "requests": engine.held(), "max_requests": engine.max_held})

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses_api, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model_detail, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    middleware = []
    if cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
                expose_headers=["x-kvmesh-ignored"],
            )
        )
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: not_found})
    app.state.parse_pool = parse_pool  # the server shuts it down with itself
    return app
