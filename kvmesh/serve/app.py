"""The OpenAI-compatible HTTP API of `kvmesh serve` (Starlette; streaming as server-sent events).

Routes: POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models and
/health. Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
matching HTTP status, and never stop the server. `usage` carries `prompt_tokens_details.cached_tokens`
(the prefix that was not prefilled) and a `kvmesh` object saying where it came from.

The event loop only moves bytes: a body's JSON and a prompt's tokens are made on a small pool of
threads (a 30 MB prompt takes the tokenizer half a minute), so /health and every other request are
answered meanwhile. A request's `cache_salt` (vLLM's field) keeps its caches apart: see
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.serve.engine import Delta, Done, Engine, Job, Sampling


class ApiError(Exception):
    """A request the API refuses: an HTTP status and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code
        super().__init__(message)

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "invalid_request_error"}.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


@dataclass(frozen=True)
class ServedModel:
    """The model this server answers for: the names a client may use, and its context length."""

    name: str
    aliases: frozenset[str]
    context_length: int


def number(body: dict, name: str, kind: type, default: Any, low: float, high: float) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be a{'n integer' if kind is int else ' number'}", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}, not {value}", name, "invalid_value")
    return kind(value)


# How often a non-streaming request that waits on its job checks that its client is still there.
DISCONNECT_CHECK_S = 0.5
# Names a loopback server answers to. A web page's request to 127.0.0.1 that arrives under another
# Host (DNS rebinding) or from another Origin (a page's script) is refused: without an API key the
# loopback API is open to whatever reaches it, and a browser reaches it for any page it shows.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# Threads that parse bodies and tokenize prompts, off the event loop. Few: each may hold a huge
# prompt, and tokenizing is the tokenizer's (Rust) work, which more threads would not speed up here.
PARSE_THREADS = 2
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


