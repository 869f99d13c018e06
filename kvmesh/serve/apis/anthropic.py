"""The Anthropic Messages API (`POST /v1/messages`), as Turns and back: what Claude Code speaks.

A request's `system` (a string or text blocks), its messages' content blocks (text, `tool_use` in
the assistant's turns, `tool_result` in the user's), `tools` (`input_schema`), `tool_choice` (auto,
any, tool, none), `stop_sequences`, `max_tokens`, `temperature`, `top_p`, `top_k` and `stream` are
served; the chat is handed to the model's template in OpenAI's shape (which templates are written
for), so the same conversation renders to the same tokens through either API. Any "claude-..."
model name is the served model (kvmesh.serve.http.app.ServedModel.serves).

`usage` counts as Anthropic's does: `input_tokens` are those prefilled now, `cache_read_input_tokens`
those a cache held (memory, the store or a peer), `cache_creation_input_tokens` 0 (every prompt's
cache is kept, at no extra cost). A reasoning model's thinking comes back as `thinking` blocks
(with an empty `signature`: there is nobody to sign them); `thinking` turns it on or off
("enabled", "disabled"; `budget_tokens` is kept to: kvmesh.serve.thinking_budget; `display` is not),
and thinking blocks sent back go to the template as the assistant's `reasoning_content` (which Qwen3's and DeepSeek's
templates render, or drop, as they do for the chat API). Accepted without effect: `metadata`, `service_tier`,
`context_management`, `cache_control` on blocks (caching is automatic), and fields this server
does not know; refused: images and documents, server tools, `mcp_servers`, `container`.
"""

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jiter
from starlette.responses import JSONResponse

from kvmesh.serve.answer import Reasoning
from kvmesh.serve.api_errors import ApiError, refuse
from kvmesh.serve.engine import Done, Sampling, Started
from kvmesh.serve.protocol import anthropic as protocol
from kvmesh.serve.protocol.anthropic import MessagesRequest
from kvmesh.serve.protocol.base import parse
from kvmesh.serve.tools import (
    Tool,
    ToolCall,
    ToolChoice,
    checked,
    cut_short,
    function_tool,
    template_messages,
    unique,
)
from kvmesh.serve.turns import Outcome, Text, Turn, refuse_given, top_k_of

REFUSED = {
    "mcp_servers": "MCP servers are not served",
    "container": "containers are not served",
}
# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_response(e: ApiError) -> JSONResponse:
    """`e` in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def error_body(e: ApiError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def block_text(content: Any, param: str) -> str:
    """A string, or the text of text blocks (`cache_control` and the like have no effect here)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "\n".join(str(b.get("text", "")) for b in content)
    raise refuse(f"{param} must be a string or text blocks (images and documents are not served)", param)


def chat_of(request: MessagesRequest) -> list[dict]:
    """The conversation as OpenAI-shaped messages: `tool_use` blocks as an assistant's `tool_calls`,
    each `tool_result` as a `tool` message, in the order the blocks come."""
    out: list[dict] = []
    if request.system is not None:
        out.append({"role": "system", "content": block_text(request.system, "system")})
    for message in request.messages:
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise refuse(f'a message\'s role must be "user" or "assistant", not {role!r}', "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise refuse("content must be a string or a list of blocks", "messages", "invalid_type")
        if role == "assistant":
            out.append(assistant_message(content))
        else:
            out.extend(user_messages(content))
    return out


def assistant_message(blocks: list[dict]) -> dict:
    text, calls, thoughts = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "thinking":  # this model's own thinking, for the templates that render it
            thoughts.append(str(block.get("thinking", "")))
        elif kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": block.get("input") or {}},
                }
            )
        elif kind != "redacted_thinking":  # (another model's, encrypted: nothing to render)
            raise refuse(f"an assistant's {kind!r} block is not served", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thoughts:
        message["reasoning"] = "".join(thoughts)  # (template_messages names it reasoning_content)
    if calls:
        message["tool_calls"] = calls
    return message


def user_messages(blocks: list[dict]) -> list[dict]:
    out: list[dict] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "\n".join(text)})
            text.clear()

    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_result":
            flush()
            result = block.get("content", "")
            content = block_text(result, "tool_result.content") if result is not None else ""
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
        else:
            raise refuse(f"a user's {kind!r} block is not served (text and tool_result are)", "messages")
    flush()
    return out


