"""The Anthropic Messages API's request body (`POST /v1/messages`, and `/v1/messages/count_tokens`),
as Claude Code and the `anthropic` client send it."""

from typing import Annotated, Any, Literal

from pydantic import Field

from kvmesh.serve.protocol.base import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Body,
    Objects,
    Probability,
    StopStrings,
    Tokens,
)


class Thinking(Body):
    """`{"type": "enabled", "budget_tokens": N}`, `{"type": "disabled"}`, and the newer "adaptive"
    and "between_tools"; its other keys (`display`) are named as ignored."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Tokens | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(Body):
    model: str
    messages: Objects = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Tokens
    system: str | Objects | None = None
    tools: Objects | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    stop_sequences: StopStrings | None = Field(None, max_length=64)  # (Anthropic sets no bound)
    temperature: Probability | None = None  # (Anthropic's goes to 1)
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool | None = None
    thinking: Thinking | None = None
    mcp_servers: Any = None
    container: Any = None