def make_app(
    engine: Engine,
    model: ServedModel,
    api_key: str | None = None,
    default_max_tokens: int = 512,
    *,
    max_body_bytes: int = 32 << 20,
    read_timeout: float = 30.0,
    loopback: bool = True,
) -> Starlette:
    """The ASGI application; requests go to `engine`, one at a time. A body over `max_body_bytes`
    is refused unread, one that pauses for `read_timeout` seconds gets a 408; on `loopback`,
    requests under another Host or from another Origin are refused too."""
    tokenizer = engine.tokenizer
    parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kvmesh-parse")

    async def off_loop(work: Callable[[], T]) -> T:
        """`work`'s result, made on a parsing thread while the loop serves others."""
        return await asyncio.get_running_loop().run_in_executor(parse_pool, work)

    def check(request: Request) -> None:
        if loopback:
            host = host_name(request.headers.get("host", ""))
            origin = request.headers.get("origin")
            if host not in LOOPBACK_NAMES or (origin is not None and host_name(origin) not in LOOPBACK_NAMES):
                raise ApiError(
                    403,
                    "this server answers loopback requests only (Host and Origin must be 127.0.0.1, localhost "
                    "or [::1]): serve with --host and --api-key to be reached otherwise",
                    code="forbidden",
                )
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")

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

    async def body_of(request: Request) -> dict:
        check(request)
        raw = await read_body(request)
        body = await off_loop(lambda: parse(raw))
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        if not isinstance(body.get("model"), str):
            raise ApiError(400, "model must be a string: the served model's name", "model", "invalid_type")
        if body.get("model") not in model.aliases:
            raise ApiError(
                404,
                f"the model {body.get('model')!r} is not served here; this server serves {model.name!r}",
                "model",
                "model_not_found",
            )
        return body

    def tokenize(body: dict, chat: bool) -> list[int]:
        """The prompt's tokens (on a parsing thread: a long prompt takes seconds)."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ApiError(400, "messages must be a non-empty list of objects", "messages", "invalid_value")
            try:
                return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            except Exception as e:  # the template's own error, about these messages
                raise ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", "prompt", "invalid_type")
        return list(tokenizer.encode(prompt))

    def job_of(body: dict, tokens: list[int]) -> Job:
        maximum = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = number({"max_tokens": maximum}, "max_tokens", int, default_max_tokens, 1, 1 << 20)
        if len(tokens) + max_tokens > model.context_length:
            raise ApiError(
                400,
                f"the prompt has {len(tokens)} tokens and {max_tokens} more were asked for; this "
                f"model's context is {model.context_length}",
                "messages",
                "context_length_exceeded",
            )
        if not tokens:
            raise ApiError(400, "the prompt is empty", "prompt", "invalid_value")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", "stop", "invalid_value")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "seed must be an integer", "seed", "invalid_type")
        if seed is not None and not 0 <= seed < 1 << 63:  # what MLX's random seed takes
            raise ApiError(400, f"seed must be between 0 and 2^63-1, not {seed}", "seed", "invalid_value")
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "stream must be true or false", "stream", "invalid_type")
        options = body.get("stream_options")
        if options is not None and (
            not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)
        ):
            raise ApiError(
                400,
                'stream_options must be an object such as {"include_usage": true}',
                "stream_options",
                "invalid_type",
            )
        sampling = Sampling(
            temperature=number(body, "temperature", float, 0.0, 0.0, 2.0),
            top_p=number(body, "top_p", float, 1.0, 0.0, 1.0),
            seed=seed,
        )
        return Job(tokens, max_tokens, sampling, stop, partition=cache_partition(body))

    def usage(done: Done) -> dict:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "kvmesh": {
                "prefix_from": done.prefix_from,
                "cached_tokens": done.cached_tokens,
                "wire_bytes": done.wire_bytes,
                "seconds": round(done.prefix_seconds, 4),
                "skipped": done.skipped,
                "choices": done.choices,
            },
        }

    def start(job: Job) -> asyncio.Event:
        """Submit `job`; the returned event is set (on this loop) whenever it has news."""
        loop = asyncio.get_running_loop()
        news = asyncio.Event()

        def notify() -> None:  # on the generation thread
            loop.call_soon_threadsafe(news.set)

        job.listener = notify
        engine.submit(job)
        return news

    async def events(job: Job, news: asyncio.Event, request: Request | None = None) -> AsyncIterator[Delta | Done]:
        """The job's events as they come. No thread waits on them: a client that leaves while its job
        is queued or running leaves nothing behind. With `request` (a non-streaming one), a client
        that went away is noticed within DISCONNECT_CHECK_S too."""
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
                if isinstance(event, Exception):
                    raise ApiError(500, f"generation failed: {event}", code="generation_failed")
                yield event
                if isinstance(event, Done):
                    return
        finally:
            job.cancelled.set()  # a client that went away stops its generation, or skips it when queued

    async def complete(request: Request, chat: bool) -> Response:
        try:
            body = await body_of(request)
            tokens = await off_loop(lambda: tokenize(body, chat))
            job = job_of(body, tokens)
            if not engine.alive:
                raise ApiError(503, "the generation thread has stopped; restart the server", code="unavailable")
        except ApiError as e:
            return e.response()
        news = start(job)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            if delta:
                return {
                    "index": 0,
                    "delta": {"role": "assistant", "content": text} if text is not None else {},
                    "finish_reason": finish,
                }
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}

        if not body.get("stream"):
            try:
                parts, done = [], None
                async for event in events(job, news, request):
                    if isinstance(event, Delta):
                        parts.append(event.text)
                    else:
                        done = event
            except ApiError as e:
                return e.response()
            assert done is not None
            return JSONResponse(
                {
                    "id": ident,
                    "object": kind,
                    "created": created,
                    "model": body["model"],
                    "choices": [choice("".join(parts), done.finish_reason, delta=False)],
                    "usage": usage(done),
                }
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

            try:
                async for event in events(job, news):
                    if isinstance(event, Delta):
                        yield chunk([choice(event.text, None, delta=True)])
                    else:
                        yield chunk([choice(None if chat else "", event.finish_reason, delta=True)])
                        if include_usage:
                            yield chunk([], {"usage": usage(event)})
            except ApiError as e:
                yield json.dumps({"error": {"message": e.message, "type": "server_error", "code": e.code}})
            yield "[DONE]"

        return EventSourceResponse(stream(), ping=15)

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def models(request: Request) -> Response:
        try:
            check(request)
        except ApiError as e:
            return e.response()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": model.name, "object": "model", "created": 0, "owned_by": "kvmesh"},
                ],
            }
        )

    async def health(request: Request) -> Response:
        if not engine.alive:
            return JSONResponse({"status": "generation thread stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.parse_pool = parse_pool  # the server shuts it down with itself
    return app
