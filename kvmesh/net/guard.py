"""The peer port's doorman: connections counted per address before gRPC sees them.

gRPC limits incoming connections per listener only (`grpc.max_allowed_incoming_connections`), and
a stranger holding that many (TCP without TLS, or a TLS handshake it never finishes) left members
none: new member connections were closed as they were accepted. gRPC's Python server takes no
accepted socket, so the guard accepts on the peer port itself, on an asyncio loop of its own thread,
closes at once a connection from an address that already holds `per_address` (or when `total` are
open), and relays the others byte for byte to the gRPC server on a loopback port. TLS runs end to
end between the peer and gRPC: the guard sees ciphertext only, and gRPC's handshake timeout still
cuts a half-open connection (the guard closes its side then).
"""

import asyncio
import logging
import socket
import threading
from collections import Counter

import grpc

from kvmesh.errors import ListenError
from kvmesh.net.addresses import host_port, split_host_port
from kvmesh.net.quiet import Quiet

log = logging.getLogger(__name__)
# Bytes relayed per read: large enough that a transfer's chunks cross in few reads.
RELAY_BYTES = 1 << 18
# Each relayed connection holds three descriptors of the daemon: the peer's, the guard's to gRPC,
# and gRPC's end of that one.
DESCRIPTORS_PER_CONNECTION = 3
# Connections taken per wake of the loop (the rest wait in the kernel's queue of BACKLOG), and the
# pause when the process is out of descriptors (accepting again at once would spin).
ACCEPTS_PER_WAKE = 64
BACKLOG = 128
ACCEPT_PAUSE = 0.5
# Where each relayed connection comes from ("ipv4:192.168.1.20:50123"), by the local port of the
# guard's own connection to gRPC, which is all gRPC sees of it (`caller`).
ORIGINS: dict[int, str] = {}
GUARD_PEER = "ipv4:127.0.0.1:"


def caller(context: grpc.ServicerContext) -> str:
    """Who a call on the peer port comes from, as gRPC writes a peer: the address of the Mac that
    called, also for a connection the guard relayed (gRPC's own `peer()` names the guard then)."""
    peer = context.peer()
    if peer.startswith(GUARD_PEER) and (origin := ORIGINS.get(int(peer.removeprefix(GUARD_PEER)))):
        return origin
    return peer


