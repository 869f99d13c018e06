"""`kvmesh serve`: its server in this process where the process is not what is tested, real server
processes where it is (binding, the mesh, the daemon), the official `openai` client, mlx-lm as the
reference."""

import http.client
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.reuse.generate import generate
from kvmesh.reuse.rates import Rates
from kvmesh.serve.engine import Done, Engine, Job
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.store import CacheStore
from support.daemons import LOOPBACK, loopback_daemon, start_daemon, start_server
from support.http_clients import InProcessServer
from support.processes import cli
from support.references import mlx_lm_text, mlx_lm_tokens
from support.stores import put
from support.waiting import wait_for

SYSTEM = "You answer questions about rivers, briefly and plainly. " * 24  # a long shared prefix
QUESTION = [{"role": "user", "content": "Where do rivers go?"}]


@pytest.fixture
def http_server(tmp_path):
    """http_server(name, *args) -> (openai client, process): `kvmesh serve` of the tiny model."""
    started = []

    def start(model_dir, name, *args):
        server = start_server(tmp_path / name, model_dir, *args, log=tmp_path / f"{name}.serve.log")
        started.append(server)
        return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120), server.process

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def app_server(tiny_dir, tiny_loaded, tmp_path):
    """app_server(**options) -> (openai client, server): the server `kvmesh serve TINY --no-mesh`
    runs, in this process (support.http_clients.InProcessServer), for the tests that do not test the
    process; `options` are ServeOptions' fields."""
    started = []

    def start(**options):
        server = InProcessServer(tiny_dir, tiny_loaded, tmp_path / f"server-{len(started)}", **options)
        started.append(server)
        return server.openai(), server

    yield start
    for server in started:
        server.stop()


def chat(client, messages, **options):
    return client.chat.completions.create(model="tiny", messages=messages, **options)


