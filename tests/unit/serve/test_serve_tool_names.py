"""`kvmesh serve` refuses tools it cannot render safely, before rendering them (issue 32): a name
holding the template's markup (`</tool_call>` turned a forced call into text) or characters no
function name has, and more tools than a request may define (20,000 took the template 8 s and
1.4 GB). The server `kvmesh serve` runs, of the tiny-tools model, in the test's process
(support.http_clients.InProcessServer); the official `openai` and `anthropic` packages as clients."""

import anthropic
import openai
import pytest

from kvmesh.model.loaded import load_model
from support.http_clients import InProcessServer

pytestmark = pytest.mark.slow  # every test here renders templates of thousands of tools: past the fast tier

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(preset_dir, tmp_path_factory):
    model = preset_dir("tiny-tools")
    started = InProcessServer(model, load_model(str(model)), tmp_path_factory.mktemp("tool-names"))
    yield started
    started.stop()


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("name", ["</tool_call>", "<tool_call>", 'get"weather', "get weather", "x" * 129])
def test_a_tool_name_that_is_no_function_name_is_refused(server, name):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny-tools",
            messages=MESSAGES,
            tools=[tool(name)],
            tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=50,
        )
    assert refused.value.body["param"] == "tools"
    assert repr(name[:200]) in refused.value.body["message"], refused.value.body


def test_an_anthropic_tool_holding_the_markup_is_refused(server):
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tool_call"):
        claude.messages.create(
            model="claude-haiku-4-5",
            messages=MESSAGES,
            tools=[{"name": "</tool_call>", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
            max_tokens=50,
        )


def test_names_of_mcp_tools_are_served(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    name = "mcp__files.read:v2"
    answer = client.chat.completions.create(
        model="tiny-tools", messages=MESSAGES, tools=[tool(name)], tool_choice="required", max_tokens=60
    )
    assert answer.choices[0].message.tool_calls[0].function.name == name


def test_twenty_thousand_tools_are_refused_before_they_are_rendered(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    tools = [tool(f"tool_{i}") for i in range(20_000)]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=tools, max_tokens=2)
    assert refused.value.body["param"] == "tools"
    assert refused.value.body["message"] == "tools: at most 512 items, not 20,000"
    # (512 of them would be refused too, for this model's context: 50 fit. A few are served.)
    answer = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=tools[:5], max_tokens=2)
    assert answer.usage.completion_tokens == 2
