"""A Turn made into the engine's Job: its fit counted before it is rendered, its prompt rendered
through the chat template (or encoded raw), its grammar or thinking budget, and the splitter that
reads reasoning and calls out of its answer. Each of these runs on a parsing thread: a long prompt
takes seconds to render, a grammar a while to compile."""

from collections.abc import Callable
from typing import Any

from kvmesh.serve.answer import AnswerSplitter, starts_in_reasoning
from kvmesh.serve.api_errors import ApiError, refuse
from kvmesh.serve.engine import Job
from kvmesh.serve.grammar import GrammarError, Grammars, json_object_grammar, json_schema_grammar
from kvmesh.serve.thinking_budget import ThinkingBudget, marker_ids
from kvmesh.serve.tools import check_model_calls_tools, forced_call_grammar
from kvmesh.serve.turns import Turn

# A prompt of C characters is at least C / (TOKEN_CHARS_MARGIN x the longest token's characters)
# tokens: a byte-level vocabulary's token of k characters stands for k bytes, and a character is one
# or more; the margin covers a normalizer that composes two characters into one (NFKC).
TOKEN_CHARS_MARGIN = 2


def prompt_chars(turn: Turn) -> int:
    """Characters of `turn` that any rendering writes out: a raw prompt's, or the text of the
    messages other than the assistant's (a template may drop an earlier answer's reasoning)."""
    if turn.messages is None:
        return len(turn.prompt or "")
    return sum(
        len(m["content"]) for m in turn.messages if m.get("role") != "assistant" and isinstance(m.get("content"), str)
    )


