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


def refuse_given(body: dict, refused: dict[str, str]) -> None:
    """Refuse a body that gives any of the `refused` fields (name -> why not), or a `stream` that is
    not a boolean."""
    for name, why in refused.items():
        if body.get(name):
            raise refuse(why, name, "unsupported_value")
    stream_flag(body)


def stream_flag(body: dict) -> bool:
    """The body's `stream`, which must be true or false when given."""
    if not isinstance(body.get("stream", False), bool):
        raise refuse("stream must be true or false", "stream", "invalid_type")
    return bool(body.get("stream"))


def thinking_of(effort: Any, param: str) -> bool | None:
    """OpenAI's reasoning effort as a thinking switch: "none" turns it off, an effort leaves it on."""
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        raise refuse('a reasoning effort is "none", "minimal", "low", "medium", "high", "xhigh" or "max"', param)
    return None if effort != "none" else False


def effort_served(turn: Turn, effort: Any, param: str) -> Turn:
    """`turn` with what a reasoning effort does: "none" turns a reasoning model's thinking off (and
    is ignored by any other model); any other effort changes nothing here (the model thinks as long
    as it does), so it is named as ignored."""
    turn.thinking = thinking_of(effort, param)
    if effort is not None:
        (turn.reasoning_fields if effort == "none" else turn.ignored).append(param)
    return turn


def number(body: dict, name: str, kind: type, default: Any, low: float, high: float) -> Any:
    """`body[name]` as `kind`, between `low` and `high`; `default` when absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise refuse(f"{name} must be a{'n integer' if kind is int else ' number'}", name, "invalid_type")
    if not low <= value <= high:
        raise refuse(f"{name} must be between {low} and {high}, not {value}", name)
    return kind(value)


def stop_strings(value: Any, param: str = "stop", limit: int = 4) -> list[str]:
    """A stop string or a list of up to `limit` (OpenAI's four; Anthropic's API sets no bound)."""
    stop = value or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > limit:
        raise refuse(f"{param} must be a string or a list of up to {limit} non-empty strings", param)
    return stop


def seed_of(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise refuse("seed must be an integer", "seed", "invalid_type")
    if seed is not None and not 0 <= seed < 1 << 63:  # what MLX's random seed takes
        raise refuse(f"seed must be between 0 and 2^63-1, not {seed}", "seed")
    return seed


def logit_bias_of(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: token ids (as strings, JSON's keys) to a bias from -100 to 100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise refuse("logit_bias must be an object of token ids to biases", "logit_bias", "invalid_type")
    bias = []
    for key, b in value.items():
        if not str(key).isdigit() or int(key) >= vocab:
            raise refuse(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})", "logit_bias")
        bias.append((int(key), number({"logit_bias": b}, "logit_bias", float, 0.0, -100, 100)))
    return tuple(bias)


def sampling_of(body: dict, vocab: int) -> Sampling:
    """mlx-lm's sampler and logits processors, from the fields OpenAI's APIs share (and the usual
    extras of local servers: top_k, min_p, repetition_penalty)."""
    return Sampling(
        temperature=number(body, "temperature", float, 0.0, 0.0, 2.0),
        top_p=number(body, "top_p", float, 1.0, 0.0, 1.0),
        seed=seed_of(body),
        top_k=number(body, "top_k", int, 0, 0, vocab),
        min_p=number(body, "min_p", float, 0.0, 0.0, 1.0),
        presence_penalty=number(body, "presence_penalty", float, 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
        repetition_penalty=number(body, "repetition_penalty", float, None, 0.0, 10.0),
        logit_bias=logit_bias_of(body.get("logit_bias"), vocab),
    )


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
