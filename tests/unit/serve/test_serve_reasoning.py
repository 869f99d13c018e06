"""A reasoning model's thinking returned apart from its answer, as each API names it: chat's
`reasoning`, Anthropic's `thinking` blocks, the Responses API's `reasoning` items, streamed and not.
The tiny-think model's template opens its turn with <think> (as DeepSeek R1's and Qwen3's thinking
models' do); mlx-lm reads the markers from its vocabulary, and its TextStateMachine splits the text.
Random weights: the text is compared with what mlx-lm itself generates, split at </think>."""

import json

import jsonschema
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors

from kvmesh.model.loaded import load_model
from kvmesh.serve.answer import AnswerSplitter, Reasoning
from kvmesh.serve.tools import ToolCall, function_tool
from support.http_clients import InProcessServer

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# A bias on </think> that ends the random model's thinking part way (measured: the greedy text then
# holds both parts on this model).
END_BIAS = 2.0
TOKENS = 24
BUDGET = 8


@pytest.fixture(scope="module")
def think_dir(preset_dir):
    return preset_dir("tiny-think")


@pytest.fixture(scope="module")
def think(preset_model):
    return preset_model("tiny-think")


def reference(think, *, bias: float = 0.0, thinking: bool = True) -> tuple[str, str]:
    """(reasoning, answer) of mlx-lm's own greedy text, split at the first </think> (with thinking
    off, the template has closed it: all is answer)."""
    model, tokenizer = think
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=thinking)
    end = tokenizer.convert_tokens_to_ids("</think>")
    processors = make_logits_processors({end: bias}) if bias else None
    text = "".join(
        r.text for r in stream_generate(model, tokenizer, mx.array(prompt), TOKENS, logits_processors=processors)
    )
    if not thinking:
        return "", text
    thought, _, answer = text.partition("</think>")
    return thought, answer


def test_the_splitter_finds_markers_split_across_pieces(think):
    _, tokenizer = think
    opened = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    tools = [function_tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}, "t")]
    splitter = AnswerSplitter(tokenizer, tools, calls=True, reasoning=True, prompt=opened)
    pieces = []
    for text in ["Rain, I th", "ink.</thi", "nk>It rains. <tool_", 'call>\n{"name": "get_weather", "arguments": ']:
        pieces += splitter.feed(text)
    pieces += splitter.feed('{"city": "Paris"}}\n</tool_call>')
    pieces += splitter.finish()
    thought = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    answer = "".join(p for p in pieces if isinstance(p, str))
    [call] = [p for p in pieces if isinstance(p, ToolCall)]
    assert (thought, answer.strip()) == ("Rain, I think.", "It rains.")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # A prompt whose thinking is closed (enable_thinking off) starts in the answer; a raw completion
    # (reasoning not asked for) keeps the markers as text.
    closed = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert AnswerSplitter(tokenizer, [], calls=False, reasoning=True, prompt=closed).feed("Sunny.") == ["Sunny."]
    raw = AnswerSplitter(tokenizer, [], calls=False, reasoning=False, prompt=opened)
    assert raw.feed("a</think>b") + raw.finish() == ["a</think>b"]


def split(splitter: AnswerSplitter, text: str) -> list:
    return [*splitter.feed(text), *splitter.finish()]


def test_markup_in_the_thinking_stays_thinking_and_a_call_made_there_goes_on_thinking(think):
    _, tokenizer = think
    opened = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    musing = "I could write <tool_call>x</tool_call> but I won't.</think>Answer"
    no_tools = split(AnswerSplitter(tokenizer, [], calls=True, reasoning=True, prompt=opened), musing)
    assert no_tools == [Reasoning("I could write <tool_call>x</tool_call> but I won't."), "Answer"]
    tools = [function_tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}, "t")]
    interleaved = 'Look it up: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = split(
        AnswerSplitter(tokenizer, tools, calls=True, reasoning=True, prompt=opened), interleaved + " then.</think>Rain."
    )
    assert [type(p).__name__ for p in pieces] == ["Reasoning", "ToolCall", "Reasoning", "str"]
    assert (pieces[2], pieces[3]) == (Reasoning(" then."), "Rain.")


