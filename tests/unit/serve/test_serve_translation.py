"""The serve APIs' translation, in process (no server): tool calls read with mlx-lm's parser, a call
forced by the grammar and rendered back token for token, and the three APIs' histories rendering
to one prompt."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import stream_generate

from kvmesh.serve.answer import AnswerSplitter
from kvmesh.serve.api_errors import ApiError
from kvmesh.serve.apis import anthropic, openai_api, responses
from kvmesh.serve.grammar import GrammarError, Grammars, json_schema_grammar
from kvmesh.serve.tools import ToolCall, forced_call_grammar, openai_tool_choice, openai_tools

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    from kvmesh.model.testmodels import make_test_model

    return mlx_lm.load(str(make_test_model(tmp_path_factory.mktemp("models") / "tiny-tools", "tiny-tools")))


def render(tokenizer, messages, tools=CHAT_TOOLS):
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))


def test_mlx_lm_reads_the_presets_tool_calls(tools_model):
    _, tokenizer = tools_model
    assert tokenizer.has_tool_calling and tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    splitter = AnswerSplitter(tokenizer, openai_tools(CHAT_TOOLS), calls=True, reasoning=True, prompt=[])
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>Done'
    pieces = [p for i in range(0, len(text), 7) for p in splitter.feed(text[i : i + 7])] + splitter.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look.Done"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]

    # A call cut short is a call that is not complete, its arguments as far as they were written
    # (never the markup); one cut before its name was written is nothing; with tool_choice "none"
    # nothing is read.
    def cut(text):
        splitter = AnswerSplitter(tokenizer, openai_tools(CHAT_TOOLS), calls=True, reasoning=True, prompt=[])
        return splitter.feed(text) + splitter.finish()

    (partial,) = cut('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')[1:]
    assert (partial.name, partial.arguments, partial.complete) == ("get_weather", '{"city": "Par', False)
    assert cut('<tool_call>\n{"name": "get_') == []
    assert cut('<tool_call>\n{"name": "no_such_tool", "arguments": {') == []
    plain = AnswerSplitter(tokenizer, openai_tools(CHAT_TOOLS), calls=False, reasoning=True, prompt=[])
    assert "".join(map(str, plain.feed(text) + plain.finish())) == text


def test_a_forced_call_renders_back_as_the_model_wrote_it(tools_model):
    model, tokenizer = tools_model
    tools = openai_tools(CHAT_TOOLS)
    grammar = forced_call_grammar(tokenizer, tools, openai_tool_choice("required", tools))
    processor = Grammars(tokenizer).processor(grammar)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = render(tokenizer, messages)
    generated, text = [], ""
    for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=200, logits_processors=[processor]):
        generated.append(r.token)
        text += r.text
    assert r.finish_reason == "stop" and generated[-1] in tokenizer.eos_token_ids
    splitter = AnswerSplitter(tokenizer, tools, calls=True, reasoning=True, prompt=[])
    (call,) = [p for p in splitter.feed(text) + splitter.finish() if isinstance(p, ToolCall)]
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    # The history with that call renders the prompt, then exactly the tokens generated: the next turn's
    # cache is the whole previous turn.
    history = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": call.name, "arguments": call.arguments}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    again = render(tokenizer, [*history[:1], {**history[1], "tool_calls": [openai_call(call)]}, history[2]])
    assert again[: len(prompt) + len(generated)] == prompt + generated


def openai_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def test_the_three_apis_render_one_conversation_alike(tools_model):
    _, tokenizer = tools_model
    arguments = '{"city": "Paris"}'
    chat = openai_api.chat_turn(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": CHAT_TOOLS,
        },
        512,
    )
    claude = anthropic.turn_of(
        {
            "model": "claude-x",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
            ],
        },
        512,
    )
    codex = responses.turn_of(
        {
            "model": "m",
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": SCHEMA}],
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
        },
        512,
    )
    prompts = [render(tokenizer, t.messages, [x.spec for x in t.tools]) for t in (chat, claude, codex)]
    assert prompts[0] == prompts[1] == prompts[2]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 3}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True, "other": 1}}, "stream_options"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": []}, "functions"),
        ({"reasoning_effort": "hard"}, "reasoning_effort"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"return_tensors": "np"}}, "chat_template_kwargs"),
    ],
)
def test_chat_fields_refused_with_their_name(body, param):
    with pytest.raises(ApiError) as e:
        openai_api.chat_turn({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, 512)
    assert e.value.status == 400 and e.value.param == param


def test_json_schema_grammar_refuses_what_llguidance_cannot_hold(tools_model):
    _, tokenizer = tools_model
    assert Grammars(tokenizer).processor(json_schema_grammar(SCHEMA)) is not None
    with pytest.raises(GrammarError):
        Grammars(tokenizer).processor(json_schema_grammar({"type": "no-such-type"}))


def test_each_apis_thinking_switch():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert openai_api.chat_turn({**chat, "reasoning_effort": "none"}, 512).thinking is False
    assert openai_api.chat_turn({**chat, "reasoning_effort": "high"}, 512).thinking is None
    kwargs = openai_api.chat_turn({**chat, "chat_template_kwargs": {"enable_thinking": False}}, 512)
    assert kwargs.template_kwargs == {"enable_thinking": False} and "chat_template_kwargs" not in kwargs.ignored
    claude = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert anthropic.turn_of({**claude, "thinking": {"type": "disabled"}}, 512).thinking is False
    assert anthropic.turn_of({**claude, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 512).thinking
    assert anthropic.turn_of({**claude, "thinking": {"type": "between_tools"}}, 512).thinking
    assert openai_api.chat_turn({**chat, "reasoning_effort": "max"}, 512).thinking is None
    with pytest.raises(ApiError) as e:
        anthropic.turn_of({**claude, "thinking": {"type": "on"}}, 512)
    assert e.value.param == "thinking"
    codex = responses.turn_of({"model": "m", "input": "hi", "reasoning": {"effort": "none", "summary": "auto"}}, 512)
    assert codex.thinking is False and codex.ignored == ["reasoning.summary"]


def test_a_refused_field_sent_as_false_or_null_asks_for_nothing():
    """Clients send `"background": false` (and the like) to say they want none of it: only a field
    that asks for what is not served is refused."""
    codex = {"model": "m", "input": "hi"}
    assert responses.turn_of({**codex, "background": False, "conversation": None}, 512).messages
    with pytest.raises(ApiError) as e:
        responses.turn_of({**codex, "background": True}, 512)
    assert (e.value.param, e.value.code) == ("background", "unsupported_value")
    claude = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert anthropic.turn_of({**claude, "mcp_servers": []}, 512).messages
    with pytest.raises(ApiError) as e:
        anthropic.turn_of({**claude, "top_k": 513}, 512)
    assert e.value.param == "top_k"
