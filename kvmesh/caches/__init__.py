"""MLX caches: sparse caches, compression methods (presses), prefill and generation from a cache."""