def tools_of(value: list[dict] | None) -> list[Tool]:
    """Anthropic's tools: `{"name", "description", "input_schema"}` (client tools only)."""
    tools = []
    for tool in value or []:
        if tool.get("type", "custom") != "custom":
            raise refuse(f"server tools ({tool.get('type')!r}) are not served; client tools are", "tools")
        tools.append(function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), "tools"))
    return unique(tools, "tools")


def tool_choice_of(value: protocol.ToolChoice | None, tools: list[Tool]) -> ToolChoice:
    """`{"type": "auto" | "any" | "tool" | "none", "name"}`: "any" and "tool" force a call."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[value.type]
    return checked(ToolChoice(mode, value.name if mode == "function" else None), tools, "tool_choice")


def turn_of(body: dict, vocab: int) -> Turn:
    """A Messages body as a Turn."""
    request = parse(MessagesRequest, body)
    refuse_given(request, REFUSED)
    tools = tools_of(request.tools)
    messages = template_messages(chat_of(request))
    turn = Turn(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice_of(request.tool_choice, tools),
        max_tokens=request.max_tokens,
        stop=request.stop_sequences or [],
        sampling=Sampling(  # (Anthropic's temperature goes to 1)
            temperature=request.temperature or 0.0,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=top_k_of(request.top_k, vocab),
        ),
        ignored=request.unknown(),
        continues=prefill_of(messages),
        stream=bool(request.stream),
    )
    return thinking_served(turn, request.thinking)


def prefill_of(messages: list[dict]) -> str | None:
    """The text a chat's last assistant message puts in the model's mouth (Anthropic continues it:
    Claude Code and structured-output users rely on it), or None when the chat ends otherwise."""
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls") or not last.get("content"):
        return None
    text = last["content"]
    if text != text.rstrip():  # (as Anthropic's API says it)
        raise refuse("final assistant content cannot end with trailing whitespace", "messages")
    return text


def thinking_served(turn: Turn, value: protocol.Thinking | None) -> Turn:
    """`turn` with what `thinking` does to a reasoning model: "disabled" turns its thinking off,
    "enabled" (with `budget_tokens`, which is kept to), "adaptive" and "between_tools" on; absent, as
    its template does. A model that does not reason has it named as ignored, as is `display`."""
    if value is None:
        return turn
    turn.thinking = {"enabled": True, "between_tools": True, "disabled": False}.get(value.type)
    if value.type == "enabled":
        turn.thinking_budget = value.budget_tokens
    turn.reasoning_fields.append("thinking")
    turn.ignored += [f"thinking.{k}" for k in value.unknown()]
    return turn


def stop_reason(done: Done, calls: list[ToolCall]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: "max_tokens" when it cut a call, "tool_use" when
    the answer made calls (all complete)."""
    if cut_short(calls):
        return "max_tokens", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    if calls:
        return "tool_use", None
    return ("max_tokens" if done.finish_reason == "length" else "end_turn"), None


def usage(prompt_tokens: int, cached: int, output: int) -> dict:
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def tool_use(call: ToolCall) -> dict:
    """A tool_use block; a call that max_tokens cut has the input written so far (its JSON read as far
    as it goes, as Anthropic's clients read a streamed one)."""
    try:
        arguments = jiter.from_json(call.arguments.encode(), partial_mode="trailing-strings")
    except ValueError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": arguments}


