"""What a model is: its fingerprint (no MLX needed) and the offline test models (MLX)."""
