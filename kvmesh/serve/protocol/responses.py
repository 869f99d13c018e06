"""OpenAI's Responses API request body (`POST /v1/responses`), as Codex CLI and the `openai` client
send it."""

from typing import Annotated, Any

from pydantic import Field

from kvmesh.serve.protocol.base import MAX_MESSAGES, MAX_TOOLS, Body, Objects, Probability, Tokens
from kvmesh.serve.protocol.openai import Effort


class Text(Body):
    """`text`: its `format` (text, json_object, json_schema); `verbosity` has no effect here."""

    format: dict[str, Any] | None = None


class Reasoning(Body):
    """`reasoning`: its `effort`; `summary` has no effect here (the thinking comes back whole)."""

    effort: Effort | None = None


class ResponsesRequest(Body):
    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[Objects, Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: Objects | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    text: Text | None = None
    max_output_tokens: Tokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    stream: bool | None = None
    reasoning: Reasoning | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    top_logprobs: Any = None
