"""The model's text, as it streams, split into what each API returns apart: reasoning, the answer's
text, and tool calls.

mlx-lm's TextStateMachine finds the markers in the text (a marker split across tokens, or merged
with the next byte, is found all the same), with the transitions mlx-lm's own server uses
(`make_text_state_machine`; `transitions` says where they differ): a reasoning model's thinking
between the tokenizer's `think_start` and `think_end` (mlx-lm reads them from the vocabulary), a
call between `tool_call_start` and `tool_call_end`, read by the tokenizer's `tool_parser`. A
prompt that ends inside `think_start` (the template opened the thinking, as DeepSeek R1's and
Qwen3's thinking models' do) starts in reasoning, as mlx-lm's server decides it.
"""

from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine

from kvmesh.serve.tools import Tool, ToolCall, parse_calls, partial_call


@dataclass(frozen=True)
class Reasoning:
    """Text the model wrote thinking, before its answer (a reasoning model's)."""

    text: str


Piece = str | Reasoning | ToolCall


def starts_in_reasoning(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the prompt leaves the model thinking: its last `think_start` has no `think_end` after it."""
    if not tokenizer.has_thinking:
        return False
    start, end = tokenizer.rfind_think_start(prompt), tokenizer.rfind_think_end(prompt)
    return (start if start is not None else -1) > (end if end is not None else -1)


# A call the model makes inside its thinking (interleaved thinking) is read in a state of its own, so
# that the thinking goes on after it (mlx-lm's machine goes back to the answer after any call).
TOOL_STATES = {"tool": "normal", "reasoning_tool": "reasoning"}


def transitions(tokenizer: Any, *, reasoning: bool, calls: bool) -> dict[str, list[tuple[str, str]]]:
    """The markers to follow, as mlx-lm's server's `make_text_state_machine` has them (thinking,
    tool calls, a model's response format and structural markers), but: the answer's own tool
    markers only when the request reads calls (otherwise markup stays text, where it is); a call
    made inside the thinking back into the thinking (TOOL_STATES); and without `reasoning` (a
    forced call's grammar, which writes the call first) no response format, only the call."""
    edges: dict[str, list[tuple[str, str]]] = {}
    if reasoning and tokenizer.has_thinking:
        edges["normal"] = [(tokenizer.think_start, "reasoning")]
        edges["reasoning"] = [(tokenizer.think_end, "normal")]
    if reasoning:
        for marker in tokenizer.structural_markers:
            edges.setdefault("normal", []).append((marker, "normal"))
        for state, found in tokenizer.response_transitions.items():
            edges.setdefault(state, []).extend(found)
    if tokenizer.has_tool_calling:
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        # A response format that reaches "tool" says itself where calls start (and reaches it
        # whether or not this request reads calls: what it writes there then comes back as text).
        formatted = any(dst == "tool" for found in edges.values() for _, dst in found)
        if calls and not formatted:
            edges.setdefault("normal", []).append((start, "tool"))
            if "reasoning" in edges:
                edges["reasoning"].append((start, "reasoning_tool"))
                edges["reasoning_tool"] = [(end, "reasoning")] if end else []
        if calls or formatted:
            edges["tool"] = [(end, "normal")] if end else []
    return edges


class AnswerSplitter:
    """Splits the model's text as it streams into reasoning, plain text and tool calls (see
    `transitions`; text of other states, a response format's headers, is dropped as mlx-lm drops
    it). A call that max_tokens cut comes back as a call that is not complete (its name and
    arguments so far, as the official APIs return one), or as nothing when not even its name was
    written: never as the template's markup. A complete call that does not parse, or markup in a
    request that reads no calls, comes back as the text it was, where it was. With neither `reasoning`
    nor `calls` (a raw completion, a JSON response format) the text comes back as written."""

    def __init__(self, tokenizer: Any, tools: list[Tool], *, calls: bool, reasoning: bool, prompt: list[int]):
        self._tokenizer, self._tools = tokenizer, [t.spec for t in tools]
        self._read_calls = calls and bool(tools)
        edges = transitions(tokenizer, reasoning=reasoning, calls=self._read_calls)
        self._machine = TextStateMachine(edges) if edges else None
        initial = "normal"
        if reasoning:
            initial = tokenizer.response_initial_state or (
                "reasoning" if starts_in_reasoning(tokenizer, prompt) else "normal"
            )
        if self._machine is not None:
            self._state = self._machine.make_state(initial)
        self._previous = initial
        self._call = ""
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        """The pieces that `text` completes (text that may begin a marker is held back)."""
        if self._machine is None:
            return [text] if text else []
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._read(segments)

    def finish(self) -> list[Piece]:
        """What was held back: a marker's beginning as text, an open call parsed (or as text)."""
        if self._machine is None:
            return []
        self._state, rest, state = TextStateMachine.flush(self._state)
        out = self._read([(state, rest)])
        if self._previous in TOOL_STATES:
            out += self._close(self._previous, complete=False)
        return out

    def _read(self, segments: list[tuple[str | None, str]]) -> list[Piece]:
        out: list[Piece] = []
        for state, text in segments:
            if state in TOOL_STATES:
                self._call += text
            else:
                if self._previous in TOOL_STATES:
                    out += self._close(self._previous, complete=True)
                if text and state == "reasoning":
                    out.append(Reasoning(text))
                elif text and state in ("normal", None):
                    out.append(text)
            self._previous = state or "normal"
        return out

    def _close(self, state: str, complete: bool) -> list[Piece]:
        """The call read in `state`, or its markup as the text it was (in the thinking, when it was
        made there)."""
        text, self._call = self._call, ""
        calls = parse_calls(self._tokenizer, text, self._tools) if self._read_calls else None
        if calls is None and self._read_calls and not complete:
            cut = partial_call(text, self._tools)
            calls = [cut] if cut is not None else []
        if calls is None:
            end = self._tokenizer.tool_call_end if complete else ""
            markup = f"{self._tokenizer.tool_call_start}{text}{end or ''}"
            return [Reasoning(markup) if TOOL_STATES[state] == "reasoning" else markup]
        self.calls += len(calls)
        return list(calls)