def test_the_responses_stream_keeps_its_items_in_the_order_written():
    """Text, then thinking, then text again: three items, each event at its item's index."""
    import asyncio

    from kvmesh.reuse.records import CachedPrefix
    from kvmesh.serve.apis.responses import Answer
    from kvmesh.serve.engine import Done
    from kvmesh.serve.turns import Text

    async def pieces():
        for piece in [
            Text("Hm."),
            Reasoning("think"),
            Text(""),
            Reasoning(" more"),
            Text("Rain."),
            Done("stop", 5, 4, CachedPrefix("none")),
        ]:
            yield piece

    async def run(answer: Answer) -> list[dict]:
        return [json.loads(e["data"]) for e in [e async for e in answer.events(pieces())]]

    answer = Answer({"model": "m"}, "resp_1", 0, count_tokens=lambda text: len(text.split()))
    events = asyncio.run(run(answer))
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "reasoning"), (2, "message")]
    for e in events:
        if "item_id" in e and "output_index" in e:
            assert answer.output[e["output_index"]]["id"] == e["item_id"], e
    [reasoning] = [i for i in answer.output if i["type"] == "reasoning"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think more"}]


def test_thinking_sent_back_reaches_the_template_through_every_api():
    from kvmesh.serve.apis import anthropic, openai_api, responses

    chat = openai_api.chat_turn(
        {"model": "m", "messages": [*QUESTION, {"role": "assistant", "content": "Rain.", "reasoning": "It rains."}]},
        512,
    )
    claude = anthropic.turn_of(
        {
            "model": "claude-x",
            "max_tokens": 8,
            "messages": [
                *QUESTION,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "It rains.", "signature": ""},
                        {"type": "text", "text": "Rain."},
                    ],
                },
            ],
        },
        512,
    )
    codex = responses.turn_of(
        {
            "model": "m",
            "input": [
                {"type": "message", "role": "user", "content": QUESTION[0]["content"]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "It rains."}],
                },
                {"type": "message", "role": "assistant", "content": "Rain."},
            ],
        },
        512,
    )
    for turn in (chat, claude, codex):
        assert turn.messages[-1] == {"role": "assistant", "content": "Rain.", "reasoning_content": "It rains."}


