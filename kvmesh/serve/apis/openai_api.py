"""OpenAI's chat completions and completions, as Turns and back.

Every field of those APIs is served, refused with a 400 that says why, or accepted as having no
effect here and named in the response's `x-kvmesh-ignored` header (and `usage.kvmesh.ignored`):
- served: messages (content parts, the `developer` role), tools, tool_choice, response_format,
  max_tokens/max_completion_tokens, stop, temperature, top_p, seed, presence_penalty and
  frequency_penalty (mlx-lm's, over the last 20 tokens), logit_bias, logprobs/top_logprobs, stream,
  stream_options.include_usage, cache_salt; and the usual extras top_k, min_p, repetition_penalty;
- refused: `n` or `best_of` other than 1, `echo`, `suffix`, audio output, predicted outputs, the
  legacy `functions`;
- no effect: `user`, `metadata`, `store` (nothing is kept), `service_tier`, `prompt_cache_key`
  (the cache is found by prefix), `safety_identifier`, `parallel_tool_calls` (a forced call is one
  call; otherwise the model's calls are all read), `stream_options.include_obfuscation`, and any
  field this server does not know.
- for a reasoning model: `reasoning_effort` "none" turns its thinking off (other efforts leave it
  on, and are named as ignored: the model thinks as long as it does; on a model that does not
  reason, "none" is named as ignored too), as does `chat_template_kwargs: {"enable_thinking":
  false}` (variables for the chat template, as mlx-lm's server and vLLM take them).
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from kvmesh.serve.answer import Reasoning
from kvmesh.serve.api_errors import ApiError, refuse
from kvmesh.serve.engine import Done, Sampling, TokenLogprob
from kvmesh.serve.protocol.base import parse
from kvmesh.serve.protocol.openai import ChatCompletionRequest, CompletionRequest, Sampled
from kvmesh.serve.tools import ToolCall, ToolChoice, cut_short, openai_tool_choice, openai_tools, template_messages
from kvmesh.serve.turns import Outcome, Piece, Text, Turn, effort_served, response_format_of, top_k_of

REFUSED = {
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
    "functions": "the legacy `functions` are not served: send `tools`",
    "function_call": "the legacy `function_call` is not served: send `tool_choice`",
    "suffix": "suffix (insertion) is not served",
    "web_search_options": "web search is not served",
}


def refuse_unserved(request: Sampled) -> None:
    for name, why in REFUSED.items():
        if name in type(request).model_fields and getattr(request, name) is not None:
            raise refuse(why, name, "unsupported_value")
    for name in ("n", "best_of"):
        if getattr(request, name) not in (None, 1):
            raise refuse(
                f"{name} must be 1: one choice per request (send the request again for another)",
                name,
                "unsupported_value",
            )
    if request.echo:
        raise refuse("echo is not served", "echo", "unsupported_value")
    if request.modalities is not None and request.modalities != ["text"]:
        raise refuse('modalities must be ["text"]', "modalities", "unsupported_value")


def sampling_of(request: Sampled, vocab: int) -> Sampling:
    """mlx-lm's sampler and logits processors, from the fields OpenAI's APIs share (and the usual
    extras of local servers: top_k, min_p, repetition_penalty); a field not given keeps its default."""
    bias = []
    for key, b in (request.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise refuse(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})", "logit_bias")
        bias.append((int(key), b))
    given: dict[str, Any] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "top_k": top_k_of(request.top_k, vocab),
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    return Sampling(**{k: v for k, v in given.items() if v is not None}, logit_bias=tuple(bias))


def include_usage(request: Sampled) -> bool:
    """stream_options.include_usage."""
    return request.stream_options is not None and request.stream_options.include_usage


def chat_turn(body: dict, vocab: int) -> Turn:
    """A chat completions body as a Turn (its messages ready for the template)."""
    request = parse(ChatCompletionRequest, body)
    refuse_unserved(request)
    tools = openai_tools(request.tools)
    top: int | None = None
    if request.logprobs:
        top = request.top_logprobs or 0
    elif request.top_logprobs is not None:
        raise refuse("top_logprobs needs logprobs: true", "top_logprobs")
    turn = Turn(
        messages=template_messages(request.messages),
        tools=tools,
        tool_choice=openai_tool_choice(request.tool_choice, tools),
        response_format=response_format_of(request.response_format),
        max_tokens=request.limit,
        stop=request.stop or [],
        sampling=sampling_of(request, vocab),
        top_logprobs=top,
        ignored=request.unknown(),
        template_kwargs=template_kwargs_of(request.chat_template_kwargs),
        stream=bool(request.stream),
        include_usage=include_usage(request),
    )
    return effort_served(turn, request.reasoning_effort, "reasoning_effort")


# apply_chat_template's own arguments (transformers'): set by the request or by the server, never by
# `chat_template_kwargs`, which are the template's variables.
RENDER_ARGUMENTS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def template_kwargs_of(value: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs`: an object of template variables (`enable_thinking`, ...)."""
    if value is None:
        return {}
    if reserved := sorted(set(value) & RENDER_ARGUMENTS):
        raise refuse(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the request does", "chat_template_kwargs"
        )
    return dict(value)


