"""The built-in offline models (`kvmesh model make-test --preset`): plain data, no MLX.

`kvmesh.model.testmodels` builds them; the CLI lists them without importing MLX.
"""

from dataclasses import dataclass


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
