"""Tool calls: the tools a request defines, the choice it makes, the history it sends back, and the
calls the model makes, read with mlx-lm's own parsers.

mlx-lm's TokenizerWrapper picks a parser from the chat template (`tool_parser`, with the markers
`tool_call_start`/`tool_call_end`); its TextStateMachine finds those markers in the text as it
streams (kvmesh.serve.answer). Both are used as they are: kvmesh writes no parser of its own. What is kvmesh's: the API
shapes (OpenAI's `tools`/`tool_choice`, each call's id), and the grammar that forces a call when a
request asks for one (kvmesh.serve.grammar), for the json_tools format that Qwen 2.5 and 3 and
Hermes models share.

The history goes back through the template as mlx-lm's server sends it (`process_message_content`:
text parts joined, `content: null` as "", arguments as objects for the templates' `tojson`), so a
call the model made renders as the model wrote it and the next prompt extends the last one.
"""

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.server import process_message_content

from kvmesh.serve.api_errors import refuse
from kvmesh.serve.grammar import tool_call_grammar

# A tool's name: OpenAI's pattern (^[a-zA-Z0-9_-]{1,64}$), with the dots and colons of some MCP
# servers' names and Anthropic's 128 characters. A name is written into the prompt and read back
# from the model's call: one holding a template's markup (`</tool_call>`) would end the call there.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# The parser whose call format the forcing grammar writes (mlx_lm.tool_parsers.json_tools).
FORCEABLE_PARSERS = ("mlx_lm.tool_parsers.json_tools",)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name and its parameters' JSON schema; `spec` is the
    definition as the chat template takes it (OpenAI's shape, which templates are written for)."""

    name: str
    parameters: dict
    spec: dict


@dataclass(frozen=True)
class ToolChoice:
    """How the model may call tools: "auto" (it decides), "none" (calls are not read), "required"
    (one call, to any tool) or "function" (one call, to `name`); the last two forced by a grammar."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is JSON text, as OpenAI sends it; `id` is bare hex, each
    API prefixes it in its own way (call_, toolu_). A call cut short by max_tokens is not
    `complete`: its arguments are what was written of them, as the official APIs return such a call."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    complete: bool = True


def cut_short(calls: list[ToolCall]) -> bool:
    """Whether the answer ends in a call that max_tokens cut: each API then says its answer was cut."""
    return any(not c.complete for c in calls)


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> Tool:
    """A Tool from its parts, checked."""
    if not isinstance(name, str) or not name:
        raise refuse("a tool needs a name (a non-empty string)", param, "invalid_type")
    if not TOOL_NAME.fullmatch(name):
        raise refuse(
            f"the tool name {name[:200]!r} is not a function name: up to 128 letters, digits, '_', '-', '.' or ':'",
            param,
        )
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise refuse(f"the parameters of tool {name!r} must be a JSON schema object", param, "invalid_type")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    return Tool(name, parameters, {"type": "function", "function": function})


def openai_tools(value: list[dict] | None, param: str = "tools") -> list[Tool]:
    """Chat completions' `tools`: `[{"type": "function", "function": {"name", "description", "parameters"}}]`."""
    tools = []
    for tool in value or []:
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise refuse(f"only function tools are served, not {tool.get('type')!r}", param, "unsupported_value")
        f = tool["function"]
        made = function_tool(f.get("name"), f.get("description"), f.get("parameters"), param)
        tools.append(Tool(made.name, made.parameters, tool))  # rendered as the client sent it
    return unique(tools, param)


def unique(tools: list[Tool], param: str) -> list[Tool]:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise refuse("tool names must be distinct", param)
    return tools


def openai_tool_choice(value: Any, tools: list[Tool], param: str = "tool_choice") -> ToolChoice:
    """Chat completions' `tool_choice`: "auto", "none", "required" or `{"type": "function",
    "function": {"name": ...}}` (the Responses API's `{"type": "function", "name": ...}` too)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise refuse(f'tool_choice must be "auto", "none", "required" or a function, not {value!r}', param)
        return checked(ToolChoice(value), tools, param)
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name") if "function" in value else value.get("name")
        return checked(ToolChoice("function", name), tools, param)
    raise refuse('tool_choice must be "auto", "none", "required" or {"type": "function", ...}', param)


def checked(choice: ToolChoice, tools: list[Tool], param: str) -> ToolChoice:
    """`choice`, refused when it asks for a call that `tools` cannot give."""
    if choice.forced and not tools:
        raise refuse(f"tool_choice {choice.mode!r} needs tools", param)
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise refuse(f"tool_choice names {choice.name!r}, which is not among the tools", param)
    return choice


def check_model_calls_tools(tokenizer: Any, tools: list[Tool], choice: ToolChoice, param: str = "tools") -> None:
    """Tools need a chat template with a tool-call format mlx-lm reads; a forced call needs one
    whose format the grammar writes. Otherwise the request is refused rather than its tools ignored."""
    if not tools or choice.mode == "none":
        return
    if not tokenizer.has_tool_calling:
        raise refuse(
            "this model's chat template has no tool-call format that mlx-lm reads, so tools cannot be served",
            param,
            "unsupported_value",
        )
    if choice.forced and tokenizer.tool_parser.__module__ not in FORCEABLE_PARSERS:
        raise refuse(
            f"a forced call (tool_choice {choice.mode!r}) is written by a grammar for the <tool_call> JSON "
            f"format (Qwen 2.5/3, Hermes); this model's parser is {tokenizer.tool_parser.__module__}: use "
            '"auto"',
            "tool_choice",
            "unsupported_value",
        )


def forced_call_grammar(tokenizer: Any, tools: list[Tool], choice: ToolChoice) -> str | None:
    """The grammar of the one call `choice` forces, or None when it forces none."""
    if not choice.forced:
        return None
    allowed = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    return tool_call_grammar(
        [(t.name, t.parameters) for t in allowed], tokenizer.tool_call_start, tokenizer.tool_call_end
    )


def template_messages(messages: Any, param: str = "messages") -> list[dict]:
    """Chat messages as the template takes them (a copy): the `developer` role as `system` (OpenAI's
    newer name for it), an assistant's `reasoning` as `reasoning_content`, content parts joined into
    text, `content: null` as "", and tool calls' arguments as objects (mlx-lm's
    `process_message_content`)."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise refuse("messages must be a non-empty list of objects", param)
    messages = copy.deepcopy(messages)
    for message in messages:
        if not isinstance(message.get("role"), str):
            raise refuse("each message needs a role", param, "invalid_type")
        if message["role"] == "developer":
            message["role"] = "system"
        if message["role"] == "assistant" and "reasoning" in message and "reasoning_content" not in message:
            # The reasoning this server returns, under the name templates read (Qwen3's, DeepSeek's).
            message["reasoning_content"] = message.pop("reasoning")
        content = message.get("content")
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise refuse('content parts must be text ({"type": "text", "text": ...}); images are not served', param)
        if content is not None and not isinstance(content, (str, list)):
            raise refuse("content must be a string, a list of parts, or null", param, "invalid_type")
        for call in message.get("tool_calls") or []:
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                raise refuse('each tool call must be {"id", "type": "function", "function": {...}}', param)
    try:
        process_message_content(messages)
    except (ValueError, KeyError, TypeError) as e:  # JSON arguments that do not parse, parts without text
        raise refuse(f"the messages cannot be read: {e}", param) from None
    return messages


def parse_calls(tokenizer: Any, text: str, tools: list[dict]) -> list[ToolCall] | None:
    """The calls in one call's text, read by the tokenizer's mlx-lm parser; None when it fails."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
    except Exception:  # each parser fails in its own way (JSON, regular expressions, missing keys)
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(call["name"], arguments))
    return calls


# A JSON call's name, and where its arguments begin (json_tools' "arguments", some templates' "parameters").
CALL_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
CALL_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def partial_call(text: str, tools: list[dict]) -> ToolCall | None:
    """The call that `text` began before max_tokens cut it: its name, and its arguments as far as
    they were written. Read only where the call is JSON that names one of `tools` (the json_tools
    format and its kin); None otherwise, when nothing of a call can be told."""
    name = CALL_NAME.search(text)
    if name is None:
        return None
    try:
        called = json.loads(f'"{name.group(1)}"')
    except ValueError:
        return None
    if called not in {t["function"]["name"] for t in tools}:
        return None
    arguments = CALL_ARGUMENTS.search(text, name.end())
    return ToolCall(called, text[arguments.end() :].rstrip() if arguments else "", complete=False)
