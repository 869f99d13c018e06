"""Every use of a dependency's private names, in one place, each checked by a test that fails by
name when the dependency changes: mlx-lm's cache internals and model classes (`mlx_lm`, checked by
tests/unit/model/test_compat_names.py), uvicorn's h11 protocol and signal handling (`uvicorn`) and mlx-lm's
LRUPromptCache internals (`prompt_cache`), both checked by tests/unit/serve/test_serve_compat.py. mlx-lm and
uvicorn are pinned to the minor version these were checked against (pyproject.toml)."""
