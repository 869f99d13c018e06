"""One request as the engine sees it, whichever API it came by (chat completions, completions, the
Anthropic Messages API, the Responses API), and what comes back from it.

Each API's module turns its body into a `Turn` (kvmesh.serve.apis: openai_api, anthropic, responses),
the application renders, runs and reads it the same way for all, and the module writes the result
in its own shape. The checks that every API shares (numbers, stop strings, the response format)
live here, so a field means the same wherever it comes from.
"""

from dataclasses import dataclass, field
from typing import Any

from kvmesh.serve.answer import Reasoning
from kvmesh.serve.api_errors import refuse
from kvmesh.serve.engine import Done, Sampling, Started, TokenLogprob
from kvmesh.serve.tools import Tool, ToolCall, ToolChoice


@dataclass(frozen=True)
class Text:
    """Plain text of an answer, with the log probabilities of the tokens it came with."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must be: "text" (anything), "json_object" (any JSON object) or
    "json_schema" (a document valid under `schema`), the last two held to it by a grammar."""

    kind: str = "text"
    schema: dict | None = None


@dataclass
class Turn:
    """What to render (chat `messages` through the template, or a raw `prompt`), how to sample, and
    what to return. `ignored` names the fields accepted that change nothing (`user`, `metadata`,
    ...): the response says so in a header, rather than ignoring them silently."""

    messages: list[dict] | None = None
    prompt: str | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    top_logprobs: int | None = None
    partition: bytes | None = None
    ignored: list[str] = field(default_factory=list)
    # Whether a reasoning model thinks first (the template's `enable_thinking`); None: as its template
    # does by default. And variables for the template (chat's `chat_template_kwargs`, as mlx-lm's).
    thinking: bool | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The last message's text when the request's chat ends in the assistant's own words (an Anthropic
    # prefill such as `{"city":`): the answer goes on from it instead of starting a new turn.
    continues: str | None = None
    # Tokens the thinking may take before it is ended (Anthropic's budget_tokens); None: no bound.
    thinking_budget: int | None = None
    # Fields that act on a reasoning model only: on any other, they are named as ignored too.
    reasoning_fields: list[str] = field(default_factory=list)
    # Whether the answer is streamed, and (chat completions' and completions' stream_options)
    # whether the stream ends with the usage.
    stream: bool = False
    include_usage: bool = False


# What a running turn yields: the prefix found, reasoning, text, calls, and the end.
Piece = Started | Reasoning | Text | ToolCall | Done


@dataclass
class Outcome:
    """A whole answer: its text, its calls, its tokens' log probabilities, the engine's Done, and
    its reasoning."""

    text: str
    calls: list[ToolCall]
    logprobs: list[TokenLogprob]
    done: Done
    # What a reasoning model thought before its answer (kvmesh.serve.answer).
    reasoning: str = ""


def refuse_given(request: Any, refused: dict[str, str]) -> None:
    """Refuse a request that gives any of the `refused` fields (name -> why not) a value other than
    null, false or empty (a client that sends `"background": false` asks for nothing refused)."""
    for name, why in refused.items():
        if getattr(request, name):
            raise refuse(why, name, "unsupported_value")


def top_k_of(top_k: int | None, vocab: int) -> int:
    """A request's `top_k` (0: off), which may not exceed the model's vocabulary."""
    if top_k is not None and top_k > vocab:
        raise refuse(f"top_k must be at most this model's vocabulary of {vocab}, not {top_k}", "top_k")
    return top_k or 0


def effort_served(turn: Turn, effort: Any, param: str) -> Turn:
    """`turn` with what a reasoning effort does: "none" turns a reasoning model's thinking off (and
    is ignored by any other model); any other effort changes nothing here (the model thinks as long
    as it does), so it is named as ignored."""
    turn.thinking = False if effort == "none" else None
    if effort is not None:
        (turn.reasoning_fields if effort == "none" else turn.ignored).append(param)
    return turn


def response_format_of(value: Any, param: str = "response_format") -> ResponseFormat:
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}` (chat completions), or the Responses API's `text.format`, whose
    json_schema has `schema` beside `type`."""
    if value is None:
        return ResponseFormat()
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise refuse(f'{param} must be {{"type": "text" | "json_object" | "json_schema", ...}}', param)
    if value["type"] != "json_schema":
        return ResponseFormat(value["type"])
    inner = value.get("json_schema", value)
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise refuse(f"{param}: a json_schema format needs its schema (a JSON schema object)", param)
    return ResponseFormat("json_schema", schema)
