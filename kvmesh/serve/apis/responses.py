"""OpenAI's Responses API (`POST /v1/responses`), as Turns and back: what Codex CLI speaks.

Served: `input` (a string, or items: messages with `input_text`/`output_text` parts, the model's
`function_call`s and their `function_call_output`s), `instructions` (the system message), function
`tools`, `tool_choice`, `text.format` (json_object, json_schema), `max_output_tokens`,
`temperature`, `top_p`, `stream` (the API's typed events). The history is rendered through the
chat template as chat completions' would be: an assistant message and the calls after it are one
assistant turn, as the model wrote them, so the next prompt extends the last.

This server keeps no responses: `previous_response_id` and `conversation` are refused (send the
whole input, as Codex CLI does with `store: false`), and `store` has no effect. Also without
effect: `include`, `reasoning.summary` (a reasoning model's thinking comes back whole, as a
`reasoning` item of `reasoning_text`; `reasoning.effort` "none" turns it off; a reasoning item sent
back goes to the template as the next assistant turn's `reasoning_content`),
`parallel_tool_calls`, `prompt_cache_key` (the cache is found by prefix), `metadata`, `user`,
`service_tier`, `truncation`, `safety_identifier`, `text.verbosity`, and fields this server does
not know. Refused: tools other than functions, images and files, `background`, `top_logprobs`.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from kvmesh.serve.answer import Reasoning
from kvmesh.serve.api_errors import ApiError, refuse
from kvmesh.serve.engine import Done, Sampling
from kvmesh.serve.protocol import responses as protocol
from kvmesh.serve.protocol.base import parse
from kvmesh.serve.protocol.responses import ResponsesRequest
from kvmesh.serve.tools import (
    Tool,
    ToolCall,
    cut_short,
    function_tool,
    openai_tool_choice,
    template_messages,
    unique,
)
from kvmesh.serve.turns import Outcome, Text, Turn, effort_served, refuse_given, response_format_of

REFUSED = {
    "previous_response_id": "this server keeps no responses: send the whole conversation as input",
    "conversation": "this server keeps no conversations: send the whole conversation as input",
    "background": "background responses are not served",
    "top_logprobs": "log probabilities are served on /v1/chat/completions and /v1/completions",
}
TEXT_PARTS = ("input_text", "output_text", "text")


def part_text(content: Any, param: str) -> str:
    """A string, or the text of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise refuse(f"{param}: only text parts are served (no images or files)", param)


def chat_of(request: ResponsesRequest) -> list[dict]:
    """The input items as OpenAI-shaped chat messages."""
    out: list[dict] = []
    if request.instructions is not None:
        out.append({"role": "system", "content": request.instructions})
    items = request.input
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    thought = ""  # a reasoning item's text, for the assistant turn after it
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise refuse(f"a message's role must be user, assistant, system or developer, not {role!r}", "input")
            out.append({"role": role, "content": part_text(item.get("content", ""), "input")})
            if role == "assistant" and thought:
                out[-1]["reasoning"], thought = thought, ""
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the calls after a message: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if thought:
                out[-1]["reasoning"], thought = thought, ""
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else part_text(output, "input")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":  # this model's own thinking (its text; an encrypted one has none)
            parts = item.get("content") or item.get("summary") or []
            thought += "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        else:
            raise refuse(f"input items of type {kind!r} are not served", "input")
    return out


def tools_of(value: list[dict] | None) -> list[Tool]:
    """The Responses API's tools: `{"type": "function", "name", "description", "parameters"}`."""
    tools = []
    for tool in value or []:
        if tool.get("type") != "function":
            raise refuse(f"only function tools are served, not {tool.get('type')!r}", "tools", "unsupported_value")
        tools.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), "tools"))
    return unique(tools, "tools")