def streamed(client, messages, **options) -> tuple[str, object]:
    text, usage = [], None
    for chunk in chat(client, messages, stream=True, stream_options={"include_usage": True}, **options):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        elif chunk.usage:
            usage = chunk.usage
    return "".join(text), usage


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_chat_and_completions_streamed_or_not_equal_mlx_lm(tiny, app_server):
    client, _ = app_server()
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    expected = mlx_lm_text(tiny, messages)
    first = chat(client, messages, max_tokens=8)
    assert first.choices[0].message.content == expected and first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 8 and first.usage.prompt_tokens_details.cached_tokens == 0
    text, usage = streamed(client, messages, max_tokens=8)
    assert text == expected and usage.prompt_tokens == first.usage.prompt_tokens
    # The second request found the first one's cache in memory.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert usage.model_extra["kvmesh"]["prefix_from"] == "memory"

    completion = client.completions.create(model="tiny", prompt="Rivers run to the sea", max_tokens=6)
    assert completion.choices[0].text == mlx_lm_text(tiny, prompt="Rivers run to the sea", max_tokens=6)
    pieces = client.completions.create(model="tiny", prompt="Rivers run to the sea", max_tokens=6, stream=True)
    assert "".join(p.choices[0].text for p in pieces) == completion.choices[0].text

    seeded = [chat(client, QUESTION, max_tokens=8, temperature=1.0, seed=7).choices[0].message.content for _ in "ab"]
    assert seeded[0] == seeded[1] == mlx_lm_text(tiny, QUESTION, temperature=1.0, seed=7)


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_stop_strings_and_max_tokens_end_generation(tiny, app_server):
    client, _ = app_server()
    full = mlx_lm_text(tiny, QUESTION, max_tokens=12)
    stop = full[3:6]
    answer = chat(client, QUESTION, max_tokens=12, stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == full[: full.index(stop)]
    text, usage = streamed(client, QUESTION, max_tokens=12, stop=stop)
    assert text == full[: full.index(stop)]
    assert chat(client, QUESTION, max_tokens=3).usage.completion_tokens == 3


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(app_server):
    client, _ = app_server()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, QUESTION, max_tokens=-1)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [{"role": "user", "content": "word " * 9000}])
    assert e.value.body["code"] == "context_length_exceeded"
    base = str(client.base_url).rstrip("/")
    malformed = urllib.request.Request(f"{base}/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(malformed, timeout=30)
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["code"] == "invalid_json"
    with urllib.request.urlopen(f"{base.removesuffix('/v1')}/health", timeout=30) as health:
        assert json.loads(health.read())["status"] == "ok"
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert chat(client, QUESTION, max_tokens=2).usage.completion_tokens == 2


def raw_post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """A POST as a browser, a script or an attacker sends it: any bytes, any headers."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(
            "POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_malformed_fields_get_openai_400s_and_never_a_500(app_server):
    client, _ = app_server()
    url = str(client.base_url)
    good = {"model": "tiny", "messages": QUESTION, "max_tokens": 2}
    cases = [
        ({**good, "model": ["tiny"]}, "model"),
        ({**good, "seed": -1}, "seed"),
        ({**good, "seed": 2**70}, "seed"),
        ({**good, "stream": True, "stream_options": "usage"}, "stream_options"),
        ({**good, "stream": "yes"}, "stream"),
    ]
    for body, param in cases:
        status, answer = raw_post(url, json.dumps(body).encode())
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = raw_post(url, b"[" * 100_000 + b"]" * 100_000)
    assert (
        status == 400 and answer["error"]["code"] == "invalid_json" and "nested too deep" in answer["error"]["message"]
    )
    assert chat(client, QUESTION, max_tokens=2).usage.completion_tokens == 2  # and it serves on


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_a_body_over_the_limit_is_refused_unread(app_server):
    client, _ = app_server(max_body_bytes=100_000)
    url = str(client.base_url)
    padded = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200_000}]}
    status, answer = raw_post(url, json.dumps(padded).encode())
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert "100,000 bytes" in answer["error"]["message"]
    assert chat(client, QUESTION, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_a_loopback_server_answers_loopback_and_container_hosts_and_refuses_rebinding(app_server):
    # As Open WebUI in Docker calls it: http://host.docker.internal:PORT/v1, with its API key.
    client, _ = app_server(api_key="sk-local", allowed_hosts=("Studio.lan",))
    url = str(client.base_url)
    port = url.split("//")[1].split("/")[0].rsplit(":", 1)[1]
    key = {"Authorization": "Bearer sk-local"}
    body = json.dumps({"model": "tiny", "messages": QUESTION, "max_tokens": 1}).encode()
    refused = (
        {"Host": f"attacker.example:{port}"},  # a page on a name rebound to 127.0.0.1
        {"Host": f"host.docker.internal.attacker.example:{port}"},
        {"Origin": "http://attacker.example"},  # a page's script
        {"Host": f"host.docker.internal:{port}", "Origin": "http://attacker.example"},
    )
    for headers in refused:
        status, answer = raw_post(url, body, {**key, **headers})
        assert status == 403 and answer["error"]["code"] == "forbidden", headers
    served = (
        {"Host": f"localhost:{port}"},
        {"Origin": "http://127.0.0.1:3000"},
        {},
        {"Host": f"host.docker.internal:{port}"},
        {"Host": f"studio.lan:{port}"},  # --allowed-host, in any case
    )
    for headers in served:
        status, answer = raw_post(url, body, {**key, **headers})
        assert status == 200 and answer["usage"]["completion_tokens"] == 1, headers
    status, answer = raw_post(url, body, {"Host": f"host.docker.internal:{port}"})
    assert status == 401  # the key is still asked for
    # The official client, as a container's app holds it (its Host header names the container's name).
    docker = openai.OpenAI(
        base_url=url, api_key="sk-local", max_retries=0, default_headers={"Host": f"host.docker.internal:{port}"}
    )
    assert [m.id for m in docker.models.list().data] == ["tiny"]


def open_stream(url: str, body: dict) -> socket.socket:
    """A streaming request whose response has begun (its status line arrived): the handler is waiting
    on the job. The caller may read on, or close it as a client that goes away does."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_clients_that_leave_while_queued_or_waiting_hold_nothing(app_server):
    client, _ = app_server()
    url = str(client.base_url)
    # One long generation holds the engine; twelve streaming requests queue behind it and leave
    # (more than the default executor's threads here, which a waiting handler used to hold for good).
    busy = open_stream(url, {"model": "tiny", "messages": QUESTION, "max_tokens": 3000, "stream": True})
    server = busy.getpeername()
    for _ in range(12):
        open_stream(url, {"model": "tiny", "messages": QUESTION, "max_tokens": 8, "stream": True}).close()
    busy.close()
    answer = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    assert chat(answer, QUESTION, max_tokens=2).usage.completion_tokens == 2
    assert streamed(answer, QUESTION, max_tokens=2)[1].completion_tokens == 2

    # A non-streaming client that leaves mid-generation stops it: the next request is not held behind
    # its ten times longer generation (each measured against the other on this machine, here and now).
    start = time.monotonic()
    assert chat(answer, QUESTION, max_tokens=300).usage.completion_tokens == 300
    short = time.monotonic() - start
    waiting = socket.create_connection(server, timeout=60)
    body = json.dumps({"model": "tiny", "messages": QUESTION, "max_tokens": 3000}).encode()
    waiting.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
    waiting.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(short / 3)  # let its generation begin
    waiting.close()
    start = time.monotonic()
    assert chat(answer, QUESTION, max_tokens=2).usage.completion_tokens == 2
    assert time.monotonic() - start < 4 * short, "the next request waited for a generation nobody reads"


@pytest.mark.slow
def test_off_loopback_needs_an_api_key(tiny_dir, tmp_path):
    result = cli("serve", tiny_dir, "--host", "0.0.0.0", check=False, timeout=60)
    assert result.returncode == 1 and "needs an API key" in result.stderr and result.stderr.count("\n") == 1


def test_localhost_is_served_on_both_loopbacks(tiny_dir, http_server):
    # macOS resolves localhost to ::1 first: clients that take the first address must find it there.
    client, _ = http_server(tiny_dir, "a", "--no-mesh", "--host", "localhost")
    port = int(str(client.base_url).split("//")[1].split("/")[0].rsplit(":", 1)[1])
    for address in ("127.0.0.1", "::1"):
        connection = http.client.HTTPConnection(address, port, timeout=60)
        try:
            connection.request("GET", "/v1/models", headers={"Host": f"localhost:{port}"})
            answer = connection.getresponse()
            assert answer.status == 200 and json.loads(answer.read())["data"][0]["id"] == "tiny", address
        finally:
            connection.close()


@pytest.mark.slow  # (generates over HTTP: past the fast tier's budget)
def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(tiny, app_server):
    client, _ = app_server()
    model, tokenizer = tiny
    turn = [{"role": "system", "content": SYSTEM}, *QUESTION]
    first = chat(client, turn, max_tokens=8)
    second = [
        *turn,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    answer = chat(client, second, max_tokens=8)
    assert answer.choices[0].message.content == mlx_lm_text(tiny, second)
    # The cache of turn one covers its prompt and its answer's tokens; turn two's prompt holds the
    # answer as the client sent it back, re-tokenized, which can differ from the generated tokens
    # (mlx-lm's detokenizer drops the answer's leading space): the cache serves what they share.
    prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True)
    generated = mlx_lm_tokens(model, tokenizer, prompt, 8)
    again = tokenizer.apply_chat_template(second, add_generation_prompt=True)
    shared = next(i for i, (x, y) in enumerate(zip([*prompt, *generated], again)) if x != y)
    assert answer.usage.prompt_tokens_details.cached_tokens == shared >= first.usage.prompt_tokens
    assert answer.usage.model_extra["kvmesh"]["prefix_from"] == "memory"


def test_the_engine_keeps_prompt_and_completion_for_the_next_turn(tiny, tiny_fp):
    """In process: a prompt that extends turn one's prompt and generated tokens reuses all of them."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, MeshPromptCache(tiny_fp, None, []))
    try:
        prompt = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, *QUESTION], add_generation_prompt=True
        )
        first = run(engine, Job(list(prompt), 8))
        generated = mlx_lm_tokens(model, tokenizer, prompt, 8)
        second = run(engine, Job([*prompt, *generated, *tokenizer.encode(" more", add_special_tokens=False)], 4))
    finally:
        engine.close()
    assert first.cached_tokens == 0 and first.completion_tokens == 8
    assert second.cached_tokens == len(prompt) + len(generated) and second.prefix.where == "memory"


def run(engine: Engine, job: Job) -> Done:
    engine.submit(job)
    while not isinstance(event := job.events.get(timeout=120), Done):
        assert not isinstance(event, Exception), event
    return event


def test_two_servers_share_a_long_system_prompt_over_the_mesh(tiny, tiny_dir, http_server, tmp_path):
    # A serves the API and (through its daemon) its store; B asks A's daemon for what it lacks.
    client_a, _ = http_server(tiny_dir, "a", "--no-mesh", "--min-store-tokens", 64)
    daemon = loopback_daemon(tmp_path / "a")
    try:
        client_b, _ = http_server(
            tiny_dir, "b", "--peer", daemon.address, "--min-store-tokens", 64, "--fetch", "always"
        )
        chat(client_a, [{"role": "system", "content": SYSTEM}, *QUESTION], max_tokens=4)
        # A keeps the cache in its store after its answer (the answer waits for no disk).
        wait_for(lambda: CacheStore(tmp_path / "a" / "store").entries(), 60, what="A's cache in its store")
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a delta?"}]
        answer = chat(client_b, other, max_tokens=8)
    finally:
        daemon.stop()
    mesh = answer.usage.model_extra["kvmesh"]
    tokenizer = tiny[1]
    first = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, *QUESTION], add_generation_prompt=True
    )
    second = tokenizer.apply_chat_template(other, add_generation_prompt=True)
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert mesh["prefix_from"] == f"peer {daemon.address}" and mesh["wire_bytes"] > 0 and mesh["cache_id"]
    # The names `kvmesh generate --json` gives too (tests/scenario/test_cli.py).
    assert {"prefix_tokens", "prefix_s", "skipped", "fetch_or_prefill"} <= set(mesh) and "choices" not in mesh
    # A's cache of its whole conversation serves B the block-aligned part of the prefix they share.
    assert answer.usage.prompt_tokens_details.cached_tokens == shared // 128 * 128 > 0
    assert answer.choices[0].message.content == mlx_lm_text(tiny, other)


def test_a_frozen_peer_costs_the_idle_timeout_not_an_error(tiny, tiny_dir, tiny_fp, http_server, tmp_path):
    # A's store holds the cache of the whole conversation; its daemon is frozen (SIGSTOP) when B asks.
    # (A freeze in the middle of a transfer: tests/scenario/test_reliability.py.)
    model, tokenizer = tiny
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    put(
        CacheStore(tmp_path / "a" / "store"),
        prefill(model, tokens[:-1]).cache,
        tiny_fp,
        tokens[:-1],
        codec="none",
        chunk_size=16 << 10,
    )
    daemon = loopback_daemon(tmp_path / "a")
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        client, _ = http_server(tiny_dir, "b", "--peer", daemon.address, "--idle-timeout", 2)
        answer = chat(client, messages, max_tokens=6)
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
        daemon.stop()
    assert answer.choices[0].message.content == mlx_lm_text(tiny, messages, max_tokens=6)
    mesh = answer.usage.model_extra["kvmesh"]
    assert mesh["prefix_from"] == "none" and mesh["skipped"] and mesh["prefix_s"] < 15


def test_the_usage_says_why_a_peer_cache_was_not_fetched(tiny, tiny_dir, tiny_fp, http_server, tmp_path):
    # A's daemon holds the conversation's cache; B prefills ten million tokens a second (its rates
    # file says so), so recomputing beats fetching, and the usage extension says why.
    model, tokenizer = tiny
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    put(CacheStore(tmp_path / "a" / "store"), prefill(model, tokens[:-1]).cache, tiny_fp, tokens[:-1])
    rates = Rates(tmp_path / "b")
    rates.record_prefill(tiny_fp.model_id, 128, 128e-7)
    rates.record_prefill(tiny_fp.model_id, 512, 512e-7)
    daemon = loopback_daemon(tmp_path / "a")
    try:
        client, _ = http_server(tiny_dir, "b", "--peer", daemon.address)
        answer = chat(client, messages, max_tokens=6)
    finally:
        daemon.stop()
    assert answer.choices[0].message.content == mlx_lm_text(tiny, messages, max_tokens=6)
    mesh = answer.usage.model_extra["kvmesh"]
    assert mesh["prefix_from"] == "none" and mesh["wire_bytes"] == 0
    [choice] = mesh["fetch_or_prefill"]
    assert choice.startswith(f"{len(tokens) - 1} cached tokens at {daemon.address}: fetching")
    assert "(probed)" in choice and choice.endswith(": prefill")
    assert Rates(tmp_path / "b").link_source(daemon.address) == "probed"  # kept for the next request


def test_generate_stops_at_the_end_of_a_turn(tiny, tiny_fp, prompt_ids, tmp_path):
    """`kvmesh generate` ends where mlx-lm would: at an end-of-turn token, which is not returned."""
    model = tiny[0]
    store = CacheStore(tmp_path / "s")
    free = generate(model, tiny_fp, prompt_ids, store, max_tokens=6)
    assert len(free.tokens) == 6
    stopped = generate(model, tiny_fp, prompt_ids, store, max_tokens=6, stop_tokens={free.tokens[2]})
    assert stopped.tokens == free.tokens[: free.tokens.index(free.tokens[2])]


@pytest.mark.slow
def test_generate_cli_takes_sampling_options(tiny_dir, tmp_path):
    args = [
        "generate",
        str(tiny_dir),
        "--prompt",
        "Rivers",
        "--no-mesh",
        "--max-tokens",
        "5",
        "--temp",
        "1.0",
        "--seed",
        "3",
        "--json",
    ]
    runs = [json.loads(cli(*args, data_dir=tmp_path).stdout) for _ in "ab"]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 5


@pytest.mark.slow
def test_the_daemon_runs_the_server_its_config_describes(tiny_dir, tmp_path):
    config = tmp_path / "kvmesh.toml"
    config.write_text(f'discovery = false\n\n[serve]\nmodel = "{tiny_dir}"\nport = 0\nmin-store-tokens = 64\n')
    daemon = start_daemon(tmp_path / "d", "--config", config, *LOOPBACK)
    try:
        deadline = time.monotonic() + 60
        while "kvmesh serve: tiny at " not in daemon.log.read_text():
            assert time.monotonic() < deadline and daemon.process.poll() is None, daemon.log.read_text()
            time.sleep(0.1)  # the server is the daemon's child: its only word is its line in the log
        url = daemon.log.read_text().split("kvmesh serve: tiny at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        assert chat(client, QUESTION, max_tokens=2).usage.completion_tokens == 2
    finally:
        daemon.stop()
    with pytest.raises(openai.APIConnectionError):
        chat(client, QUESTION, max_tokens=2)  # stopped with the daemon
    bad = tmp_path / "bad.toml"
    bad.write_text("[serve]\nmodle = 'x'\n")
    result = cli("serve", "--config", bad, check=False)
    assert result.returncode == 1 and "[serve]: unknown setting 'modle'; known: allowed_hosts, api_key" in result.stderr


def test_the_engine_ends_at_an_end_of_turn_token(tiny, tiny_dir, tiny_fp):
    """mlx-lm's stop at the tokenizer's EOS ids: here a greedy token is made one."""
    from mlx_lm.utils import load_tokenizer

    model, tokenizer = tiny
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    tokens = mlx_lm_tokens(model, tokenizer, prompt, 6)
    first_new = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    own = load_tokenizer(tiny_dir)  # a tokenizer of its own: the shared one stays as it is
    own.add_eos_token(str(tokens[first_new]))
    engine = Engine(model, own, MeshPromptCache(tiny_fp, None, []))
    try:
        job = Job(list(prompt), 6)
        done = run(engine, job)
    finally:
        engine.close()
    assert done.finish_reason == "stop" and done.completion_tokens == first_new
