"""The network: gRPC transport, the peer service and its client, discovery, credentials, policy.

Import the modules themselves: all but `client` (which decodes into MLX caches) need no MLX.
"""
