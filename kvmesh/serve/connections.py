"""Bounds on what a client's connections can hold: a deadline for each request's head and for each
answer's bytes, and caps.

uvicorn closes a connection that idles between requests (its keep-alive timeout) but gives a new
one, or one part-way through a request's head, all the time it wants: 2,100 clients that send half
a head each hold 2,100 descriptors, past the 2,048 mlx-lm leaves the process, and then nothing is
accepted at all (asyncio logs each failed accept with its traceback). So each connection here has
`read_header_timeout` seconds from its first byte (or from its opening) to finish a head, after which it
gets a 408 and is closed; and past `max_connections` open ones, the connection that has waited
longest on its request is closed to make room, so a client that sends whole requests is served
whatever the others hold. (A body's pauses are bounded by the application, which reads it.)

A client that asks and then never reads its answer (or reads a byte a second) holds its connection
as long as it likes: the answer's bytes wait in the kernel and in asyncio's buffer, and the request
is in progress, so it is never the one closed for room; a thousand such clients held every
connection, and /health and every request got 503 for as long as they stayed. So an answer whose
bytes cannot be written for `send_timeout` seconds (asyncio has paused writing: its buffer is over
the high-water mark, the kernel's of SEND_BUFFER_BYTES being full) is cut: the connection is reset,
and the application sees its client go, which cancels the job. And one address holds at most
`max_per_address` connections: past it, that address's own connection waiting longest on its
request is closed, or else the newcomer is refused (503), so what one client holds leaves room for
the others (loopback clients too: every local tool comes from 127.0.0.1, which is why the default
is generous).

The protocol is uvicorn's own h11 one, with these bounds added (`guarded_protocol`).
"""

import asyncio
import json
import os
import resource
import socket
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import h11

from kvmesh.compat.uvicorn import H11Protocol
from kvmesh.errors import ConfigError

# Descriptors kept free beyond the connections and one burst of accepts: the store, the model's
# files, gRPC channels to peers, logs.
SPARE_DESCRIPTORS = 128
# The kernel's send buffer of each connection. Left to itself it grows to 4 MiB (Linux's and macOS's
# bound), so an answer shorter than that which nobody reads looks written and its send timeout never
# starts, and a thousand stuck clients hold 4 GiB of kernel memory. An answer's tokens need no more
# than this: 128 KiB over a 10 ms link is 12 MB/s.
SEND_BUFFER_BYTES = 128 << 10
# asyncio accepts up to its backlog in one go before any connection is looked at, so a burst can
# hold that many descriptors beyond the cap for a moment.
LISTEN_BACKLOG = 2048


def timeout_response(message: str) -> bytes:
    """A 408 in OpenAI's error shape, written raw: no request was parsed for h11 to answer."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_timeout"}}
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class ConnectionGuard:
    """The bounds, and the connections still sending a request (oldest first): those are the ones
    closed when the cap is reached, since they are the ones that may never finish."""

    read_header_timeout: float
    max_connections: int
    max_per_address: int
    send_timeout: float
    waiting: "OrderedDict[GuardedH11Protocol, None]" = field(default_factory=OrderedDict)
    open: int = 0
    per_address: Counter[str] = field(default_factory=Counter)
    closed_for_room: int = 0
    timed_out: int = 0
    send_timed_out: int = 0

    def make_room(self, newcomer: "GuardedH11Protocol") -> bool:
        """Close the connection waiting longest (of the newcomer's address, when that address passes
        its cap; of all, when the cap of all is passed); False when none can go (each has a request
        in progress), so the newcomer itself must."""
        if self.per_address[newcomer.address] > self.max_per_address:
            return self._close_oldest(newcomer, newcomer.address)
        if self.open > self.max_connections:
            return self._close_oldest(newcomer, None)
        return True

    def _close_oldest(self, newcomer: "GuardedH11Protocol", address: str | None) -> bool:
        oldest = next(
            (c for c in self.waiting if c is not newcomer and address in (None, c.address)),
            None,
        )
        if oldest is None:
            return False
        self.closed_for_room += 1
        oldest.close_waiting()
        return True


def descriptor_backlog(max_connections: int) -> int:
    """The listen backlog that keeps `max_connections` plus one burst of accepts within this process's
    descriptor limit, raising the soft limit toward the hard one when it must (mlx-lm sets it to
    2,048 on import). A ConfigError when even a small backlog does not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/dev/fd"))
    needed = in_use + SPARE_DESCRIPTORS + max_connections + LISTEN_BACKLOG
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return LISTEN_BACKLOG
    backlog = min(LISTEN_BACKLOG, soft - in_use - SPARE_DESCRIPTORS - max_connections)
    if backlog < 16:
        raise ConfigError(
            f"max_connections {max_connections:,} needs more descriptors than this process may open ({soft:,}, "
            f"{in_use} in use): lower --max-connections or raise the limit (ulimit -n)"
        )
    return backlog


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on each request's head and each answer's writes, and
    caps on connections."""

    guard: ConnectionGuard  # set on the subclass `guarded_protocol` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None
        self.address = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.guard.open += 1
        self.guard.per_address[self.address] += 1
        self.guard.waiting[self] = None
        self._arm_head_deadline()
        if not self.guard.make_room(self):
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
            self.close_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open -= 1
        self.guard.per_address[self.address] -= 1
        if not self.guard.per_address[self.address]:
            del self.guard.per_address[self.address]
        self._forget()
        self._cancel_send_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """asyncio's buffer for this connection is full: its client has `send_timeout` seconds to
        read enough of it that writing resumes."""
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self.guard.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel_send_deadline()
        super().resume_writing()

    def _cancel_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_timed_out(self) -> None:
        """Reset, not closed: a close leaves the unread bytes to the kernel, which keeps offering
        them to the client (holding their memory) for as long as it stays."""
        self._send_deadline = None
        if self.transport.is_closing():
            return
        self.guard.send_timed_out += 1
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track(received=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track(received=False)

    def _track(self, *, received: bool) -> None:
        """After h11 has seen new bytes or a response ended: a head under way keeps (or gets) its
        deadline; a connection waiting for its next request, or part-way through its body, may be
        closed for room; one whose request is in hand is left alone."""
        if self.transport.is_closing():
            self._forget()
            return
        state = self.conn.their_state
        if state is h11.IDLE or state is h11.SEND_BODY:
            self.guard.waiting.setdefault(self, None)
        else:
            self.guard.waiting.pop(self, None)
        if state is h11.IDLE and received:
            self._arm_head_deadline()  # the first bytes of a head that follows a response
        elif state is not h11.IDLE:
            self._cancel_head_deadline()

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.guard.read_header_timeout, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.guard.timed_out += 1
        self.transport.write(
            timeout_response(f"the request's head did not arrive within {self.guard.read_header_timeout:g} s")
        )
        self.close_waiting()

    def close_waiting(self) -> None:
        """Close this connection, whose request (if any) is not whole yet: no response is under way,
        and an application reading its body sees the client go."""
        self._forget()
        self.transport.close()

    def _forget(self) -> None:
        self._cancel_head_deadline()
        self.guard.waiting.pop(self, None)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (`Config(http=...)`): every connection shares `guard`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
