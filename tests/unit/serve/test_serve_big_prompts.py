"""`kvmesh serve` counts a request's work before doing it (issue 32): a prompt far over the context
is refused before it is tokenized, so it holds no small request behind it. A real server process;
each time is measured against the same server's own tokenizing of a smaller prompt, never against a
number of seconds."""

import http.client
import json
import socket
import time
from pathlib import Path

import openai
import pytest

from support.daemons import start_server
from support.waiting import wait_for

# Under the characters the tiny model's 8,192-token context could hold by its vocabulary's longest
# token (so it is tokenized), yet over the context once it is (so it is refused after that).
TOKENIZED = "Rivers run to the sea. " * 8_000  # 184,000 characters, 80,000 tokens
FAR_OVER = TOKENIZED * 20  # 3.7 MB: 20 times as many characters


@pytest.fixture
def server(tiny_dir, tmp_path):
    server = start_server(tmp_path / "s", tiny_dir, "--no-mesh", log=tmp_path / "serve.log")
    yield server
    server.stop()


def address_of(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def post(url: str, path: str, body: dict) -> tuple[int, dict, float]:
    """(status, answer, seconds) of one request, timed from its first byte to its answer's last."""
    connection = http.client.HTTPConnection(*address_of(url), timeout=600)
    data = json.dumps(body)
    start = time.monotonic()
    connection.request("POST", path, data, {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    seconds = time.monotonic() - start
    connection.close()
    return response.status, answer, seconds


def refused_over_context(url: str, prompt: str) -> float:
    """Seconds until a completion of `prompt` is refused for the context, the fastest of three."""
    times = []
    for _ in range(3):
        status, answer, seconds = post(url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        times.append(seconds)
    return min(times)


@pytest.mark.slow
def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized(server):
    tokenize = refused_over_context(server.url, TOKENIZED)
    # Before, the tokenizer took 20 times as long over it before refusing it (2 s here, 127 s for 30 MB).
    # Refused untokenized, it costs only its 3.7 MB body's reading and parsing: 0.3-0.4 of `tokenize`
    # (0.029 against 0.081 s on an Intel Xeon box, where a bound of a third failed once).
    refuse = refused_over_context(server.url, FAR_OVER)
    assert refuse < tokenize, (refuse, tokenize)
    status, answer, _ = post(server.url, "/v1/completions", {"model": "tiny", "prompt": FAR_OVER, "max_tokens": 1})
    assert "at least" in answer["error"]["message"] and "8,192" in answer["error"]["message"]


def send_unanswered(url: str, body: dict) -> socket.socket:
    """A connection whose request the server has read (all of it), and whose answer is not yet read."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(address_of(url), timeout=600)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    wait_for(lambda: unread_bytes(sock) == 0, 600, what="the server to read the request")
    return sock


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on `sock` that the server has not read yet: those still queued on either side
    (tx_queue here, rx_queue there, in /proc/net/tcp)."""
    ends = {endpoint(sock.getsockname()), endpoint(sock.getpeername())}
    unread = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if {fields[1], fields[2]} == ends:
            tx, rx = (int(n, 16) for n in fields[4].split(":"))
            unread += tx if fields[1] == endpoint(sock.getsockname()) else rx
    return unread


def endpoint(address: tuple[str, int]) -> str:
    """An IPv4 address as /proc/net/tcp writes it (127.0.0.1:8080 -> 0100007F:1F90)."""
    host, port = address
    return f"{socket.inet_aton(host)[::-1].hex().upper()}:{port:04X}"


def answer_of(sock: socket.socket) -> bytes:
    """What the server sends until it has refused the request or closed the connection."""
    answer = b""
    while b"context_length_exceeded" not in answer and (part := sock.recv(65536)):
        answer += part
    return answer


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="sees the server read a request in /proc/net/tcp")
def test_a_small_request_is_not_held_behind_two_huge_prompts(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)

    def small() -> float:
        start = time.monotonic()
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.usage.completion_tokens == 2
        return time.monotonic() - start

    alone = min(small() for _ in range(3))
    tokenize = refused_over_context(server.url, TOKENIZED)
    huge = {"model": "tiny", "messages": [{"role": "user", "content": FAR_OVER}], "max_tokens": 2}
    pending = [send_unanswered(server.url, huge) for _ in range(2)]  # work for both parsing threads
    try:
        behind = small()
        # Before, it waited for both to be tokenized (20 times `tokenize`; 34.8 s behind two 12 MB ones).
        assert behind < alone + tokenize, (behind, alone, tokenize)
        for sock in pending:
            assert b"context_length_exceeded" in answer_of(sock)
    finally:
        for sock in pending:
            sock.close()