def grpc_peer(address: tuple) -> str:
    """A socket address as gRPC writes a peer."""
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class Guard:
    """Accepts on the peer port's addresses and relays to `target` (host, port), at most
    `per_address` connections per peer address and `total` in all at once.

    It accepts one connection at a time and closes a refused one before the next (asyncio's own
    servers accept a burst before their callbacks run: a stranger's flood ran the daemon out of
    descriptors in that burst).
    """

    def __init__(self, target: tuple[str, int], *, per_address: int, total: int):
        self.target, self.per_address, self.total = target, per_address, total
        self.open: Counter[str] = Counter()  # touched on the loop only
        self.count = 0
        self.quiet = Quiet()
        self._sockets: list[socket.socket] = []
        self._relays: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-peer-port", daemon=True)
        self._thread.start()

    def listen(self, addresses: list[str]) -> int:
        """Listen on each of `addresses` (host:port; port 0 on the first: any free port, then the
        same on the others); the port. ListenError when one cannot be served."""
        port = 0
        for address in addresses:
            host, wanted = split_host_port(address)
            self._sockets.append(listening_socket(host, port or wanted))
            port = self._sockets[-1].getsockname()[1]
        for listener in self._sockets:
            self._loop.call_soon_threadsafe(self._watch, listener)
        return port

    def _watch(self, listener: socket.socket) -> None:
        self._loop.add_reader(listener.fileno(), self._accept, listener)

    def _accept(self, listener: socket.socket) -> None:
        """Take the connections waiting on `listener`, one at a time: each refused one is closed at
        once; out of descriptors, accepting pauses for ACCEPT_PAUSE."""
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                connection, peer = listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if self.quiet.due("accept"):
                    log.warning("cannot accept connections for now: %s (logged once an hour)", e.strerror or e)
                self._loop.remove_reader(listener.fileno())
                self._loop.call_later(ACCEPT_PAUSE, self._watch, listener)
                return
            source = str(peer[0])
            if self.open[source] >= self.per_address or self.count >= self.total:
                self._refuse(source, connection)
                continue
            self.open[source] += 1
            self.count += 1
            task = self._loop.create_task(self._serve(connection, source, grpc_peer(peer)))
            self._relays.add(task)
            task.add_done_callback(self._relays.discard)

    async def _serve(self, connection: socket.socket, source: str, origin: str) -> None:
        try:
            connection.setblocking(False)
            await self._relay(connection, origin)
        finally:
            connection.close()
            self.count -= 1
            self.open[source] -= 1
            if not self.open[source]:
                del self.open[source]

    def _refuse(self, source: str, connection: socket.socket) -> None:
        """Close a connection over the limits at once (logged once an hour per address)."""
        connection.close()
        if self.quiet.due(source):
            log.warning(
                "closed a connection from %s: %s (its next ones are logged once an hour)",
                source,
                f"that address holds {self.per_address}, the most one address may"
                if self.open[source] >= self.per_address
                else f"{self.total} connections are open, all this daemon's descriptors allow",
            )

    async def _relay(self, connection: socket.socket, origin: str) -> None:
        """Copy bytes both ways until either side closes, then close both; meanwhile `caller` names
        `origin` for the calls on this connection. gRPC's side is connected first, so the peer's
        first bytes have somewhere to go."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        inner, outer = RelayEnd(ended), RelayEnd(ended)
        inner.other, outer.other = outer, inner
        try:
            transport, _ = await loop.create_connection(lambda: inner, *self.target)
        except OSError as e:
            log.warning("cannot reach this daemon's own gRPC server at %s: %s", host_port(*self.target), e)
            return
        transport.pause_reading()  # (until the peer's end is made, nothing to write to)
        local_port = transport.get_extra_info("sockname")[1]
        ORIGINS[local_port] = origin
        try:
            await loop.connect_accepted_socket(lambda: outer, sock=connection)
            transport.resume_reading()
            await ended
        except OSError:
            pass  # (the peer went away before its end was made: nothing to relay)
        finally:
            for end in (inner, outer):
                if end.transport is not None:
                    end.transport.abort()
            ORIGINS.pop(local_port, None)

    def stop(self) -> None:
        """Stop listening and close every relayed connection (gRPC has stopped by then)."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _close(self) -> None:
        for listener in self._sockets:
            self._loop.remove_reader(listener.fileno())
            listener.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on `host:port` (no SO_REUSEPORT: one daemon per port);
    ListenError when it cannot be had."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(BACKLOG)
    except OSError as e:
        listener.close()
        raise ListenError(f"cannot listen on {host_port(host, port)}: {e.strerror or e}", port) from None
    listener.setblocking(False)
    return listener


class RelayEnd(asyncio.BufferedProtocol):
    """One end of a relayed connection: what it reads (into a buffer of its own, RELAY_BYTES at a
    time) is written straight to the other end's transport, which sends it at once or keeps what
    the kernel did not take (then this end reads into a new buffer). When that end has too much
    kept (asyncio's flow control), this end stops reading until it drains. Either end closing, or
    failing, ends the relay (`ended`).

    asyncio's streams cost the guard about twice the CPU per byte (200 MB each way through the
    guard on loopback: 3.5-5.0 against 1.6-2.5 ms of its thread per 4.6 MB): each read lands in
    the stream's buffer, is copied out of it, the buffer shifted, and a coroutine woken."""

    def __init__(self, ended: asyncio.Future):
        self.ended = ended
        self.other: RelayEnd | None = None
        self.transport: asyncio.Transport | None = None
        self._buffer = memoryview(bytearray(RELAY_BYTES))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        assert self.other is not None and self.other.transport is not None
        transport = self.other.transport
        transport.write(self._buffer[:nbytes])
        if transport.get_write_buffer_size():
            # It kept what the kernel did not take: Python 3.12 and later keep a view of the buffer
            # (3.11 a copy), so the next read goes to a new one.
            self._buffer = memoryview(bytearray(RELAY_BYTES))

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def eof_received(self) -> bool:
        self._end()
        return False  # (the transport closes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def _end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


def limits(connections: int, per_address: int) -> tuple[int, int]:
    """(per address, total) for a daemon whose descriptors allow `connections` direct connections:
    each relayed one takes DESCRIPTORS_PER_CONNECTION; one address gets at most a quarter of them,
    so that on a small descriptor limit (macOS gives a terminal's processes 256) one stranger still
    leaves most to the members."""
    total = max(8, connections // DESCRIPTORS_PER_CONNECTION)
    return max(2, min(per_address, total // 4)), total
