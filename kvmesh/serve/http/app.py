"""The HTTP APIs of `kvmesh serve` (Starlette; streaming as server-sent events).

Routes: POST /v1/chat/completions and /v1/completions (OpenAI), /v1/messages and
/v1/messages/count_tokens (Anthropic), /v1/responses (OpenAI's Responses API), all streaming or not;
GET /v1/models, /v1/models/{id} and /health. Each API's body becomes a `Turn`
(kvmesh.serve.turns), which one handler runs the same way for all; its Api (kvmesh.serve.apis)
writes the answer back in the API's shape. Errors have the API's shape (OpenAI's `{"error":
{"message", "type", "param", "code"}}`, Anthropic's `{"type": "error", "error": {...}}`) with the
matching HTTP status, and never stop the server. `usage` carries the prefix that was not prefilled
(`prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`,
`input_tokens_details.cached_tokens`), chat's a `kvmesh` object too.

The event loop only moves bytes: a body's JSON and a prompt's tokens are made on a small pool of
threads, so /health and every other request are answered meanwhile. The work is counted before it
is done: a prompt whose characters or messages alone cannot fit the context is refused before it is
rendered (a 30 MB one took the tokenizer two minutes), a request takes its place among the held
ones (or its 429) before its prompt is made, and a request's tools and messages are bounded
(kvmesh.serve.protocol). A request's `cache_salt` (vLLM's field) keeps its caches apart: see
`kvmesh.serve.engine.prompt_cache`, which explains what a salted request shares and what it does not.
"""

import asyncio
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.serve.answer import AnswerSplitter
from kvmesh.serve.api_errors import ApiError
from kvmesh.serve.apis.anthropic import MESSAGES
from kvmesh.serve.apis.api import Api
from kvmesh.serve.apis.openai_api import CHAT_COMPLETIONS, COMPLETIONS
from kvmesh.serve.apis.responses import RESPONSES
from kvmesh.serve.engine import Engine
from kvmesh.serve.http import pump
from kvmesh.serve.http.guards import Guard, parse_json, read_body
from kvmesh.serve.http.turn_jobs import TurnJobs
from kvmesh.serve.turns import Turn

__all__ = ["ApiError", "ServedModel", "make_app"]

# Threads that parse bodies and tokenize prompts, off the event loop. Few: each may hold a huge
# prompt, and tokenizing is the tokenizer's (Rust) work, which more threads would not speed up here.
PARSE_THREADS = 2
# The longest cache_salt taken (vLLM suggests 43 characters, 256 random bits in base64).
MAX_SALT_CHARS = 1024
T = TypeVar("T")


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


def ignored_header(turn: Turn) -> dict[str, str]:
    return {"x-kvmesh-ignored": ", ".join(turn.ignored)} if turn.ignored else {}