def message_of(outcome: Outcome, model: str, ident: str) -> dict:
    """The whole answer as a Message."""
    done = outcome.done
    content: list[dict] = [thinking(outcome.reasoning)] if outcome.reasoning else []
    content += [{"type": "text", "text": outcome.text}] if outcome.text else []
    content += [tool_use(c) for c in outcome.calls]
    reason, sequence = stop_reason(done, outcome.calls)
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens),
    }


def thinking(text: str) -> dict:
    """A thinking block; unsigned (`signature` is Anthropic's proof that it made the thinking)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def event(kind: str, data: dict) -> dict:
    """One server-sent event as sse-starlette sends it: Anthropic names each by its type."""
    return {"event": kind, "data": json.dumps({"type": kind, **data})}


async def events(pieces: AsyncIterator[Any], model: str, ident: str) -> AsyncIterator[dict]:
    """The answer as Anthropic's stream: message_start (with the cached tokens, known once the
    prefix is found), then per block content_block_start, its deltas (thinking_delta and an empty
    signature_delta, text_delta, or the call's arguments as one input_json_delta) and
    content_block_stop, then message_delta (stop_reason, usage) and message_stop."""
    index, calls = 0, []
    open_block: str | None = None  # the kind of the block being written: "thinking" or "text"

    def close() -> list[dict]:
        """The end of the open block, if one is open."""
        nonlocal index, open_block
        closing = []
        if open_block == "thinking":
            signature = {"type": "signature_delta", "signature": ""}
            closing.append(event("content_block_delta", {"index": index, "delta": signature}))
        if open_block is not None:
            closing.append(event("content_block_stop", {"index": index}))
            index, open_block = index + 1, None
        return closing

    def open_(kind: str, block: dict) -> list[dict]:
        """A block of `kind` opened, unless it is the one open (the one before it closed)."""
        nonlocal open_block
        if open_block == kind:
            return []
        opening = [*close(), event("content_block_start", {"index": index, "content_block": block})]
        open_block = kind
        return opening

    try:
        async for piece in pieces:
            if isinstance(piece, Started):
                message: dict[str, Any] = {
                    "id": ident,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage(piece.prompt_tokens, piece.cached_tokens, 0),
                }
                yield event("message_start", {"message": message})
            elif isinstance(piece, Reasoning) and piece.text:
                for e in open_("thinking", thinking("")):
                    yield e
                delta = {"type": "thinking_delta", "thinking": piece.text}
                yield event("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(piece, Text) and piece.text:
                for e in open_("text", {"type": "text", "text": ""}):
                    yield e
                yield event(
                    "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece.text}}
                )
            elif isinstance(piece, ToolCall):
                for e in close():
                    yield e
                block = {**tool_use(piece), "input": {}}
                yield event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                yield event("content_block_delta", {"index": index, "delta": delta})
                yield event("content_block_stop", {"index": index})
                index = index + 1
                calls.append(piece)
            elif isinstance(piece, Done):
                for e in close():
                    yield e
                reason, sequence = stop_reason(piece, calls)
                yield event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(piece.prompt_tokens, piece.cached_tokens, piece.completion_tokens),
                    },
                )
                yield event("message_stop", {})
    except ApiError as e:
        yield {"event": "error", "data": json.dumps(error_body(e))}


@dataclass
class MessageReply:
    """One answer as a Message, or as Anthropic's stream of one."""

    model: str
    ident: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")

    def complete(self, outcome: Outcome) -> dict:
        return message_of(outcome, self.model, self.ident)

    def events(self, pieces: AsyncIterator[Any]) -> AsyncIterator[dict]:
        return events(pieces, self.model, self.ident)


class Messages:
    """The Api of the Messages API."""

    claude_names = True

    def turn_of(self, body: dict, vocab: int) -> Turn:
        return turn_of(body, vocab)

    def reply(self, body: dict, turn: Turn, tokenizer: Any) -> MessageReply:
        return MessageReply(body["model"])

    def error(self, e: ApiError) -> JSONResponse:
        return error_response(e)


MESSAGES = Messages()