def completion_turn(body: dict, vocab: int) -> Turn:
    """A completions body as a Turn: a raw prompt, no template."""
    request = parse(CompletionRequest, body)
    refuse_unserved(request)
    return Turn(
        prompt=request.prompt if isinstance(request.prompt, str) else request.prompt[0],
        tool_choice=ToolChoice("none"),
        response_format=response_format_of(request.response_format),
        max_tokens=request.limit,
        stop=request.stop or [],
        sampling=sampling_of(request, vocab),
        top_logprobs=request.logprobs,
        ignored=request.unknown(),
        stream=bool(request.stream),
        include_usage=include_usage(request),
    )


def tool_calls_json(calls: list[ToolCall], first_index: int = 0, streaming: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` (with their `index` when streamed)."""
    out = []
    for i, call in enumerate(calls):
        entry: dict[str, Any] = {
            "id": f"call_{call.id}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        if streaming:
            entry["index"] = first_index + i
        out.append(entry)
    return out


def chat_finish(finish: str, calls: list[ToolCall]) -> str:
    """The finish reason: "length" when max_tokens cut a call, else "tool_calls" when the answer made
    calls (all complete), else mlx-lm's."""
    if cut_short(calls):
        return "length"
    return "tool_calls" if calls else finish


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict:
    """Chat's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""

    def one(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """Completions' `logprobs`: tokens, their log probabilities, the top ones, text offsets."""
    tokens = [token_text(tokenizer, e.token) for e in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def usage(done: Done, ignored: list[str]) -> dict:
    """OpenAI's `usage`, with the prefix that was not prefilled and kvmesh's own report of it."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        "kvmesh": {**done.prefix.report(), "ignored": ignored},
    }


@dataclass
class CompletionReply:
    """One answer of chat completions (`chat`) or completions, as it is written."""

    chat: bool
    model: str
    turn: Turn
    tokenizer: Any
    ident: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.ident = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        """The API's `logprobs` of `entries`, or None when the request asked for none."""
        if self.turn.top_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, entries)
        return completion_logprobs(self.tokenizer, entries, offset)

    def complete(self, outcome: Outcome) -> dict:
        done = outcome.done
        choice: dict[str, Any]
        if self.chat:
            content = outcome.text if outcome.text or not outcome.calls else None  # OpenAI's null
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if outcome.reasoning:  # (mlx-lm's server's name for it, and vLLM's)
                message["reasoning"] = outcome.reasoning
            if outcome.calls:
                message["tool_calls"] = tool_calls_json(outcome.calls)
            finish = chat_finish(done.finish_reason, outcome.calls)
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": done.finish_reason}
        choice["logprobs"] = self.logprobs(outcome.logprobs)
        return {
            "id": self.ident,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(done, self.turn.ignored),
        }

    def chunk(self, choices: list, extra: dict | None = None) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return json.dumps(
            {"id": self.ident, "object": kind, "created": self.created, "model": self.model, "choices": choices}
            | (extra or {})
        )

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
        """The answer as chunks, then (with stream_options.include_usage) the usage, then [DONE]."""
        calls: list[ToolCall] = []
        offset = 0
        try:
            async for piece in pieces:
                delta: dict[str, Any]
                if isinstance(piece, Reasoning):
                    delta = {"role": "assistant", "reasoning": piece.text}
                    yield self.chunk([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])
                elif isinstance(piece, Text):
                    if self.chat:
                        one = {"index": 0, "delta": {"role": "assistant", "content": piece.text}, "finish_reason": None}
                    else:
                        one = {"index": 0, "text": piece.text, "finish_reason": None}
                    one["logprobs"] = self.logprobs(list(piece.logprobs), offset)
                    offset += len(piece.text)
                    yield self.chunk([one])
                elif isinstance(piece, ToolCall):
                    delta = {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": tool_calls_json([piece], len(calls), streaming=True),
                    }
                    calls.append(piece)
                    yield self.chunk([{"index": 0, "delta": delta, "finish_reason": None}])
                elif isinstance(piece, Done):
                    finish = chat_finish(piece.finish_reason, calls) if self.chat else piece.finish_reason
                    last: dict[str, Any] = {"index": 0, "finish_reason": finish}
                    if self.chat:
                        last["delta"] = {}
                    else:
                        last["text"] = ""
                    yield self.chunk([last])
                    if self.turn.include_usage:
                        yield self.chunk([], {"usage": usage(piece, self.turn.ignored)})
        except ApiError as e:
            yield json.dumps({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        yield "[DONE]"


@dataclass(frozen=True)
class Completions:
    """The Api of chat completions (`chat`) or of completions."""

    chat: bool
    claude_names: bool = False

    def turn_of(self, body: dict, vocab: int) -> Turn:
        return chat_turn(body, vocab) if self.chat else completion_turn(body, vocab)

    def reply(self, body: dict, turn: Turn, tokenizer: Any) -> CompletionReply:
        return CompletionReply(self.chat, body["model"], turn, tokenizer)

    def error(self, e: ApiError) -> Response:
        return e.response()


CHAT_COMPLETIONS = Completions(chat=True)
COMPLETIONS = Completions(chat=False)