class Handlers:
    """The routes' handlers over one engine and model: every API's generation runs through `answer`."""

    def __init__(
        self,
        engine: Engine,
        model: ServedModel,
        guard: Guard,
        *,
        default_max_tokens: int,
        max_body_bytes: int,
        read_timeout: float,
    ):
        self.engine, self.model, self.guard = engine, model, guard
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout
        self.jobs = TurnJobs(engine.tokenizer, model.context_length, default_max_tokens)
        self.parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kvmesh-parse")

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work`'s result, made on a parsing thread while the loop serves others."""
        return await asyncio.get_running_loop().run_in_executor(self.parse_pool, work)

    async def body_of(self, request: Request, claude_names: bool = False) -> dict:
        """The request's body, its caller and size checked and its `model` the one served here."""
        self.guard.check(request)
        raw = await read_body(request, max_body_bytes=self.max_body_bytes, read_timeout=self.read_timeout)
        body = await self.off_loop(lambda: parse_json(raw))
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        if not isinstance(body.get("model"), str):
            raise ApiError(400, "model must be a string: the served model's name", "model", "invalid_type")
        if not self.model.serves(body["model"], claude_names):
            raise ApiError(
                404,
                f"the model {body.get('model')!r} is not served here; this server serves {self.model.name!r}",
                "model",
                "model_not_found",
            )
        return body

    async def prepare(self, request: Request, api: Api) -> tuple[dict, Turn, pump.Ticket, AnswerSplitter]:
        """(body, turn, ticket, splitter) of a request, its job held by the engine, or the ApiError
        that refuses it (a 429 past the engine's bound: before any answer starts)."""
        engine = self.engine
        body = await self.body_of(request, api.claude_names)
        turn = await self.off_loop(lambda: api.turn_of(body, self.jobs.vocab))  # (copies the messages)
        turn.partition = cache_partition(body)
        if not engine.tokenizer.has_thinking:  # (this model does not reason: what acts on reasoning does nothing)
            turn.ignored = sorted({*turn.ignored, *turn.reasoning_fields})
        self.jobs.check_fits(turn)
        place = pump.busy_or(engine.take_place)  # before the prompt is made: past the bound, no work is done
        try:
            job, splitter = await self.off_loop(lambda: self.jobs.job_of(turn))
            job.client = request.client.host if request.client else ""
            if not engine.alive:
                raise ApiError(503, "the generation thread has stopped; restart the server", code="unavailable")
            return body, turn, pump.start(engine, job, place), splitter
        finally:
            engine.release(place)  # (nothing, once the job holds it)

    async def answer(self, request: Request, api: Api) -> Response:
        """A generation request of `api`, answered whole or streamed."""
        try:
            body, turn, ticket, splitter = await self.prepare(request, api)
        except ApiError as e:
            return api.error(e)
        reply = api.reply(body, turn, self.engine.tokenizer)
        headers = ignored_header(turn)
        if not turn.stream:
            try:
                outcome = await pump.collect(pump.pieces(ticket, splitter, request))
            except ApiError as e:
                return api.error(e)
            if outcome is None:
                return Response(status_code=499)  # nobody reads it
            return JSONResponse(reply.complete(outcome), headers=headers)
        events = reply.events(pump.pieces(ticket, splitter))
        return EventSourceResponse(events, ping=15, headers=headers, background=pump.leave(ticket))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token count: the prompt as this server would render it."""
        try:
            body = await self.body_of(request, claude_names=True)
            turn = MESSAGES.turn_of({**body, "max_tokens": body.get("max_tokens", 1)}, self.jobs.vocab)
            self.jobs.check_fits(turn)
            tokens = await self.off_loop(lambda: self.jobs.render(turn, thinking=turn.thinking))
        except ApiError as e:
            return MESSAGES.error(e)
        return JSONResponse({"input_tokens": len(tokens)})

    def model_object(self) -> dict:
        # vLLM's name for the context; a request without a limit may generate all of it that its
        # prompt leaves, or up to the server's --max-tokens.
        limits = {"max_model_len": self.model.context_length}
        if self.default_max_tokens:
            limits["max_tokens"] = self.default_max_tokens
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "kvmesh", **limits}

    async def models(self, request: Request) -> Response:
        try:
            self.guard.check(request)
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [self.model_object()]})

    async def model_detail(self, request: Request) -> Response:
        try:
            self.guard.check(request)
            name = request.path_params["name"]
            if not self.model.serves(name):
                raise ApiError(404, f"the model {name!r} is not served here", "model", "model_not_found")
        except ApiError as e:
            return e.response()
        return JSONResponse({**self.model_object(), "id": name})

    async def health(self, request: Request) -> Response:
        engine = self.engine
        if not engine.alive:
            return JSONResponse({"status": "generation thread stopped"}, status_code=503)
        if not engine.ready.is_set():  # calibrating: requests are taken, and wait for it
            return JSONResponse({"status": "starting", "requests": engine.held()}, status_code=503)
        return JSONResponse({"status": "ok", "requests": engine.held(), "max_requests": engine.max_held})


async def not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()


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
    guard = Guard(api_key, loopback, cors_origins, allowed_hosts)
    handlers = Handlers(
        engine,
        model,
        guard,
        default_max_tokens=default_max_tokens,
        max_body_bytes=max_body_bytes,
        read_timeout=read_timeout,
    )

    def generating(api: Api) -> Callable[[Request], object]:
        async def endpoint(request: Request) -> Response:
            return await handlers.answer(request, api)

        return endpoint

    routes = [
        Route("/v1/chat/completions", generating(CHAT_COMPLETIONS), methods=["POST"]),
        Route("/v1/completions", generating(COMPLETIONS), methods=["POST"]),
        Route("/v1/messages", generating(MESSAGES), methods=["POST"]),
        Route("/v1/messages/count_tokens", handlers.count_tokens, methods=["POST"]),
        Route("/v1/responses", generating(RESPONSES), methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{name:path}", handlers.model_detail, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
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
    app.state.parse_pool = handlers.parse_pool  # the server shuts it down with itself
    return app
