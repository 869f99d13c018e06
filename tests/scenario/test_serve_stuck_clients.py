"""`kvmesh serve` against clients that ask and never read their answer, or read it a byte at a time
(issue 32): they held every connection, so /health and every request got 503 for as long as they
stayed. Real server processes, raw sockets for the stuck clients, the official `openai` client for
the well-behaved one, which calls from another loopback address (127.0.0.2)."""

import json
import socket
import threading
import urllib.request
from pathlib import Path

import httpx2
import openai
import pytest

from kvmesh.errors import ConfigError
from kvmesh.serve.options import ServeOptions
from support.daemons import start_server
from support.http_clients import BIG_ANSWER
from support.waiting import wait_for

TCP_CLOSE = 7  # Linux's tcpi_state of a connection that was reset
OTHER = "127.0.0.2"  # another client's address: Linux answers all of 127/8 on loopback

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="calls from 127.0.0.2, which only Linux answers unconfigured"
)


@pytest.fixture
def server_process(tmp_path):
    """server_process(model_dir, *args) -> ServerProcess; stopped after the test."""
    started = []

    def start(model_dir, *args):
        server = start_server(tmp_path / "s", model_dir, "--no-mesh", *args, log=tmp_path / "serve.log")
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def address_of(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def stuck_client(server: tuple[str, int]) -> socket.socket:
    """A connection from 127.0.0.1 that asks for BIG_ANSWER and reads none of it (a small receive
    buffer, so the server's bytes pile up on its side)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(server)
    body = json.dumps(BIG_ANSWER).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def health_from(url: str, source: str) -> int:
    """/health's status for a client calling from `source`."""
    host, port = address_of(url)
    with socket.create_connection((host, port), timeout=60, source_address=(source, 0)) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        answer = sock.recv(65536)
    return int(answer.split(b" ", 2)[1]) if answer else 0


def client_from(url: str, source: str) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(transport=httpx2.HTTPTransport(local_address=source))
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120, http_client=http)


def status_of(sock: socket.socket) -> bytes:
    """The status line's start of the server's answer to `sock` (b"" when it closed or reset it
    unanswered), reading no more of the answer than that."""
    try:
        return sock.recv(12)
    except ConnectionResetError:
        return b""


def read_slowly(sock: socket.socket, stop: threading.Event) -> None:
    """Five bytes a second, as a client on a very bad link (or a hostile one) reads, until stopped
    (what the kernel holds of a reset connection is still read, a byte at a time)."""
    while not stop.wait(0.2):
        try:
            sock.recv(1)
        except OSError:
            return


def reset(sock: socket.socket) -> bool:
    """Whether the server has reset `sock`, seen without reading from it (reading would let the
    server write again): the connection's TCP state (tcpi_state) is CLOSE."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_CLOSE


@pytest.mark.slow
def test_clients_that_never_read_hold_the_server_no_longer_than_the_send_timeout(tiny_dir, server_process):
    # Ten clients from 127.0.0.1 ask for big streamed answers and read nothing (one reads a byte at
    # a time), on a server of ten connections: before, they held all ten for as long as they stayed,
    # and every client got 503.
    server = server_process(tiny_dir, "--max-connections", 10, "--max-connections-per-address", 8, "--send-timeout", 5)
    stuck = [stuck_client(address_of(server.url)) for _ in range(10)]
    stop = threading.Event()
    readers: list[threading.Thread] = []
    try:
        # One address holds eight connections at most: two were not taken (closed for room, or refused).
        statuses = [status_of(sock) for sock in stuck]
        assert statuses.count(b"HTTP/1.1 200") == 8, statuses
        taken = [sock for sock, status in zip(stuck, statuses) if status == b"HTTP/1.1 200"]
        # Another address is served meanwhile.
        assert health_from(server.url, OTHER) == 200
        answer = client_from(server.url, OTHER).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.usage.completion_tokens == 2
        readers.append(threading.Thread(target=read_slowly, args=(taken[-1], stop)))
        readers[0].start()
        # Each is cut once its bytes have waited 5 s, however long it would have stayed (120 s is
        # the test's patience, not a bound on the server's speed).
        wait_for(lambda: all(reset(sock) for sock in taken), 120, what="the stuck connections to be cut")
        # The address's connections are free again, and the cut requests hold no place.
        assert health_from(server.url, "127.0.0.1") == 200
        with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=60) as response:
            health = json.loads(response.read())
        assert health["requests"] == {"lookup": 0, "waiting": 0, "generating": 0}, health
    finally:
        stop.set()
        for reader in readers:
            reader.join()
        for sock in stuck:
            sock.close()
    assert "Traceback" not in server.log.read_text()


def test_the_send_timeout_and_the_per_address_cap_must_be_positive():
    with pytest.raises(ConfigError, match="send_timeout"):
        ServeOptions(send_timeout=0)
    with pytest.raises(ConfigError, match="max_connections_per_address"):
        ServeOptions(max_connections_per_address=0)
