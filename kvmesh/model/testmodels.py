"""Build small real mlx-lm models offline, for tests, the demo and benchmarks.

No model hub is reachable from CI, so kvmesh makes its own: a real mlx-lm architecture with random
weights from the architecture's own initialisers (fixed seed), and a byte-level BPE tokenizer trained
on a text shipped with the package. The result is an ordinary model directory that `mlx_lm.load`
opens offline, and building it twice gives byte-identical files (so identical fingerprints).
"""

import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from kvmesh.compat.mlx_lm import model_classes
from kvmesh.errors import KvmeshError
from kvmesh.model.directory import write_model_dir
from kvmesh.model.presets import PRESETS, REAL_PRESETS, Preset

BOS, EOS, PAD = "<|bos|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, "<|im_start|>", EOS]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML with tools, as Qwen 2.5 and Hermes models render them: the tools' JSON in the system turn,
# each call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` in the assistant's turn, the
# results as `<tool_response>` in a user turn. mlx-lm infers the json_tools parser from it.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a JSON object with the function's name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The same, for a reasoning model that thinks before it answers (DeepSeek R1 and Qwen3's thinking
# models' way): the assistant's turn opens with `<think>`, which the model closes with `</think>`
# before its answer or call; mlx-lm infers the thinking markers from the two tokens in the vocabulary.
THINK_CHAT_TEMPLATE = TOOLS_CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}",
)

CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "chatml-tools": TOOLS_CHAT_TEMPLATE, "chatml-think": THINK_CHAT_TEMPLATE}
# Tokens a template needs in the vocabulary beyond SPECIAL_TOKENS.
TEMPLATE_TOKENS = {"chatml-think": ["<think>", "</think>"]}


def preset_config(preset: Preset) -> dict:
    """The config.json of a preset, as mlx-lm and transformers expect it."""
    config = asdict(preset)
    del config["description"], config["dtype"], config["chat_template"]
    config.update(config.pop("extra"))
    config.update(
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype=preset.dtype,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    return config


def train_tokenizer(vocab_size: int, extra_tokens: list[str] | None = None):
    """A byte-level BPE (the GPT-2 / Llama 3 kind) trained on the packaged corpus, with
    SPECIAL_TOKENS and `extra_tokens` (those a chat template needs) as whole tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + (extra_tokens or []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": chat_template,
    }


def make_test_model(out_dir: Path | str, preset: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
    """Write a loadable model directory for `preset` to `out_dir` and return its path.

    A real preset (REAL_PRESETS) is converted from its package's GGUF file to weights of `dtype`;
    `seed` is for random weights only.
    """
    if preset in REAL_PRESETS:
        from kvmesh.model.gguf import convert_gguf, packaged_gguf

        real = REAL_PRESETS[preset]
        return convert_gguf(packaged_gguf(real.package, real.filename), out_dir, dtype)
    if preset not in PRESETS:
        raise KvmeshError(f"unknown preset {preset!r}; choose one of: {', '.join([*PRESETS, *REAL_PRESETS])}")
    spec = PRESETS[preset]
    config = preset_config(spec)
    model_class, args_class = model_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, spec.dtype))
    mx.eval(model.parameters())

    def write(tmp: Path) -> None:
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        train_tokenizer(spec.vocab_size, TEMPLATE_TOKENS.get(spec.chat_template, [])).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(CHAT_TEMPLATES[spec.chat_template]), indent=2) + "\n"
        )

    return write_model_dir(out_dir, write)
