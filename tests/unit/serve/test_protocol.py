"""The request models of serve's APIs (kvmesh.serve.protocol): each wrong field refused by name in one
line, every unknown key kept to be named as ignored, and the bounds on counts held, for bodies shaped
as the official clients and the tools people run send them."""

import pytest

from kvmesh.serve.api_errors import ApiError
from kvmesh.serve.protocol.anthropic import MessagesRequest
from kvmesh.serve.protocol.base import MAX_TOOLS, parse
from kvmesh.serve.protocol.openai import ChatCompletionRequest, CompletionRequest
from kvmesh.serve.protocol.responses import ResponsesRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CLAUDE = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
CODEX = {"model": "m", "input": "hi"}


def refused(model, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(model, body)
    assert e.value.status == 400
    return e.value


def test_a_chat_body_as_the_openai_client_sends_it_is_typed_and_its_unknown_keys_kept():
    body = {
        **CHAT,
        "temperature": 1,  # (an integer is a number)
        "stop": "END",
        "max_completion_tokens": 16,
        "max_tokens": 99,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "someone",
        "store": False,
        "metadata": {"k": "v"},
    }
    request = parse(ChatCompletionRequest, body)
    assert (request.temperature, request.stop, request.limit) == (1.0, ["END"], 16)
    assert request.stream_options is not None and request.stream_options.include_usage
    assert request.unknown() == ["metadata", "store", "user"]


TYPE, VALUE = "invalid_type", "invalid_value"


@pytest.mark.parametrize(
    "body, message, code",
    [
        ({"temperature": 2.5}, "temperature: input should be less than or equal to 2, not 2.5", VALUE),
        ({"temperature": "0.5"}, "temperature: input should be a valid number, not '0.5'", TYPE),
        ({"max_tokens": True}, "max_tokens: input should be a valid integer, not True", TYPE),
        ({"max_tokens": 0}, "max_tokens: input should be greater than or equal to 1, not 0", VALUE),
        ({"seed": -1}, "seed: input should be greater than or equal to 0, not -1", VALUE),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop: at most 4 items, not 5", VALUE),
        ({"stop": [""]}, "stop.0: string should have at least 1 character, not ''", VALUE),
        ({"stream": "yes"}, "stream: input should be a valid boolean, not 'yes'", TYPE),
        ({"stream_options": {"include_usage": True, "other": 1}}, None, TYPE),
        ({"messages": []}, "messages: at least 1 item(s), not 0", VALUE),
        ({"tools": [{"type": "function"}] * (MAX_TOOLS + 1)}, f"tools: at most {MAX_TOOLS} items, not 513", VALUE),
        ({"logit_bias": {"5": 101}}, None, VALUE),
        ({"reasoning_effort": "hard"}, None, VALUE),
    ],
)
def test_a_wrong_chat_field_is_refused_by_name_in_one_line(body, message, code):
    e = refused(ChatCompletionRequest, {**CHAT, **body})
    assert (e.param, e.code) == (next(iter(body)), code), e.message
    assert "\n" not in e.message and (message is None or e.message == message)


def test_completions_take_one_prompt():
    assert parse(CompletionRequest, {"model": "m", "prompt": ["once"]}).prompt == ["once"]
    assert refused(CompletionRequest, {"model": "m", "prompt": ["one", "two"]}).param == "prompt"
    assert refused(CompletionRequest, {"model": "m"}).message == "prompt: field required"


def test_a_messages_body_as_claude_code_sends_it():
    body = {
        **CLAUDE,
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "summarized"},
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u"},
        "context_management": {"edits": []},
    }
    request = parse(MessagesRequest, body)
    assert request.thinking is not None and request.thinking.budget_tokens == 1024
    assert request.thinking.unknown() == ["display"]
    assert request.unknown() == ["context_management", "metadata"]
    assert refused(MessagesRequest, {**CLAUDE, "temperature": 1.5}).param == "temperature"  # (Anthropic's goes to 1)
    assert refused(MessagesRequest, {k: v for k, v in CLAUDE.items() if k != "max_tokens"}).param == "max_tokens"
    assert refused(MessagesRequest, {**CLAUDE, "thinking": {"type": "on"}}).param == "thinking"
    assert refused(MessagesRequest, {**CLAUDE, "tool_choice": {"type": "sometimes"}}).param == "tool_choice"


def test_a_responses_body_as_codex_sends_it():
    body = {
        **CODEX,
        "instructions": "you are a coding agent",
        "reasoning": {"effort": "none", "summary": "auto"},
        "text": {"verbosity": "low"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc",
    }
    request = parse(ResponsesRequest, body)
    assert request.reasoning is not None and request.reasoning.unknown() == ["summary"]
    assert request.text is not None and request.text.unknown() == ["verbosity"]
    assert request.unknown() == ["include", "prompt_cache_key", "store"]
    assert refused(ResponsesRequest, {**CODEX, "input": []}).param == "input"
    assert refused(ResponsesRequest, {**CODEX, "max_output_tokens": 1.5}).param == "max_output_tokens"
