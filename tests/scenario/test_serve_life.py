"""`kvmesh serve`'s own life and its queue (issue 22): the port checked before the model loads, a stop
within a second, the banner and serve.json, /health, the context length of a hub model, one log line
per request, the bound past which requests get a 429, lookups off the generation thread, a client
that leaves freeing its place, concurrent clients. Real server and daemon processes, the `openai` client."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvmesh.serve.engine import Abandoned, Engine, Job, Started
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.serve.state import read_serve_state, serve_states
from support.daemons import loopback_daemon, start_server
from support.http_clients import InProcessServer
from support.processes import ENV, cli

QUESTION = [{"role": "user", "content": "Where do rivers go?"}]


@pytest.fixture
def serving(tmp_path):
    """serving(name, model_dir, *args, env=None) -> ServerProcess, stopped after the test."""
    started = []

    def start(name, model_dir, *args, env=None):
        server = start_server(tmp_path / name, model_dir, *args, log=tmp_path / f"{name}.serve.log", env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def app_server(tiny_dir, tiny_loaded, tmp_path):
    """app_server(name, peers=(), **options) -> the server `kvmesh serve TINY` runs (`--no-mesh`, or
    `--peer` each of `peers`), in this process (support.http_clients.InProcessServer), its data dir
    tmp_path / name, its log lines in tmp_path / NAME.serve.log; stopped after the test. For the
    tests of the queue, not of the process."""
    started = []

    def start(name: str, **options) -> InProcessServer:
        log = tmp_path / f"{name}.serve.log"
        started.append(InProcessServer(tiny_dir, tiny_loaded, tmp_path / name, log=log, **options))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def client_of(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=retries, timeout=120)


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url.removesuffix('/v1')}/health", timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def batch_sizes(log: Path) -> list[int]:
    """The largest batch each request of a server's log was decoded in (0: alone)."""
    sizes = []
    for line in log.read_text().splitlines():
        if "kvmesh.serve.engine: request " in line:
            found = re.search(r"in a batch of up to (\d+)", line)
            sizes.append(int(found.group(1)) if found else 0)
    return sizes


