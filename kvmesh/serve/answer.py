"""The model's text, as it streams, split into what each API returns apart: reasoning, the answer's
text, and tool calls.

mlx-lm's TextStateMachine finds the markers in the text (a marker split across tokens, or merged
with the next byte, is found all the same), with the transitions mlx-lm's own server uses
(`make_text_state_machine`): a reasoning model's thinking between the tokenizer's `think_start`
and `think_end` (mlx-lm reads them from the vocabulary), a call between `tool_call_start` and
`tool_call_end`, read by the tokenizer's `tool_parser`. A prompt that ends inside `think_start` (the template opened the
thinking, as DeepSeek R1's and Qwen3's thinking models' do) starts in reasoning, as mlx-lm's server
decides it.
"""

from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from kvmesh.serve.tools import Tool, ToolCall, parse_calls


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


class AnswerSplitter:
    """Splits the model's text as it streams into reasoning, plain text and tool calls, with the
    state machine mlx-lm's server builds for the tokenizer (`make_text_state_machine`: its thinking
    and tool-call markers, and the response formats and structural markers some models have; text
    of other states, a format's headers, is dropped as mlx-lm drops it). A call that does not parse
    (cut short by max_tokens), or one in a request that reads no calls (no tools, tool_choice
    "none"), comes back as the text it was, so nothing is lost. `reasoning` False (a raw
    completion) returns the text as written."""

    def __init__(self, tokenizer: Any, tools: list[Tool], *, calls: bool, reasoning: bool, prompt: list[int]):
        self._tokenizer, self._tools = tokenizer, [t.spec for t in tools]
        self._read_calls = calls and bool(tools)
        self._machine = make_text_state_machine(tokenizer) if reasoning else None
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
        if self._previous == "tool":
            out += self._close(complete=False)
        return out

    def _read(self, segments: list[tuple[str | None, str]]) -> list[Piece]:
        out: list[Piece] = []
        for state, text in segments:
            if state == "tool":
                self._call += text
            else:
                if self._previous == "tool":
                    out += self._close(complete=True)
                if text and state == "reasoning":
                    out.append(Reasoning(text))
                elif text and state in ("normal", None):
                    out.append(text)
            self._previous = state or "normal"
        return out

    def _close(self, complete: bool) -> list[Piece]:
        text, self._call = self._call, ""
        calls = parse_calls(self._tokenizer, text, self._tools) if self._read_calls else None
        if calls is None:
            end = self._tokenizer.tool_call_end if complete else ""
            return [f"{self._tokenizer.tool_call_start}{text}{end or ''}"]
        self.calls += len(calls)
        return list(calls)
