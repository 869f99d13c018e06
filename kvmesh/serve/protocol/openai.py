"""OpenAI's chat completions and completions request bodies (`POST /v1/chat/completions`,
`/v1/completions`), with the usual extras of local servers (top_k, min_p, repetition_penalty,
chat_template_kwargs, cache_salt)."""

from typing import Annotated, Any, Literal

from pydantic import Field

from kvmesh.serve.protocol.base import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Body,
    Closed,
    Objects,
    Penalty,
    Probability,
    Seed,
    StopStrings,
    Tokens,
    TopLogprobs,
)

# OpenAI's reasoning efforts (and the newer "xhigh" and "max" some clients send).
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(Closed):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # (accepted: there is no padding to add)


class Sampled(Body):
    """What chat completions and completions share: the model, the sampling, the limits, the stream,
    and the fields refused on both (read here so that the refusal can name them)."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    seed: Seed | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # (at most the vocabulary: the translator knows it)
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    stop: StopStrings | None = Field(None, max_length=4)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    cache_salt: Any = None  # (read and bounded for every API by the HTTP layer: kvmesh.serve.http.app)
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None

    @property
    def limit(self) -> int | None:
        """The tokens asked for: `max_completion_tokens` (chat's newer name), else `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(Sampled):
    messages: Objects = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Objects | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    reasoning_effort: Effort | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampled):
    prompt: Annotated[list[str], Field(min_length=1, max_length=1)] | str
    logprobs: TopLogprobs | None = None
    suffix: Any = None  # (chat has none: there, it is an unknown key)