def turn_of(body: dict, vocab: int) -> Turn:
    """A Responses body as a Turn."""
    request = parse(ResponsesRequest, body)
    refuse_given(request, REFUSED)
    text, reasoning = request.text or protocol.Text(), request.reasoning or protocol.Reasoning()
    tools = tools_of(request.tools)
    ignored = request.unknown()
    ignored += [f"reasoning.{k}" for k in reasoning.unknown()]  # (summary: none is written)
    ignored += [f"text.{k}" for k in text.unknown()]  # (verbosity: the model says what it says)
    turn = Turn(
        messages=template_messages(chat_of(request), "input"),
        tools=tools,
        tool_choice=openai_tool_choice(request.tool_choice, tools),
        response_format=response_format_of(text.format, "text.format"),
        max_tokens=request.max_output_tokens,
        sampling=Sampling(
            temperature=request.temperature or 0.0, top_p=1.0 if request.top_p is None else request.top_p
        ),
        ignored=ignored,
        stream=bool(request.stream),
    )
    return effort_served(turn, reasoning.effort, "reasoning.effort")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(ident: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "added" else []
    return {
        "type": "message",
        "id": ident,
        "status": "in_progress" if status == "added" else "completed",
        "role": "assistant",
        "content": content,
    }


def reasoning_item(ident: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status != "added" else []
    return {
        "type": "reasoning",
        "id": ident,
        "summary": [],
        "content": content,
        "status": "in_progress" if status == "added" else "completed",
    }


def call_item(ident: str, call: ToolCall, status: str) -> dict:
    """A function_call item; one that max_tokens cut is "incomplete", with the arguments written so far."""
    done = "completed" if call.complete else "incomplete"
    return {
        "type": "function_call",
        "id": ident,
        "call_id": f"call_{call.id}",
        "name": call.name,
        "arguments": call.arguments if status != "added" else "",
        "status": "in_progress" if status == "added" else done,
    }


@dataclass
class Answer:
    """One response as it is written: the request it answers, its id, and its output items."""

    body: dict
    ident: str
    created: int
    # Tokens of a text by the model's tokenizer: usage's reasoning_tokens are the reasoning's text
    # tokenized again (the engine counts a completion's tokens, not which part each went to).
    count_tokens: Callable[[str], int]
    output: list[dict] = field(default_factory=list)
    sequence: int = 0
    _calls: list[ToolCall] = field(default_factory=list)

    def response(self, status: str, done: Done | None = None) -> dict:
        """The Response object (`status`: in_progress, completed or incomplete)."""
        body = self.body
        text_format = (body.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": body["model"],
            "output": list(self.output),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "store": False,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "text": {"format": text_format},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "usage": usage(done, self.count_tokens(self.reasoning())) if done is not None else None,
        }

    def calls(self) -> list[ToolCall]:
        """The calls written so far."""
        return list(self._calls)

    def reasoning(self) -> str:
        """The reasoning written so far (its items' text)."""
        return "".join(c["text"] for i in self.output if i["type"] == "reasoning" for c in i["content"])

    def complete(self, outcome: Outcome) -> dict:
        """The whole answer, not streamed."""
        if outcome.reasoning:
            self.output.append(reasoning_item(new_id("rs"), outcome.reasoning, "done"))
        if outcome.text or not outcome.calls:
            self.output.append(message_item(new_id("msg"), outcome.text, "done"))
        self.output += [call_item(new_id("fc"), c, "done") for c in outcome.calls]
        self._calls += outcome.calls
        return self.response(status_of(outcome.done, outcome.calls), outcome.done)

    def event(self, kind: str, **data: Any) -> dict:
        self.sequence += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.sequence - 1, **data})}

    async def events(self, pieces: AsyncIterator[Any]) -> AsyncIterator[dict]:
        """The answer as the Responses API streams it: response.created and .in_progress; per output
        item, output_item.added, its content (reasoning_text deltas, a message's content_part and
        output_text deltas, a call's function_call_arguments) and output_item.done; then
        response.completed (or .incomplete at max_output_tokens) with usage."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        text, message = "", None  # the open message item's text and id
        thought, reasoning = "", None  # the open reasoning item's text and id
        try:
            async for piece in pieces:
                goes_on = isinstance(piece, Reasoning) or (isinstance(piece, Text) and not piece.text)
                if reasoning is not None and not goes_on:  # the thinking's item ends
                    for e in self.close_reasoning(reasoning, thought):
                        yield e
                    thought, reasoning = "", None
                if isinstance(piece, Reasoning) and piece.text:
                    if message is not None:  # (thinking after some text: the text's item ends first)
                        for e in self.close_message(message, text):
                            yield e
                        text, message = "", None
                    if reasoning is None:
                        reasoning = new_id("rs")
                        item = reasoning_item(reasoning, "", "added")
                        yield self.event("response.output_item.added", item=item, output_index=len(self.output))
                    thought += piece.text
                    where = {"item_id": reasoning, "output_index": len(self.output), "content_index": 0}
                    yield self.event("response.reasoning_text.delta", delta=piece.text, **where)
                elif isinstance(piece, Text) and piece.text:
                    if message is None:
                        message = new_id("msg")
                        where = {"output_index": len(self.output)}
                        yield self.event("response.output_item.added", item=message_item(message, "", "added"), **where)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        yield self.event(
                            "response.content_part.added", item_id=message, content_index=0, part=part, **where
                        )
                    text += piece.text
                    yield self.event(
                        "response.output_text.delta",
                        item_id=message,
                        output_index=len(self.output),
                        content_index=0,
                        delta=piece.text,
                        logprobs=[],
                    )
                elif isinstance(piece, (ToolCall, Done)):
                    if message is not None:
                        for e in self.close_message(message, text):
                            yield e
                        text, message = "", None
                    if isinstance(piece, ToolCall):
                        for e in self.call_events(piece):
                            yield e
                    else:
                        status = status_of(piece, self.calls())
                        yield self.event(f"response.{status}", response=self.response(status, piece))
        except ApiError as e:
            error = {"code": e.code or "server_error", "message": e.message}
            yield self.event("response.failed", response={**self.response("failed"), "error": error})

    def close_reasoning(self, reasoning: str, text: str) -> list[dict]:
        where = {"item_id": reasoning, "output_index": len(self.output), "content_index": 0}
        item = reasoning_item(reasoning, text, "done")
        self.output.append(item)
        return [
            self.event("response.reasoning_text.done", text=text, **where),
            self.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def close_message(self, message: str, text: str) -> list[dict]:
        where = {"item_id": message, "output_index": len(self.output), "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        item = message_item(message, text, "done")
        self.output.append(item)
        return [
            self.event("response.output_text.done", text=text, logprobs=[], **where),
            self.event("response.content_part.done", part=part, **where),
            self.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def call_events(self, call: ToolCall) -> list[dict]:
        ident, index = new_id("fc"), len(self.output)
        self._calls.append(call)
        item = call_item(ident, call, "done")
        self.output.append(item)
        return [
            self.event("response.output_item.added", output_index=index, item=call_item(ident, call, "added")),
            self.event(
                "response.function_call_arguments.delta", item_id=ident, output_index=index, delta=call.arguments
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=ident,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


def status_of(done: Done, calls: list[ToolCall]) -> str:
    """ "incomplete" when max_tokens cut the answer, unless it made calls and all of them are whole."""
    cut = cut_short(calls) or (done.finish_reason == "length" and not calls)
    return "incomplete" if cut else "completed"


def usage(done: Done, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.cached_tokens},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, done.completion_tokens)},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


class Responses:
    """The Api of the Responses API."""

    claude_names = False

    def turn_of(self, body: dict, vocab: int) -> Turn:
        return turn_of(body, vocab)

    def reply(self, body: dict, turn: Turn, tokenizer: Any) -> Answer:
        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

        return Answer(body, f"resp_{uuid.uuid4().hex}", int(time.time()), count_tokens=count_tokens)

    def error(self, e: ApiError) -> Response:
        return e.response()


RESPONSES = Responses()