def wait_for(condition, timeout: float = 30.0, what: str = "the server's state") -> None:
    """Poll `condition` (the server's /health: it has no event to wait on from outside)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def held(url: str, stage: str) -> int:
    return health(url)[1].get("requests", {}).get(stage, 0)


@pytest.mark.slow
def test_a_port_in_use_is_refused_before_the_model_loads(tiny_dir, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        start = time.monotonic()
        result = cli("serve", tiny_dir, "--port", taken.getsockname()[1], "--no-mesh", data_dir=tmp_path, check=False)
    finally:
        taken.close()
    assert result.returncode == 1, result.stderr  # not 134 (an abort after the model loaded)
    assert "cannot listen on 127.0.0.1:" in result.stderr and "terminate called" not in result.stderr
    assert time.monotonic() - start < 20
    assert serve_states(tmp_path) == []


@pytest.mark.slow
def test_the_banner_state_file_and_health_say_how_it_serves(tiny_dir, tmp_path, serving):
    alone = serving("alone", tiny_dir, "--no-mesh")
    state = read_serve_state(tmp_path / "alone")
    assert (state.pid, state.url, state.model) == (alone.process.pid, alone.url, "tiny") and state.model_id
    assert state.mesh.startswith("off (--no-mesh)")
    status, body = health(alone.url)
    assert status == 200 and body["status"] == "ok" and body["max_requests"] == 64
    assert alone.stop() == 0 and serve_states(tmp_path / "alone") == []
    assert "mesh: off (--no-mesh)" in alone.process.stdout.read()

    # No daemon runs for its data directory: the mesh is off for now, and it calibrates (visibly).
    nodaemon = serving("nodaemon", tiny_dir)
    assert read_serve_state(tmp_path / "nodaemon").mesh.startswith("off for now (no kvmesh daemon is running")
    wait_for(lambda: health(nodaemon.url)[0] == 200, what="calibration")
    assert nodaemon.stop() == 0
    banner = nodaemon.process.stdout.read()
    assert "calibrating the prefill and decode rates here" in banner and '/health says "starting"' in banner
    assert "calibrated in" in nodaemon.log.read_text()

    daemon = loopback_daemon(tmp_path / "withdaemon")
    try:
        serving("withdaemon", tiny_dir)
        mesh = read_serve_state(tmp_path / "withdaemon").mesh
        assert mesh.startswith("on: the live peers of the local daemon at ") and daemon.state.node_id in mesh
    finally:
        daemon.stop()


@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_it_without_waiting_for_generations(tiny_dir, serving):
    # Two requests generating (4,000 tokens each; batched together, or one waiting behind the other):
    # the stop holds for neither.
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = serving(f"stop-{sig.name}", tiny_dir, "--no-mesh")
        client = client_of(server.url)
        stream = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4000, stream=True)
        next(iter(stream))
        answers = ThreadPoolExecutor(1)
        waiting = answers.submit(client.completions.create, model="tiny", prompt="rivers", max_tokens=4000)
        wait_for(lambda url=server.url: held(url, "generating") + held(url, "waiting") == 2, what="the second request")
        server.process.send_signal(sig)
        assert server.process.wait(timeout=60) == 0
        # The stop waited for neither generation: the stream was cut well before its 4,000 tokens.
        streamed = 0
        with contextlib.suppress(openai.APIError):  # its end: the error event "the server is stopping"
            for _ in stream:
                streamed += 1
        assert streamed < 3000, "the stop waited for the generation"
        with contextlib.suppress(openai.APIError):  # a 503 (the server is stopping), the connection closed,
            waiting.result(timeout=30)  # or its answer, when the model ended it first: never a hang
        answers.shutdown()
        log = server.log.read_text()
        assert "terminate called" not in log and "ASGI callable returned without completing" not in log
        assert serve_states(server.log.with_suffix("").with_suffix("")) == []


@pytest.mark.slow
def test_two_servers_of_one_data_dir_keep_their_own_state(tiny_dir, tmp_path):
    first = start_server(tmp_path / "data", tiny_dir, "--no-mesh", log=tmp_path / "first.log")
    second = start_server(tmp_path / "data", tiny_dir, "--no-mesh", log=tmp_path / "second.log")
    try:
        assert [(s.pid, s.url) for s in serve_states(tmp_path / "data")] == [
            (first.process.pid, first.url),
            (second.process.pid, second.url),
        ]
        assert read_serve_state(tmp_path / "data").url == second.url  # the one started last
        assert first.stop() == 0
        assert [s.url for s in serve_states(tmp_path / "data")] == [second.url]  # the other's stays
    finally:
        first.stop()
        second.stop()
    # A server killed leaves its file behind, which readers pass over.
    killed = start_server(tmp_path / "data", tiny_dir, "--no-mesh", log=tmp_path / "killed.log")
    killed.process.kill()
    killed.process.wait()
    assert serve_states(tmp_path / "data") == []


@pytest.mark.slow
def test_ctrl_c_during_a_prefill_says_what_it_stopped(tiny_dir, serving):
    # A prompt that takes the tiny model seconds to prefill: Ctrl-C comes in the middle of it.
    server = serving("prefill", tiny_dir, "--no-mesh")
    client = client_of(server.url)
    answers = ThreadPoolExecutor(1)
    asked = answers.submit(
        client.chat.completions.create,
        model="tiny",
        messages=[{"role": "user", "content": "hi " * 7000}],
        max_tokens=4,
    )
    wait_for(lambda: held(server.url, "generating") == 1, what="the prefill")
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=60) == 0
    with pytest.raises(openai.APIStatusError) as stopped:  # told at once, not cut off
        asked.result(timeout=60)
    answers.shutdown()
    assert stopped.value.status_code == 503 and "the server is stopping" in stopped.value.message
    log = server.log.read_text()
    assert "SIGINT: stopping; the requests held end now (0 finding their prefix, 0 waiting, 1 generating)" in log
    assert "calibration" not in log and "ERROR" not in log and "Traceback" not in log, log


def test_a_stop_abandons_a_prefill_within_a_chunk(tiny, tiny_fp):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, MeshPromptCache(tiny_fp, None))
    job = engine.submit(Job(list(range(1, 8001)), 4))  # 8,000 prompt tokens: 16 chunks of PREFILL_STEP
    assert isinstance(job.events.get(timeout=60), Started)  # the prefill starts now
    engine.stop()
    assert isinstance(job.events.get(timeout=60), Abandoned)  # (told at once)
    assert engine.close(timeout=60)  # the generation thread ends (a chunk on a loaded machine may take seconds)
    # ...having abandoned the prefill: had it gone on to the end, memory would hold the prompt's cache.
    assert engine.prompt_cache.memory.nearest(None, job.tokens)[1] == 0


@pytest.mark.slow
def test_a_hub_models_context_length_is_checked_too(tiny_dir, tmp_path, serving):
    # The tiny model as a cached Hugging Face repo, its context cut to 256 tokens.
    hub = tmp_path / "hub"
    snapshot = hub / "models--kvmesh-tests--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_dir, snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    (hub / "models--kvmesh-tests--tiny" / "refs").mkdir()
    (hub / "models--kvmesh-tests--tiny" / "refs" / "main").write_text("0" * 40)
    server = serving("hub", "kvmesh-tests/tiny", "--no-mesh", env={**ENV, "HF_HUB_CACHE": str(hub)})
    client = client_of(server.url)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="rivers " * 300, max_tokens=4)
    assert refused.value.code == "context_length_exceeded"
    assert client.completions.create(model="tiny", prompt="rivers", max_tokens=4).usage.completion_tokens == 4


@pytest.mark.slow
def test_one_log_line_per_request(tiny_dir, serving):
    server = serving("logged", tiny_dir, "--no-mesh")
    client = client_of(server.url)
    first = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
    client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
    server.stop()
    lines = [line for line in server.log.read_text().splitlines() if "kvmesh.serve.engine: request " in line]
    assert len(lines) == 2
    assert f"request 1: {first.usage.prompt_tokens} prompt tokens, 0 cached from none" in lines[0]
    assert f"{first.usage.prompt_tokens - 1} cached from memory" in lines[1]
    assert all(
        "3 generated (length, in a batch of up to 1); first token after " in line and "tokens/s" in line
        for line in lines
    )


@pytest.mark.slow
def test_lookups_hold_no_one_and_past_the_bound_a_429(tmp_path, app_server):
    # Each new prompt asks a frozen peer (SIGSTOP) and waits its idle timeout; meanwhile a request
    # that memory serves is answered at once, and past --max-requests requests get a 429.
    daemon = loopback_daemon(tmp_path / "peer")
    idle = 6.0
    server = app_server("b", peers=(daemon.address,), idle_timeout=idle, max_requests=3)
    client = server.openai()
    warm = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)  # in memory now
    os.kill(daemon.process.pid, signal.SIGSTOP)
    pool = ThreadPoolExecutor(3)
    try:
        start = time.monotonic()
        slow = pool.submit(client.completions.create, model="tiny", prompt="a new prompt", max_tokens=3)
        wait_for(lambda: held(server.url, "lookup") == 1, what="the first lookup")
        again = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
        assert time.monotonic() - start < idle / 2 and not slow.done(), "a lookup held the next request"
        assert again.choices[0].message.content == warm.choices[0].message.content
        assert again.usage.model_extra["kvmesh"]["prefix_from"] == "memory"
        others = [pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=3) for p in "xy"]
        wait_for(lambda: held(server.url, "lookup") == 3, what="three lookups")
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="one too many", max_tokens=3)
        assert refused.value.code == "rate_limit_exceeded" and refused.value.response.headers["retry-after"] == "1"
        assert time.monotonic() - start < idle, "the refusal waited"
        assert all(f.result(timeout=60).usage.completion_tokens == 3 for f in [slow, *others])
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
        daemon.stop()
        pool.shutdown()


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_its_place(app_server):
    server = app_server("one", max_requests=1)
    client = server.openai()
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4000, stream=True)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError):  # its one place is taken
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
    stream.close()
    # Its place is freed (the server noticed it left, within a token), and the next request taken.
    wait_for(lambda: sum(health(server.url)[1]["requests"].values()) == 0, what="the place freed")
    answer = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
    assert answer.usage.completion_tokens == 2


@pytest.mark.slow
def test_four_concurrent_clients_get_the_texts_of_one_at_a_time(app_server):
    server = app_server("many")
    prompts = [f"Client {c} asks question {q} about rivers." for c in range(4) for q in range(5)]

    def ask(client: openai.OpenAI, prompt: str, stream: bool) -> str:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            return (
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
                .choices[0]
                .message.content
            )
        chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = [ask(client_of(server.url), p, False) for p in prompts]
    barrier = threading.Barrier(4)

    def one_client(c: int) -> list[str]:
        client = client_of(server.url)
        barrier.wait()
        return [ask(client, prompts[c * 5 + q], (c + q) % 2 == 0) for q in range(5)]

    with ThreadPoolExecutor(4) as pool:
        together = [text for texts in pool.map(one_client, range(4)) for text in texts]
    assert together == alone
    stats = health(server.url)[1]["requests"]
    assert stats == {"lookup": 0, "waiting": 0, "generating": 0}
    server.stop()
    assert max(batch_sizes(server.log)) > 1, "no two requests were decoded together"


SYSTEM = "You answer questions about rivers, briefly and plainly. " * 24  # a long shared prefix
QUESTIONS = ["Where do rivers go?", "What is a delta?", "Why do rivers bend?", "What feeds a river?"]


def request_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "kvmesh.serve.engine: request " in line]


def concurrent_answers(url: str) -> list[str]:
    """Four clients at once, each asking one of QUESTIONS after the shared system prompt."""
    barrier = threading.Barrier(len(QUESTIONS))

    def ask(question: str) -> str:
        client = client_of(url)
        barrier.wait()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=16).choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(ask, QUESTIONS))


@pytest.mark.slow
def test_prefixes_from_the_store_and_a_peer_batch_as_one_made_here(tiny, tiny_fp, tmp_path, app_server):
    from kvmesh.caches.prefill import prefill
    from kvmesh.store import CacheStore
    from support.references import mlx_lm_text
    from support.stores import put

    model, tokenizer = tiny
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    # The system prompt's cache, as another Mac made it, in this Mac's store and in a peer's.
    for root in (tmp_path / "store" / "store", tmp_path / "peer" / "store"):
        put(CacheStore(root), prefill(model, prompts[0][:shared]).cache, tiny_fp, prompts[0][:shared], codec="none")
    expected = [mlx_lm_text(tiny, chat, max_tokens=16) for chat in chats]

    # From the store: each request's prefix is the stored cache, and they decode together.
    server = app_server("store")
    assert concurrent_answers(server.url) == expected
    server.stop()
    lines = request_lines(server.log)
    assert len(lines) == 4 and all("cached from local store" in line for line in lines), lines
    assert max(batch_sizes(server.log)) > 1, "the store's caches were not decoded together"

    # From a peer, the same.
    daemon = loopback_daemon(tmp_path / "peer")
    try:
        server = app_server("fetched", peers=(daemon.address,), fetch="always", store=False)
        assert concurrent_answers(server.url) == expected
        server.stop()
    finally:
        daemon.stop()
    lines = request_lines(server.log)
    assert len(lines) == 4 and all(f"cached from peer {daemon.address}" in line for line in lines), lines
    assert max(batch_sizes(server.log)) > 1, "the peer's caches were not decoded together"


@pytest.mark.slow
def test_a_request_that_must_run_alone_holds_no_batchable_one_behind_it(app_server):
    # A seeded request runs alone (mlx-lm's random state is one for a whole batch) and long; plain
    # requests that come meanwhile decode in the batch, between its tokens, and end first.
    server = app_server("alone")
    client = server.openai()
    ended: list[str] = []
    pool = ThreadPoolExecutor(4)

    def ask(name: str, **options) -> None:
        messages = [{"role": "user", "content": f"{name}: where do rivers go?"}]
        client.chat.completions.create(model="tiny", messages=messages, **options)
        ended.append(name)

    seeded = pool.submit(ask, "seeded", max_tokens=1500, seed=7, temperature=0.8)
    wait_for(lambda: held(server.url, "generating") == 1, what="the seeded request")
    plain = [pool.submit(ask, f"plain {i}", max_tokens=8) for i in range(3)]
    for future in [*plain, seeded]:
        future.result(timeout=300)
    pool.shutdown()
    assert ended[-1] == "seeded" and sorted(ended[:3]) == ["plain 0", "plain 1", "plain 2"]
    server.stop()
    assert sorted(batch_sizes(server.log))[0] == 0  # (the seeded one, alone)
