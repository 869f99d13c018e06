"""`kvmesh serve`'s tool calls, structured output and the agents' APIs (Anthropic Messages,
OpenAI Responses): the server `kvmesh serve` runs, of the tiny-tools model, in the test's process
(support.http_clients.InProcessServer: real HTTP, nothing about the process is tested here), the
official `openai` and `anthropic` packages as clients.

The model has random weights, so a call is forced (tool_choice "required" or a named function):
a grammar holds decoding to the call, as servers with structured output do. Each conversation
goes call -> tool result -> next turn, and the next turn must find the whole previous turn (its
prompt and the call the model wrote, as the template renders it back) in the cache.
"""

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from kvmesh.model.loaded import load_model
from support.http_clients import InProcessServer

pytestmark = pytest.mark.slow  # every test here generates with a model: more than the fast tier's budget

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
FUNCTION = {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}
CHAT_TOOLS = [{"type": "function", "function": FUNCTION}]
SYSTEM = "You answer questions about the weather, briefly. " * 4
QUESTION = "What is the weather in Paris for two days?"
ORIGIN = "http://app.example"
# The forced call takes ~60 of the tiny tokenizer's tokens; the next turn only needs to start.
CALL_TOKENS, NEXT_TOKENS = 200, 6


@pytest.fixture(scope="module")
def tools_dir(preset_dir):
    return preset_dir("tiny-tools")


@pytest.fixture(scope="module")
def server(tools_dir, tmp_path_factory):
    """One server for the module (the model loaded once): no mesh, CORS for ORIGIN."""
    started = InProcessServer(
        tools_dir, load_model(str(tools_dir)), tmp_path_factory.mktemp("serve"), web_origins=(ORIGIN,)
    )
    yield started
    started.stop()


@pytest.fixture
def client(server):
    return server.openai()


@pytest.fixture
def claude(server):
    return server.anthropic()


