"""Every use of a dependency's private names, each checked by tests/test_compat_names.py."""
