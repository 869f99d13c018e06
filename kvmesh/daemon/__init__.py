"""The daemon: its settings, its process, the loopback control client the CLI uses, service files.

Import the modules themselves; none of them needs MLX (the daemon only stores and moves caches).
"""
