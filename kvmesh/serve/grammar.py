"""Constrained decoding: a request's output held to a grammar, with llguidance.

Used for `response_format` (a JSON schema, or any JSON object) and for a tool call that a request
forces (`tool_choice` "required" or naming a function): servers with structured output (oMLX,
Ollama, vLLM) do the same, and a model with random weights, as the tests use, calls a tool only so.

Why llguidance (guidance-ai's Rust library): it has no Python dependencies, takes JSON schemas and
Lark grammars that embed them (`%json {...}`: a tool call is literal text around its arguments'
schema), and computes each step's mask in microseconds. Its masks are numpy bitmasks; they are
applied here with `mx.where`, so the same code runs on a Mac's GPU and on Linux's CPU MLX (the
Metal kernel of `llguidance.mlx` runs only on the first). xgrammar needs torch, outlines-core
gives regular expressions only.

JSON is held to `json.dumps`' own spacing (", " and ": ", nothing else), which is also what chat
templates' `tojson` writes when the call comes back in the history: the next turn's prompt then
repeats the generated call token for token, and its cache is found.
"""

import json
import threading
from typing import Any, cast

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from kvmesh.compat import mlx_lm as compat
from kvmesh.errors import KvmeshError

# JSON as json.dumps writes it (no free whitespace: a random model would pad with it forever).
JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(KvmeshError):
    """A schema or grammar llguidance refuses (the request's fault)."""


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON documents valid under `schema`."""
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spaced(schema)))


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's `json_object` response format)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(calls: list[tuple[str, dict]], start: str, end: str) -> str:
    """The grammar of one call to one of `calls` ((name, parameters' schema)), written as the json_tools
    family (Qwen 2.5 and 3, Hermes) writes it: `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`.
    `start` and `end` are the tokenizer's own markers (mlx-lm's `tool_call_start`/`tool_call_end`)."""
    rules, names = [], []
    for i, (name, parameters) in enumerate(calls):
        head = f"{start}\n" + '{"name": ' + json.dumps(name) + ', "arguments": '
        rules.append(f"call{i}: {lark_string(head)} args{i} {lark_string('}' + chr(10) + end)}")
        rules.append(f"args{i}: %json {json.dumps(spaced(parameters))}")
        names.append(f"call{i}")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(names) + "\n" + "\n".join(rules))


def lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def spaced(schema: dict) -> dict:
    """`schema` with llguidance's JSON options set to JSON_SPACING."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return {**schema, "x-guidance": {**JSON_SPACING, **schema.get("x-guidance", {})}}


class Grammars:
    """llguidance's view of one tokenizer (made once: for a large vocabulary it takes a second),
    and the matchers of requests' grammars over it."""

    def __init__(self, tokenizer: Any):
        """`tokenizer`: mlx-lm's TokenizerWrapper (llguidance reads the Hugging Face one inside)."""
        self._hf, self._eos = compat.hf_tokenizer(tokenizer), list(tokenizer.eos_token_ids)
        self._ll: Any = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos)
            return self._ll

    def processor(self, grammar: str) -> "GrammarProcessor":
        """A processor at the start of `grammar`; GrammarError when llguidance refuses it."""
        tokenizer = self.tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarProcessor(matcher, tokenizer.vocab_size)


class GrammarProcessor:
    """A logits processor (mlx-lm's `logits_processors`) that allows only the tokens `matcher`
    accepts next, and the end of the turn once the grammar is complete. Tokens of the model's
    logits beyond the tokenizer's vocabulary (padding rows) are never allowed.

    mlx-lm calls it with the tokens so far: first the prompt's (those prefilled now), then one more
    for each token sampled; each new token is fed to the matcher before the next mask is made.
    Where the grammar fixes the text ahead (a call's `{"name": ...`), only the first of llguidance's
    tokens for it is allowed: the text is then tokenized as the tokenizer would (as the template's
    rendering of it in the next turn is), not spelled out in whatever pieces a model prefers.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._seen: int | None = None
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._seen is not None:
            for token in cast(list[int], tokens[self._seen :].tolist()):
                self.matcher.consume_token(token)  # a token the mask allowed: never refused
        self._seen = len(tokens)
        if self.matcher.is_error():  # (cannot happen with the mask applied; end the turn rather than loop)
            return logits
        allowed = np.zeros(logits.shape[-1], dtype=np.bool_)
        forced = self.matcher.compute_ff_tokens()
        if forced:  # text the grammar fixes: its own (canonical) tokens, as the template's would be
            allowed[forced[0]] = True
        else:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
            bits = bits[: min(self.vocab_size, len(allowed))]
            allowed[: len(bits)] = bits
        return mx.where(mx.array(allowed), logits, -mx.inf)
