"""Defaults chosen by measurement, and the quantization widths MLX offers, as plain data: the CLI
and the manifest checks read them without loading MLX."""

# What `mx.quantize` takes: bits per value, and values per group (each group has a scale and a bias).
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)

# What "compress" means when no method is named (`kvmesh prefill --compress`, `kvmesh serve
# --compress`), chosen by scripts/bench_quality.py on SmolLM2-135M-Instruct: 8-bit quantization kept
# continuation KL at 0.0003-0.0011 nats/token and top-1 agreement at 98-99%, retrieved the same facts
# as the full cache, at 0.53x the fp16 bytes; no eviction method at 50% kept came near it (KL >= 0.01;
# only kvzip kept the facts, at the cost of a second pass), and 4-bit lost too much (KL 0.11-0.33).
# Eviction stays a choice for tighter budgets (README: size against quality).
DEFAULT_COMPRESSION: tuple[str, dict] = ("quantize", {"kv_bits": 8})
