"""The peer port's guard relays every mesh byte (kvmesh.net.guard): intact both ways while either
side reads slower than the other writes, and a connection that ends frees its place."""

import hashlib
import os
import socket
import threading

import pytest

from kvmesh.net.guard import Guard
from support.waiting import wait_for

PAYLOAD = 8 << 20


@pytest.fixture
def target():
    """A server standing for gRPC on loopback: it reads what comes slowly, in small reads (so the
    guard's writes to it back up), hashes it, then answers with the bytes reversed."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen = {}

    def serve():
        connection, _ = listener.accept()
        with connection:
            digest, got = hashlib.sha256(), 0
            while got < PAYLOAD and (data := connection.recv(7000)):
                digest.update(data)
                got += len(data)
            seen["digest"] = digest.hexdigest()
            connection.sendall(seen["reply"])
            seen["eof"] = connection.recv(1) == b""  # the guard closes its side once the peer has

    yield listener.getsockname(), seen, serve
    listener.close()


def test_bytes_cross_the_guard_intact_both_ways_under_backpressure(target):
    address, seen, serve = target
    sent = os.urandom(PAYLOAD)
    seen["reply"] = sent[::-1]
    server = threading.Thread(target=serve)
    server.start()
    guard = Guard(address, per_address=2, total=8)
    try:
        port = guard.listen(["127.0.0.1:0"])
        with socket.create_connection(("127.0.0.1", port)) as peer:
            writer = threading.Thread(target=peer.sendall, args=(sent,))
            writer.start()
            digest, got = hashlib.sha256(), 0
            while got < PAYLOAD and (data := peer.recv(1 << 16)):
                digest.update(data)
                got += len(data)
            writer.join()
        server.join(timeout=60)
        assert seen["digest"] == hashlib.sha256(sent).hexdigest()
        assert (got, digest.hexdigest()) == (PAYLOAD, hashlib.sha256(sent[::-1]).hexdigest())
        assert seen["eof"]
        wait_for(lambda: guard.count == 0 and not guard.open, what="the guard to free the connection's place")
    finally:
        guard.stop()
