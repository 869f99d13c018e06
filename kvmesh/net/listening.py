"""Binding a gRPC server to its addresses, within the process's descriptor limit.

A taken or foreign address is found before gRPC tries (and logs its own error), and said in one
line; every address gets the first one's port when that is 0.
"""

import resource
import socket
from collections.abc import Callable

import grpc

from kvmesh.errors import ListenError
from kvmesh.net.addresses import host_port, split_host_port

# Descriptors left to everything but incoming connections: store files, the daemon's own channels
# to its peers, mDNS sockets, gRPC's pipes.
RESERVED_DESCRIPTORS = 128


def connections_allowed(listeners: int) -> int:
    """Incoming connections each of `listeners` may hold at once: what the descriptor limit leaves
    after RESERVED_DESCRIPTORS, shared between the listeners (at least 16 each)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, (soft - RESERVED_DESCRIPTORS) // max(1, listeners))


def bind_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be served (taken, not this machine's), found before gRPC tries and logs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def bind(
    server: grpc.Server,
    listen: list[str],
    credentials: grpc.ServerCredentials | Callable[[], grpc.ServerCredentials] | None,
) -> int:
    """Add each of `listen` (host:port) to `server`, the first one's port for all when it is 0; the port."""
    port = 0
    for address in listen:
        host, wanted = split_host_port(address)
        target = host_port(host, port or wanted)
        if (port or wanted) and (problem := bind_problem(host, port or wanted)):
            raise ListenError(f"cannot listen on {target}: {problem}", port or wanted)
        try:
            bound = (
                server.add_insecure_port(target)
                if credentials is None
                else server.add_secure_port(target, credentials() if callable(credentials) else credentials)
            )
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            bound = 0
        if bound == 0:
            message = f"cannot listen on {target}: is the address this machine's, and the port free?"
            raise ListenError(message, port or wanted)
        port = bound
    return port