def weather(arguments: str | dict) -> dict:
    """The call's arguments, checked against the tool's schema."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, CITY)
    return value


def chat_messages(content=QUESTION):
    return [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": content}]}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_tool_conversation(client, stream):
    messages = chat_messages()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls, finish, usage = [], None, None
        for chunk in client.chat.completions.create(
            model="tiny-tools",
            messages=messages,
            tools=CHAT_TOOLS,
            tool_choice=choice,
            max_tokens=CALL_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                calls += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        assert len(calls) == 1 and calls[0].index == 0
        call = {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}
    else:
        first = client.chat.completions.create(
            model="tiny-tools", messages=messages, tools=CHAT_TOOLS, tool_choice=choice, max_tokens=CALL_TOKENS
        )
        message, finish, usage = first.choices[0].message, first.choices[0].finish_reason, first.usage
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0].model_dump()
    assert finish == "tool_calls" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    weather(call["function"]["arguments"])

    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"forecast": "sunny", "high": 21}'},
    ]
    second = client.chat.completions.create(
        model="tiny-tools", messages=history, tools=CHAT_TOOLS, max_tokens=NEXT_TOKENS
    )
    # The previous turn, prompt and call alike, was found in the cache: the history re-rendered the
    # call as the model wrote it.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= usage.prompt_tokens + usage.completion_tokens
    assert second.usage.model_extra["kvmesh"]["prefix_from"] == "memory"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages_tool_conversation(claude, stream):
    tools = [{"name": "get_weather", "description": FUNCTION["description"], "input_schema": CITY}]
    messages = [{"role": "user", "content": QUESTION}]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    options = dict(system=system, tools=tools, max_tokens=CALL_TOKENS)
    # Claude Code's names for its models are this server's model.
    if stream:
        with claude.messages.stream(
            model="claude-sonnet-4-5-20250929", messages=messages, tool_choice={"type": "any"}, **options
        ) as events:
            kinds = {e.type for e in events}
            first = events.get_final_message()
        assert {"message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"} <= kinds
    else:
        first = claude.messages.create(
            model="claude-haiku-4-5", messages=messages, tool_choice={"type": "tool", "name": "get_weather"}, **options
        )
    assert first.stop_reason == "tool_use" and first.model.startswith("claude-")
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    weather(use.input)

    history = [
        *messages,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    second = claude.messages.create(
        model="claude-sonnet-4-5", messages=history, **{**options, "max_tokens": NEXT_TOKENS}
    )
    # Anthropic's input_tokens are those prefilled now; the rest was read from the cache.
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= before and second.usage.input_tokens >= 1
    assert second.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_tool_conversation(client, stream):
    tools = [{"type": "function", "strict": True, **FUNCTION}]
    # As Codex CLI sends it: instructions, message items with input_text parts, store false.
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    options = dict(model="tiny-tools", instructions=SYSTEM, tools=tools, store=False)
    if stream:
        kinds, first = [], None
        for event in client.responses.create(
            input=items, tool_choice="required", max_output_tokens=CALL_TOKENS, stream=True, **options
        ):
            kinds.append(event.type)
            if event.type == "response.completed":
                first = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.done" in kinds and "response.output_item.done" in kinds
    else:
        first = client.responses.create(input=items, tool_choice="required", max_output_tokens=CALL_TOKENS, **options)
    assert first.status == "completed"
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    weather(call.arguments)

    history = [
        *items,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    second = client.responses.create(input=history, max_output_tokens=NEXT_TOKENS, **options)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.status == "incomplete" and second.output_text


def test_response_format_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
            "tags": {"type": "array", "items": {"enum": ["wet", "dry"]}, "maxItems": 2},
        },
        "required": ["answer", "confidence", "tags"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model="tiny-tools",
        messages=[{"role": "user", "content": "Will it rain?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}},
        max_tokens=200,
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    # The Responses API's text.format, the same way.
    response = client.responses.create(
        model="tiny-tools",
        input="Will it rain?",
        text={"format": {"type": "json_schema", "name": "forecast", "schema": schema}},
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_logprobs_on_chat_and_completions(client):
    chat = client.chat.completions.create(
        model="tiny-tools", messages=chat_messages(), max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:  # greedy: the chosen token is the most likely one
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert token.logprob <= 0
    text = client.completions.create(model="tiny-tools", prompt="Rivers run", max_tokens=3, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and len(logprobs.top_logprobs[0]) == 2 and logprobs.text_offset[0] == 0
    streamed = client.chat.completions.create(
        model="tiny-tools", messages=chat_messages(), max_tokens=4, logprobs=True, stream=True
    )
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_every_field_is_served_refused_or_reported(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-tools", messages=chat_messages(), n=2)
    assert e.value.body["param"] == "n" and e.value.body["code"] == "unsupported_value"
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny-tools", prompt="Rivers", echo=True)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="tiny-tools",
            messages=chat_messages(),
            tools=CHAT_TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="keeps no responses") as e:
        client.responses.create(model="tiny-tools", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    # Penalties and seeds are served (mlx-lm's); what changes nothing is named in a header and usage.
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-tools",
        messages=chat_messages(),
        max_tokens=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        temperature=0.7,
        user="someone",
        metadata={"run": "1"},
        store=False,
    )
    assert raw.headers["x-kvmesh-ignored"] == "metadata, store, user"
    assert raw.parse().usage.model_extra["kvmesh"]["ignored"] == ["metadata", "store", "user"]

    assert client.models.retrieve("tiny-tools").id == "tiny-tools"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_anthropic_errors_have_anthropic_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
        )
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="gpt-4o", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    counted = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens > 1


def test_cors_for_the_configured_origin_only(server):
    base = server.url.removesuffix("/v1")
    preflight = urllib.request.Request(
        f"{base}/v1/chat/completions",
        method="OPTIONS",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    with urllib.request.urlopen(preflight, timeout=30) as answer:
        assert answer.headers["access-control-allow-origin"] == ORIGIN
    with urllib.request.urlopen(
        urllib.request.Request(f"{base}/v1/models", headers={"Origin": ORIGIN}), timeout=30
    ) as a:
        assert a.headers["access-control-allow-origin"] == ORIGIN
    other = urllib.request.Request(f"{base}/v1/models", headers={"Origin": "http://elsewhere.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(other, timeout=30)
    assert refused.value.code == 403


# A forced call takes ~60 tokens: cut at this many, it has its name and part of its arguments
# (`{"cit`, on this model).
CUT_TOKENS = 40


def cut_arguments(arguments: str) -> None:
    """Arguments that max_tokens cut: the start of the call's JSON object, never the template's markup."""
    assert arguments.startswith("{") and "<tool_call>" not in arguments
    with pytest.raises(ValueError):
        json.loads(arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_cut_by_max_tokens_comes_back_as_each_api_returns_one(client, claude, stream):
    # Chat completions: tool_calls with the arguments so far, finish_reason "length", no markup as text.
    options = dict(model="tiny-tools", messages=chat_messages(), tools=CHAT_TOOLS, tool_choice="required")
    if stream:
        deltas = [c.choices[0] for c in client.chat.completions.create(max_tokens=CUT_TOKENS, stream=True, **options)]
        assert "".join(d.delta.content or "" for d in deltas) == ""
        calls = [call for d in deltas for call in d.delta.tool_calls or []]
        (call,) = calls
        name, arguments, finish = call.function.name, call.function.arguments, deltas[-1].finish_reason
    else:
        choice = client.chat.completions.create(max_tokens=CUT_TOKENS, **options).choices[0]
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
    assert (name, finish) == ("get_weather", "length")
    cut_arguments(arguments)

    # Anthropic: a tool_use block (its input read as far as it goes), stop_reason "max_tokens".
    tools = [{"name": "get_weather", "description": FUNCTION["description"], "input_schema": CITY}]
    asked = dict(model="claude-sonnet-4-5", max_tokens=CUT_TOKENS, tools=tools, tool_choice={"type": "any"})
    asked["messages"] = [{"role": "user", "content": QUESTION}]
    if stream:
        with claude.messages.stream(**asked) as events:
            kinds = [e.type for e in events]
            message = events.get_final_message()
        assert kinds[-1] == "message_stop"
    else:
        message = claude.messages.create(**asked)
    (use,) = message.content
    assert (use.type, use.name, message.stop_reason) == ("tool_use", "get_weather", "max_tokens")
    assert isinstance(use.input, dict)

    # Responses: a function_call item with status "incomplete"; the response incomplete, and ended.
    items = dict(model="tiny-tools", input=QUESTION, tools=[{"type": "function", **FUNCTION}], tool_choice="required")
    if stream:
        events = list(client.responses.create(max_output_tokens=CUT_TOKENS, stream=True, **items))
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = client.responses.create(max_output_tokens=CUT_TOKENS, **items)
    (item,) = response.output
    assert (item.type, item.name, item.status, response.status) == (
        "function_call",
        "get_weather",
        "incomplete",
        "incomplete",
    )
    cut_arguments(item.arguments)


def test_a_request_without_a_limit_generates_past_512_tokens_and_completes(client):
    # As Codex CLI asks: no max_output_tokens. A schema holds the random model to a long answer that
    # ends by itself (600 digits, each its own token or two), so the stream must end "completed".
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}
    schema = {**digits, "minItems": 600, "maxItems": 600}
    text = {"format": {"type": "json_schema", "name": "digits", "schema": schema}}
    events = list(client.responses.create(model="tiny-tools", input="Count.", text=text, stream=True))
    assert events[-1].type == "response.completed"
    done = events[-1].response
    assert done.usage.output_tokens > 512 and len(json.loads(done.output_text)) == 600
    model = client.models.retrieve("tiny-tools")
    assert model.model_extra["max_model_len"] == 8192 and "max_tokens" not in model.model_extra


def test_an_anthropic_prefill_is_continued(claude, tools_dir):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm.load(str(tools_dir))
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": '{"city":'}]
    # The chat rendered to the end of the assistant's words (transformers' continue_final_message).
    prompt = tokenizer.apply_chat_template(chat, continue_final_message=True, add_generation_prompt=False)
    assert tokenizer.decode(prompt).endswith('{"city":')
    expected = "".join(r.text for r in stream_generate(model, tokenizer, mx.array(prompt), 8))
    made = claude.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=chat)
    assert [(b.type, b.text) for b in made.content] == [("text", expected)]
    assert made.usage.input_tokens + made.usage.cache_read_input_tokens == len(prompt)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude.messages.create(
            model="claude-sonnet-4-5", max_tokens=8, messages=[chat[0], {"role": "assistant", "content": "The "}]
        )


def test_reasoning_settings_on_a_model_that_does_not_reason_are_named_as_ignored(client, claude):
    chat = client.chat.completions.with_raw_response.create(
        model="tiny-tools", messages=chat_messages(), max_tokens=2, reasoning_effort="none"
    )
    assert chat.headers["x-kvmesh-ignored"] == "reasoning_effort"
    high = client.chat.completions.with_raw_response.create(
        model="tiny-tools", messages=chat_messages(), max_tokens=2, reasoning_effort="high"
    )
    assert high.headers["x-kvmesh-ignored"] == "reasoning_effort"
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = claude.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=2, messages=[{"role": "user", "content": QUESTION}], thinking=thinking
    )
    assert message.headers["x-kvmesh-ignored"] == "thinking"
    response = client.responses.with_raw_response.create(
        model="tiny-tools", input=QUESTION, max_output_tokens=2, reasoning={"effort": "low", "summary": "auto"}
    )
    assert response.headers["x-kvmesh-ignored"] == "reasoning.effort, reasoning.summary"
