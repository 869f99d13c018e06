"""A reasoning model's thinking held to a budget of tokens (Anthropic's `thinking.budget_tokens`).

A logits processor, as mlx-lm calls them: it follows the thinking markers in the tokens as they are
generated, and once the thinking has taken its budget, lets only the end-of-thinking token through,
so the model goes on to its answer (the way vLLM's and llama.cpp's servers keep a budget). It keeps
state from call to call, so each job makes its own (`Job.processors`, on the generation thread).
"""

from typing import Any, cast

import mlx.core as mx

from kvmesh.serve.api_errors import refuse


def marker_ids(tokenizer: Any) -> tuple[int, int]:
    """The tokens that open and close the thinking, or a 400 when the model has no single-token
    markers (then no budget can be kept, and a request that sets one is refused, not cut wrongly)."""
    try:
        start, end = tokenizer.think_start_id, tokenizer.think_end_id
    except ValueError:  # (mlx-lm: a marker of several tokens)
        start = end = None
    if start is None or end is None:
        raise refuse(
            "this model's thinking markers are not single tokens, so a thinking budget cannot be kept: "
            "leave out budget_tokens",
            "thinking",
            "unsupported_value",
        )
    return start, end


class ThinkingBudget:
    """Ends the thinking after `budget` tokens of it. `thinking`: whether the prompt left the model
    thinking (its template opened the thinking)."""

    def __init__(self, budget: int, *, start_id: int, end_id: int, thinking: bool):
        self.budget, self.start_id, self.end_id = budget, start_id, end_id
        self.thinking = thinking
        self.spent = 0
        self.calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Each call's last token is the one generated before it (on the first call, the prompt's last).
        if self.calls:
            last = cast(int, tokens[-1].item())
            if last == self.start_id:
                self.thinking, self.spent = True, 0
            elif last == self.end_id:
                self.thinking = False
            elif self.thinking:
                self.spent += 1
        self.calls += 1
        if not self.thinking or self.spent < self.budget:
            return logits
        only_end = mx.arange(logits.shape[-1]) == self.end_id
        return mx.where(only_end, logits, mx.array(-float("inf"), dtype=logits.dtype))
