"""Every use kvmesh makes of uvicorn's private names, each checked by tests/unit/serve/test_serve_compat.py
(uvicorn is pinned to the minor version they were checked against, in pyproject.toml).

The server bounds its connections (kvmesh.serve.connections) by subclassing uvicorn's h11 protocol,
which uvicorn keeps in a module of its own rather than its public API, and relies on its instance
attributes `conn` (the h11 connection), `transport` and `loop`. And its graceful stop exits 0:
uvicorn raises the signals it caught again once it has stopped, which kills the process before the
server removes its state file, so the server forgets them first (`forget_captured_signals`).
"""

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["H11Protocol", "forget_captured_signals"]


def forget_captured_signals(server: uvicorn.Server) -> None:
    """Keep `server` from raising again, once it has stopped, the signals that stopped it."""
    server._captured_signals.clear()
