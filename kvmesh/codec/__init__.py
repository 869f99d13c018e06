"""Manifests and the chunked wire encoding of caches, and whether a receiver can use one.

Import the modules themselves: `manifest`, `compat`, `chunks` and `prefix` need no MLX (the store,
server and daemon use them); `encode` and `decode` turn MLX caches into chunks and back.
"""