@pytest.mark.slow
def test_each_api_returns_the_thinking_apart_from_the_answer(think, think_dir, tmp_path):
    server = InProcessServer(think_dir, load_model(str(think_dir)), tmp_path / "data")
    try:
        client, claude = server.openai(), server.anthropic(timeout=600)
        model = client.models.list().data[0].id
        thought, answer = reference(think, bias=END_BIAS)
        assert thought and answer  # (the bias ends the thinking part way)
        end = think[1].convert_tokens_to_ids("</think>")

        chat = dict(model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0, logit_bias={str(end): END_BIAS})
        message = client.chat.completions.create(**chat).choices[0].message
        assert (message.model_extra["reasoning"], message.content) == (thought, answer)
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**chat, stream=True) if c.choices]
        streamed = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
        assert (streamed, "".join(d.content or "" for d in deltas)) == (thought, answer)

        # Without the bias the random model never closes its thinking: all of it is reasoning.
        thought, answer = reference(think)
        assert thought and not answer
        made = claude.messages.create(model="claude-sonnet-4-5", max_tokens=TOKENS, messages=QUESTION)
        assert [(b.type, b.thinking) for b in made.content] == [("thinking", thought)]
        with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=TOKENS, messages=QUESTION) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.thinking) for b in final.content] == [("thinking", thought)]

        response = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=TOKENS)
        [item] = [i for i in response.output if i.type == "reasoning"]
        assert [c.text for c in item.content] == [thought]
        assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
        events = list(
            client.responses.create(model=model, input=QUESTION[0]["content"], max_output_tokens=TOKENS, stream=True)
        )
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        [done] = [e for e in events if e.type == "response.completed" or e.type == "response.incomplete"]
        assert [c.text for i in done.response.output if i.type == "reasoning" for c in i.content] == [thought]

        # A thinking budget is kept: after BUDGET tokens of thinking only </think> may come, and the
        # answer follows (the random model never closes its thinking by itself).
        model_, tokenizer = think
        prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
        thinking = [r.token for r in stream_generate(model_, tokenizer, mx.array(prompt), BUDGET)]
        rest = stream_generate(model_, tokenizer, mx.array(prompt + thinking + [end]), TOKENS - BUDGET - 1)
        budgeted = (tokenizer.decode(thinking), "".join(r.text for r in rest))
        assert budgeted[1] and thought.startswith(budgeted[0]) and len(budgeted[0]) < len(thought)
        kept = claude.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=TOKENS,
            messages=QUESTION,
            thinking={"type": "enabled", "budget_tokens": BUDGET},
        )
        assert [b.type for b in kept.content] == ["thinking", "text"]
        assert (kept.content[0].thinking, kept.content[1].text) == budgeted

        # Thinking turned off, as each API says it: the template closes the thinking, all is answer.
        quiet = reference(think, thinking=False)[1]
        for off in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
            message = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=TOKENS, **off)
            assert (
                message.choices[0].message.content == quiet
                and "reasoning" not in message.choices[0].message.model_extra
            )
        disabled = claude.messages.create(
            model="claude-sonnet-4-5", max_tokens=TOKENS, messages=QUESTION, thinking={"type": "disabled"}
        )
        assert [(b.type, b.text) for b in disabled.content] == [("text", quiet)]
        effortless = client.responses.create(
            model=model, input=QUESTION[0]["content"], max_output_tokens=TOKENS, reasoning={"effort": "none"}
        )
        assert [i.type for i in effortless.output] == ["message"] and effortless.output_text == quiet
        with pytest.raises(openai.BadRequestError, match="reasoning_effort: input should be 'none', .* not 'hard'"):
            client.chat.completions.create(model=model, messages=QUESTION, reasoning_effort="hard")

        # A grammar holds the output from its first token: the template is asked not to think.
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
        structured = (
            client.chat.completions.create(
                model=model,
                messages=QUESTION,
                max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            )
            .choices[0]
            .message
        )
        jsonschema.validate(json.loads(structured.content), schema)
        assert "reasoning" not in (structured.model_extra or {})
    finally:
        server.stop()


def test_a_response_formats_calls_are_read_or_given_back(think):
    """A tokenizer with a response format of its own (mlx-lm's Muse Spark: a header state, calls
    reached from it), as mlx-lm's TokenizerWrapper carries it: its call is read when the request
    reads calls, comes back as text when it reads none, and a forced call (no format, the grammar
    writes the call first) is read too."""
    from mlx_lm.chat_templates import muse_spark
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import muse_spark as parser

    tokenizer = TokenizerWrapper(
        think[1]._tokenizer,
        tool_parser=parser.parse_tool_call,
        tool_call_start=parser.tool_call_start,
        tool_call_end=parser.tool_call_end,
        response_format=muse_spark.RESPONSE_FORMAT,
    )
    tools = [function_tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}, "t")]
    call = (
        '<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Paris'
        "</atem:parameter></atem:invoke></atem:function_calls>"
    )
    answer = "<|eom|>to=user<|message|>Rain."  # (the header, dropped, then the answer)
    read = split(AnswerSplitter(tokenizer, tools, calls=True, reasoning=True, prompt=[]), call + answer)
    assert [(c.name, json.loads(c.arguments)) for c in read if isinstance(c, ToolCall)] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert "".join(p for p in read if isinstance(p, str)) == "Rain."
    given_back = split(AnswerSplitter(tokenizer, [], calls=False, reasoning=True, prompt=[]), call + answer)
    assert "".join(p for p in given_back if isinstance(p, str)) == call + "Rain."
    forced = split(AnswerSplitter(tokenizer, tools, calls=True, reasoning=False, prompt=[]), call)
    assert [type(p).__name__ for p in forced] == ["ToolCall"]
