"""A prompt's tokens, built so that a document's cache is a prefix of every prompt that starts with it.

The mesh only shares prefixes, so how a document and a question become tokens decides whether a
cache made from the document alone (by `kvmesh prefill`, or by `mlx_lm.cache_prompt`) serves the
question's prompt.
"""

from typing import Any

from kvmesh.errors import KvmeshError


def cache_prompt_tokens(tokenizer: Any, prompt: str) -> list[int]:
    """The tokens `mlx_lm.cache_prompt` feeds for `prompt` (its own rule, repeated here)."""
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=False, continue_final_message=True
        )
    return tokenizer.encode(prompt)


def prompt_tokens(tokenizer: Any, file_text: str, prompt: str, *, chat: bool = False) -> list[int]:
    """The tokens of the file then the prompt, built so that those of the file alone are a prefix.

    Plain: the file's tokens (with BOS), then the prompt's. With `chat`, one user message holding
    file and prompt in the model's chat template, the file's part tokenized exactly as
    `mlx_lm.cache_prompt` does, so its caches (via `cache import-mlx`) serve as prefixes too.
    """
    if not chat:
        tokens = tokenizer.encode(file_text) if file_text else []
        if prompt:
            tokens += tokenizer.encode(prompt, add_special_tokens=not tokens)
        return tokens
    if not tokenizer.has_chat_template:
        raise KvmeshError("this model has no chat template: drop --chat")
    if not prompt:
        return cache_prompt_tokens(tokenizer, file_text)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": file_text + prompt}], tokenize=False, add_generation_prompt=True
    )
    if not file_text:
        return tokenizer.encode(full, add_special_tokens=False)
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": file_text}], tokenize=False, continue_final_message=True
    )
    if not full.startswith(head):
        raise KvmeshError("this chat template does not put the file before the prompt: drop --chat")
    return cache_prompt_tokens(tokenizer, file_text) + tokenizer.encode(full[len(head) :], add_special_tokens=False)
