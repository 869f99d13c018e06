"""What a compressed cache is probed with on the real model (scripts/bench_quality.py and
scripts/bench_transform.py): texts with facts placed at depths, questions about them, teacher-forced
continuations, and greedy answers, each probe taken back from the cache after it ran.

The query-agnostic setting of the mesh: a cache is made from a context alone and probed afterwards
with what nobody knew when it was compressed.
"""

from importlib import resources
from pathlib import Path

import mlx.core as mx

from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.model.prompt import prompt_tokens

DECLARATION = Path(__file__).resolve().parents[2] / "scripts" / "data" / "declaration.txt"
# (thing, value): "The {thing} is {value}." placed in the context, "What is the {thing}?" asked after.
FACTS = [
    ("code of the blue locker", "4817"),
    ("name of the ship's cat", "Pepper"),
    ("city where the archive is kept", "Valparaiso"),
    ("colour of the third door", "orange"),
    ("password for the garden shed", "marigold"),
]
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
QUESTIONS = {
    "declaration": [
        ("Which three unalienable rights does the text name?", "liberty"),
        ("Which king does the text accuse?", "britain"),
        ("From whom do governments derive their just powers, according to the text?", "consent"),
    ],
    "notes": [
        ("What began to sing just as the rain started?", "kettle"),
        ("What is the store of keys and values called?", "cache"),
    ],
    "code": [
        ("Which class in the code wraps text?", "textwrapper"),
        ("What is the default width, in the code?", "70"),
    ],
}
CONTINUATION = 96  # tokens of true text teacher-forced after the context


CODE_WORDS = 1000


def code_text() -> str:
    """Python source, as a coding agent's context holds it: the start of the standard library's
    textwrap.py (about CODE_WORDS words, whole lines), none of it in the codec's calibration texts."""
    import textwrap

    lines, words = [], 0
    for line in Path(textwrap.__file__).read_text().splitlines():
        words += len(line.split())
        if words > CODE_WORDS:
            break
        lines.append(line)
    return "\n".join(lines)


def load_texts() -> dict[str, str]:
    return {
        "declaration": DECLARATION.read_text(),
        "notes": resources.files("kvmesh").joinpath("data/corpus.txt").read_text(),
        "code": code_text(),
    }


def with_facts(text: str) -> str:
    """The text with one fact per depth, each placed at a paragraph or sentence boundary."""
    sentences = text.replace("\n\n", "\n\n ").split(". ")
    out = list(sentences)
    for (thing, value), depth in sorted(zip(FACTS, DEPTHS, strict=True), key=lambda f: -f[1]):
        at = round(depth * (len(sentences) - 1))
        out.insert(at + (1 if depth == 1.0 else 0), f"The {thing} is {value}")
    return ". ".join(out)


def fp16_bytes(cache) -> int:
    """Bytes of the cache were its floats fp16 (the model runs in fp32 here; a Mac runs fp16)."""
    total = 0
    for layer in cache:
        keys, values = layer.keys_and_values()
        if isinstance(layer, SparseQuantizedKVCache):
            for packed, scales, biases in (keys, values):
                total += packed.nbytes + (scales.nbytes + biases.nbytes) // scales.itemsize * 2
        else:
            total += (keys.nbytes + values.nbytes) // keys.itemsize * 2
    return total


def after(tokenizer, context_text: str, question: str) -> list[int]:
    """The tokens a question adds after the cached context (chat template: the user turn ends, the
    assistant's begins)."""
    context = prompt_tokens(tokenizer, context_text, "", chat=True)
    return prompt_tokens(tokenizer, context_text, "\n\n" + question, chat=True)[len(context) :]


def split_context(text: str) -> tuple[str, str]:
    """The text with its facts (`with_facts`), cut before its last eighth of words (at least 40): the
    context that is cached, and the rest (a space first) that is teacher-forced after it."""
    words = with_facts(text).split(" ")
    cut = len(words) - max(40, len(words) // 8)
    return " ".join(words[:cut]), " " + " ".join(words[cut:])


def fact_probes(tokenizer, context_text: str) -> list[tuple[list[int], str, list[int]]]:
    """Per fact: what follows the context to ask it (the rest of the user message, the turn's end,
    and the answer's start, "The code of the blue locker is"), its value, and the value's tokens.
    Retrieval is whether the value follows, greedily, and how likely it is."""
    return [
        (
            after(tokenizer, context_text, f"According to the text, what is the {thing}? Answer briefly.")
            + tokenizer.encode(f"The {thing} is", add_special_tokens=False),
            value,
            tokenizer.encode(f" {value}", add_special_tokens=False),
        )
        for thing, value in FACTS
    ]


def facts_retrieved(model, tokenizer, cache, probes: list[tuple[list[int], str, list[int]]]) -> int:
    """How many of `fact_probes`' values the model answers greedily (in 6 tokens) with `cache`."""
    return sum(
        value.lower() in tokenizer.decode(greedy(model, cache, q, 6, tokenizer.eos_token_id)).lower()
        for q, value, _ in probes
    )


def greedy(model, cache, tokens: list[int], n: int, stop: int) -> list[int]:
    """Up to n greedy tokens (ending at `stop`) after feeding `tokens`; the cache is trimmed back after."""
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < n and (token := int(mx.argmax(logits).item())) != stop:
        out.append(token)
        logits = model(mx.array([token])[None], cache=cache)[0, -1]
    trim(cache, len(tokens) + len(out))
    return out


def continuation_logprobs(model, cache, tokens: list[int]) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(logits)
    trim(cache, len(tokens))
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def first_rows(cache, n: int) -> list:
    """The first n positions of a cache of full-attention layers, as a cut prefix decodes (a cut
    decodes to exactly the whole's first rows: tests/unit/codec/test_transform_wire.py)."""
    return [SparseKVCache.from_arrays(*(x[:, :, :n] for x in layer.keys_and_values()), n) for layer in cache]


def value_nll(model, cache, question: list[int], value: list[int]) -> float:
    """Mean negative log-probability of the value's tokens after the question (teacher-forced)."""
    logprobs = continuation_logprobs(model, cache, question + value)
    picked = mx.take_along_axis(logprobs[len(question) - 1 : -1], mx.array(value)[:, None], axis=-1)
    return -picked.mean().item()


def trim(cache, n: int) -> None:
    """Take back the n tokens a probe fed (full-attention caches, sparse or not, trim exactly)."""
    for layer in cache:
        if layer.trim(n) != n:
            raise RuntimeError("a probe could not be taken back")
