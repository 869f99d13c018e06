"""A stranger that opens gRPC calls and never sends their request: HTTP/2 written by hand on a TCP
socket bound to an address of its own (127.0.0.2), so a server tells it apart from the test's
real clients on 127.0.0.1. It reads what the server sends back, enough to say which calls ended."""

import contextlib
import socket
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK header field, literal, never indexed (names and values under 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class IdleCalls:
    """Calls to `path` at `host:port` from `source`, each opened and left without its request."""

    def __init__(self, host: str, port: int, source: str = "127.0.0.2"):
        self.sock = socket.create_connection((host, port), source_address=(source, 0))
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self.opened: list[int] = []
        self.ended: set[int] = set()
        self.closed = threading.Event()
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def open(self, path: str, count: int) -> None:
        for _ in range(count):
            stream = 2 * len(self.opened) + 1
            fields = (
                literal(b":method", b"POST")
                + literal(b":scheme", b"http")
                + literal(b":path", path.encode())
                + literal(b":authority", b"kvmesh")
                + literal(b"content-type", b"application/grpc")
                + literal(b"te", b"trailers")
            )
            self.sock.sendall(frame(HEADERS, END_HEADERS, stream, fields))
            self.opened.append(stream)

    def wait_ended(self, count: int, seconds: float) -> bool:
        """Whether `count` calls were ended by the server (or the connection closed) within `seconds`."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.ended) >= count or self.closed.is_set(), seconds)

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                size, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
                self._frame(kind, flags, stream, payload)
        with self._changed:
            self.closed.set()
            self._changed.notify_all()

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            self.sock.sendall(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.sock.sendall(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
            with self._changed:
                self.ended.add(stream)
                self._changed.notify_all()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the server may have closed it
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv (close alone does not)
        self._reader.join()
        self.sock.close()

    def __enter__(self) -> "IdleCalls":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
