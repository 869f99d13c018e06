"""`kvmesh serve` against careless and hostile clients (issue 24): half-sent requests, a huge prompt,
a frozen local daemon, a client probing another's prompt through `cached_tokens`. Real sockets, real
server and daemon processes, the official `openai` client."""

import contextlib
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import httpx2
import openai
import pytest

from kvmesh.errors import ConfigError
from kvmesh.serve.engine import Engine
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.serve.http.app import ServedModel, make_app
from kvmesh.serve.options import ServeOptions
from kvmesh.serve.server import http_server, listen
from kvmesh.store import CacheStore
from support.daemons import loopback_daemon, start_server
from support.http_clients import InProcessServer
from support.waiting import wait_for

SECRET = "The vault code is 48213. Never tell anyone. " * 24  # a long prefix a client must not probe
QUESTION = [{"role": "user", "content": "Where do rivers go?"}]


@pytest.fixture
def app_server(tiny_dir, tiny_loaded, tmp_path):
    """app_server(name, **options) -> the server `kvmesh serve TINY --no-mesh` runs, in this process
    (support.http_clients.InProcessServer), its data dir tmp_path / name; stopped after the test."""
    started = []

    def start(name: str, **options) -> InProcessServer:
        started.append(InProcessServer(tiny_dir, tiny_loaded, tmp_path / name, **options))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def http_server_process(tmp_path):
    """http_server_process(data_dir, model_dir, *args) -> ServerProcess; stopped after the test.
    (Not one of conftest's process fixtures by name: the tests that use it are marked slow.)"""
    started = []

    def start(data_dir, model_dir, *args):
        server = start_server(data_dir, model_dir, *args, log=Path(data_dir).with_suffix(".serve.log"))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def address_of(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def descriptors(count: int):
    """This process may open `count` descriptors meanwhile (mlx-lm leaves it 2,048)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_server(sockets: list[socket.socket], seconds: float) -> int:
    """How many of `sockets` the server closed (EOF, after any answer) within `seconds`."""
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + seconds
    while closed < len(sockets) and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                selector.unregister(sock)
                closed += 1
    selector.close()
    return closed


def whole_answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes or its body is in (uvicorn writes the head and the body
    apart, so one recv may hold only the head)."""
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        part = sock.recv(65536)
        if not part:
            break
        answer += part
    return answer


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts the server's descriptors in /proc")
def test_half_sent_requests_cannot_use_up_the_servers_descriptors(tiny_dir, http_server_process, tmp_path):
    # 2,100 clients each send half a request head and wait: more than the 2,048 descriptors mlx-lm
    # leaves the server, which before accepted nothing more and served no one.
    server = http_server_process(tmp_path / "s", tiny_dir, "--no-mesh", "--read-header-timeout", 3, "--read-timeout", 2)
    host, port = address_of(server.url)
    before = open_descriptors(server.process.pid)
    half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appli"
    with descriptors(4096):
        hanging = []
        try:
            for _ in range(2100):
                sock = socket.create_connection((host, port), timeout=30)
                sock.sendall(half)
                hanging.append(sock)
            # A whole request is served meanwhile.
            answer = client_of(server.url).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
            assert answer.usage.completion_tokens == 2
            # The half-sent ones are closed: past the cap (1,000) at once, the rest at the head's deadline.
            assert closed_by_server(hanging, seconds=3 + 30) == len(hanging)
        finally:
            for sock in hanging:
                sock.close()
    assert open_descriptors(server.process.pid) < before + 50
    assert server.log.stat().st_size < 10_000, server.log.read_text()[:2000]

    # A body that stops arriving gets a 408 after --read-timeout.
    body = json.dumps({"model": "tiny", "messages": QUESTION, "max_tokens": 1}).encode()
    with socket.create_connection((host, port), timeout=30) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body[:10])
        answer = whole_answer(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    # A head that never ends gets its own 408 (the JSON error) at --read-header-timeout.
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(half)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 3 s" in answer


class GatedTokenizer:
    """The real tokenizer, whose `encode` tells the test it has begun and goes on when told to: what
    else the server answers meanwhile is what it answers while a huge prompt is being tokenized."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.began, self.go_on = threading.Event(), threading.Event()

    def encode(self, text, *args, **kwargs):
        self.began.set()
        assert self.go_on.wait(60), "the test never let the tokenizer go on"
        return self.tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_health_answers_while_a_huge_prompt_is_tokenized(tiny, tiny_fp):
    model, tokenizer = tiny
    gated = GatedTokenizer(tokenizer)
    engine = Engine(model, gated, MeshPromptCache(tiny_fp, None, []))
    app = make_app(engine, ServedModel("tiny", frozenset({"tiny"}), 8192))
    server, backlog = http_server(app, ServeOptions(model="tiny"))
    sock = listen("127.0.0.1", 0, backlog)  # connections wait in its backlog until uvicorn runs
    port = sock.getsockname()[1]
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    answers: dict = {}

    def huge_request() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        # 184,000 characters: fewer than the context could hold by its characters (a prompt with more
        # is refused before it is tokenized), many more tokens than it holds.
        body = json.dumps({"model": "tiny", "prompt": "Rivers run to the sea. " * 8_000})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answers["huge"] = (response.status, json.loads(response.read()))
        connection.close()

    asking = threading.Thread(target=huge_request)
    try:
        asking.start()
        assert gated.began.wait(60), "the huge prompt never reached the tokenizer"
        # The tokenizer holds the huge prompt until /health has answered.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as health:
            assert json.loads(health.read())["status"] == "ok"
        assert "huge" not in answers
    finally:
        gated.go_on.set()
        asking.join(120)
        server.should_exit = True
        serving.join(30)
        engine.close()
        sock.close()
    status, answer = answers["huge"]
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_a_frozen_local_daemon_costs_a_request_its_short_deadline_once(tiny_dir, http_server_process, tmp_path):
    # The server asks the local daemon of its data dir for its live peers; the daemon is frozen
    # (SIGSTOP), which cost every request the Control call's 5 s before.
    daemon = loopback_daemon(tmp_path / "d")
    server = http_server_process(
        tmp_path / "d",
        tiny_dir,
        "--local-daemon-timeout",
        0.5,
        "--local-daemon-cache",
        60,
        "--min-store-tokens",
        100_000,
    )
    client = client_of(server.url)
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        lookups, walls = [], []
        for question in ("Where do rivers go?", "What is a delta?", "Why is the sea salty?", "Do lakes move?"):
            start = time.monotonic()
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": question}], max_tokens=2
            )
            walls.append(time.monotonic() - start)
            lookups.append(answer.usage.model_extra["kvmesh"]["prefix_s"])
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
        daemon.stop()
    # The first waited for the deadline (0.5 s), the others reused its silence: nowhere near 4 x 5 s.
    assert lookups[0] < 2.5 and max(lookups[1:]) < 0.4, lookups
    assert sum(walls) < 10, walls
    assert server.log.read_text().count("serving without the mesh's peers for now") == 1


@pytest.mark.slow
def test_a_cache_salt_keeps_one_clients_prompt_from_another(app_server, tmp_path):
    server = app_server("s", min_store_tokens=16)
    client = server.openai()

    def cached(salt: str | None, question: str) -> int:
        messages = [{"role": "system", "content": SECRET}, {"role": "user", "content": question}]
        extra = {"cache_salt": salt} if salt is not None else None
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens

    salt_a, salt_b = "a" * 43, "b" * 43
    assert cached(salt_a, "Where do rivers go?") == 0
    assert cached(salt_a, "What is a delta?") > 100  # A's own salt finds A's cache
    # B, with another salt or none, learns nothing of A's prompt: nothing of it is cached for B.
    assert cached(salt_b, "Where do rivers go?") == 0
    assert not CacheStore(tmp_path / "s" / "store").entries()  # salted caches never reach the store
    assert cached(None, "Where do rivers go?") == 0
    # What an unsalted request leaves is every client's (in memory and, once written after its
    # answer, the store, as before).
    wait_for(lambda: len(CacheStore(tmp_path / "s" / "store").entries()) == 1, 60, what="the unsalted cache stored")
    assert cached(salt_b, "Why is the sea salty?") > 100

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=1, extra_body={"cache_salt": 5})
    assert refused.value.body["param"] == "cache_salt"


def test_timeouts_and_the_connection_cap_must_be_positive():
    for name in ("read_header_timeout", "read_timeout", "local_daemon_timeout"):
        with pytest.raises(ConfigError, match=name):
            ServeOptions(**{name: 0})
    with pytest.raises(ConfigError, match="max_connections"):
        ServeOptions(max_connections=0)
    with pytest.raises(ConfigError, match="local_daemon_cache"):
        ServeOptions(local_daemon_cache=-1)


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="calls from 127.0.0.2, which only Linux answers unconfigured"
)
def test_an_unsalted_client_cannot_read_anothers_prompt_a_token_at_a_time(app_server):
    # A client at 127.0.0.1 asks with a secret in its system prompt; another, at 127.0.0.2 and with no
    # cache_salt (the default), guesses its first digit. Before, the right guess came back with one
    # more cached token than the wrong ones (50 requests read 3 of 5 digits).
    server = app_server("s", min_store_tokens=100_000)
    owner = server.openai()
    http = openai.DefaultHttpxClient(transport=httpx2.HTTPTransport(local_address="127.0.0.2"))
    guesser = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120, http_client=http)

    def cached(client: openai.OpenAI, system: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        return answer.usage.prompt_tokens_details.cached_tokens

    secret = "The vault code is 48213. Never tell anyone."
    assert cached(owner, secret) == 0
    first = owner.chat.completions.create(model="tiny", messages=[{"role": "system", "content": secret}], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens > 0  # its own entries serve it to the token
    cached(guesser, "The vault code is x")  # the guesser's own entry: every guess below shares it alike
    guesses = {digit: cached(guesser, f"The vault code is {digit}") for digit in "0123456789"}
    assert len(set(guesses.values())) == 1, guesses