class TurnJobs:
    """Jobs for the turns of one model: its tokenizer, its context and the server's default
    `max_tokens` (0: a request that gives no limit may generate to the end of the context)."""

    def __init__(self, tokenizer: Any, context_length: int, default_max_tokens: int):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.vocab = len(words := tokenizer.get_vocab())
        self.token_chars = max(map(len, words), default=1)  # (an added token's text counts: a prompt may hold it)
        self.grammars = Grammars(tokenizer)

    def render(self, turn: Turn, *, thinking: bool | None) -> list[int]:
        """The prompt's tokens: the chat through the template, tools and all. `thinking` sets a
        reasoning model's `enable_thinking` (as mlx-lm names it for every template); None leaves
        the template's default."""
        if turn.messages is None:
            return list(self.tokenizer.encode(turn.prompt or ""))
        extra: dict[str, Any] = dict(turn.template_kwargs)
        if turn.tools:
            extra["tools"] = [t.spec for t in turn.tools]
        if thinking is not None:
            extra["enable_thinking"] = thinking
        apply = self.tokenizer.apply_chat_template
        try:
            if turn.continues is None:
                return list(apply(turn.messages, add_generation_prompt=True, **extra))
            text = apply(turn.messages, add_generation_prompt=False, tokenize=False, **extra)
        except Exception as e:  # the template's own error, about these messages
            raise ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        return self.continued(text, turn.continues)

    def continued(self, text: str, prefill: str) -> list[int]:
        """The chat rendered up to the end of its last (assistant) message, without the end of the
        turn the template writes after it: what transformers' `continue_final_message` does."""
        at = text.rfind(prefill)
        if at < 0:
            raise ApiError(
                400,
                "the chat template does not write the last assistant message as given: it cannot be continued",
                "messages",
            )
        return list(self.tokenizer.encode(text[: at + len(prefill)], add_special_tokens=False))

    def check_fits(self, turn: Turn) -> None:
        """Refuse, before it is rendered or tokenized (30 MB took the tokenizer two minutes and 8 GB),
        a prompt that even its fewest possible tokens keep out of the context: one a character count
        allows, and one for each message (its role's marker)."""
        chars = prompt_chars(turn)
        fewest = max(chars // (TOKEN_CHARS_MARGIN * self.token_chars), len(turn.messages or ()))
        if fewest + (turn.max_tokens or 1) <= self.context_length:
            return
        what = (
            f"{chars:,} characters"
            if turn.messages is None
            else f"{len(turn.messages):,} messages, {chars:,} characters"
        )
        raise ApiError(
            400,
            f"the prompt ({what}) has at least {fewest:,} tokens, and this model's context is "
            f"{self.context_length:,}: shorten it",
            "messages" if turn.messages is not None else "prompt",
            "context_length_exceeded",
        )

    def grammar_of(self, turn: Turn) -> str | None:
        """The grammar the output is held to: a forced call's, else the response format's."""
        check_model_calls_tools(self.tokenizer, turn.tools, turn.tool_choice)
        forced = forced_call_grammar(self.tokenizer, turn.tools, turn.tool_choice)
        if forced is not None:
            return forced
        if turn.response_format.kind == "json_object":
            return json_object_grammar()
        if turn.response_format.kind == "json_schema":
            return json_schema_grammar(turn.response_format.schema or {})
        return None

    def processors_of(self, turn: Turn, tokens: list[int], grammar: Any) -> Callable[[], list[Any]] | None:
        """What makes the job's own logits processors (on the generation thread): the grammar's, or
        the thinking budget's, which keeps state of its own for each job."""
        if grammar is not None:
            return lambda: [grammar]
        if turn.thinking_budget is None or not self.tokenizer.has_thinking or turn.thinking is False:
            return None
        start, end = marker_ids(self.tokenizer)
        thinking = starts_in_reasoning(self.tokenizer, tokens)
        budget = turn.thinking_budget
        return lambda: [ThinkingBudget(budget, start_id=start, end_id=end, thinking=thinking)]

    def max_tokens_of(self, turn: Turn, prompt_tokens: int) -> int:
        """What the answer may take: the request's limit, else the server's default or the context
        the prompt leaves; refused when the prompt and it do not fit."""
        room = self.context_length - prompt_tokens
        default = self.default_max_tokens
        max_tokens = turn.max_tokens or (min(default, room) if default else room)
        if max_tokens < 1 or prompt_tokens + max_tokens > self.context_length:
            raise ApiError(
                400,
                f"the prompt has {prompt_tokens} tokens"
                + (f" and {max_tokens} more were asked for" if max_tokens > 0 else ", which leave no room to answer")
                + f"; this model's context is {self.context_length}",
                "messages",
                "context_length_exceeded",
            )
        return max_tokens

    def job_of(self, turn: Turn) -> tuple[Job, AnswerSplitter]:
        """The engine's job for `turn`, and the splitter that reads its reasoning and calls."""
        try:
            grammar = self.grammar_of(turn)
            processor = self.grammars.processor(grammar) if grammar is not None else None
        except GrammarError as e:
            param = "tools" if turn.tool_choice.forced else "response_format"
            raise refuse(f"the grammar cannot be made: {e}", param) from None
        # A grammar holds the output from its first token: there is no thinking to hold it to.
        tokens = self.render(turn, thinking=turn.thinking if grammar is None else False)
        max_tokens = self.max_tokens_of(turn, len(tokens))
        if not tokens:
            raise ApiError(400, "the prompt is empty", "prompt", "invalid_value")
        job = Job(
            tokens,
            max_tokens,
            turn.sampling,
            turn.stop,
            partition=turn.partition,
            processors=self.processors_of(turn, tokens, processor),
            top_logprobs=turn.top_logprobs,
        )
        # A raw completion's text comes back as written, and so does JSON a response format holds
        # to (a string in it may hold any marker); a forced call is read as a call, with no thinking.
        free = grammar is None
        splitter = AnswerSplitter(
            self.tokenizer,
            turn.tools,
            calls=turn.tool_choice.mode != "none" and (free or turn.tool_choice.forced),
            reasoning=turn.messages is not None and free,
            prompt=tokens,
        )
        return job, splitter
