#!/usr/bin/env python3
"""An agent-like workload against two `kvmesh serve` processes in one mesh, with sharing on and off.

    scripts/dev run python scripts/bench_serve.py [--workload chat|agent] [--conversations 3] [--turns 3]
        [--prefix-tokens 1500] [--clients 1,2,4] [--requests 6]

Conversations share a long system prompt plus a document; each has a few turns, alternating between
servers A and B. The agent workload is a coding agent's: tool definitions in the prompt, and a
history that grows by a tool call and its result each step (the tiny-tools model, whose template
renders tools). With sharing on, each server asks the other's daemon for prefixes it lacks; with
sharing off, each has only its own memory. Per request: time to first token (streamed), cached
tokens and their source. Overall: prefill tokens saved and TTFT p50/p95 of both runs, and for
requests served from the peer, TTFT against fetch time + the suffix's prefill time (measured here in
process from a local cache of the same prefix), whose target is at most +10%. Then a concurrency
row: N clients at once (each sending `--requests` streamed requests of their own to one server),
their throughput (completion tokens a second, all clients together) and TTFT p50/p95. Offline (the
tiny test models), loopback only.

    scripts/dev run python scripts/bench_serve.py --batching 8 [--model real] [--max-tokens 32]

instead measures whether caches from elsewhere batch: N chat clients at once, each with its own
question after one long system prompt, against the same N one after another, with the system
prompt's cache made here (memory), in the local store, or on a peer (a daemon's store): a fresh
server for each run, and the seconds of both and their ratio for each source. `--model real` runs
it on SmolLM2-135M-Instruct (float32; OpenBLAS preloaded where installed).

    scripts/dev run python scripts/bench_serve.py --blocks 20 [--model real]

instead measures caches by blocks (#30): an agent session of that many turns through one server
(each turn the last one's history, its answer and a page of tool output), then the bytes its store
holds against the sum of each turn's whole copy, and the chunk bytes on the wire when a peer that
holds the second-to-last turn fetches the last one from that store (a real gRPC server over it)
against the whole cache's.

    scripts/dev run python scripts/bench_serve.py --beside 3 [--max-tokens 256]

instead measures whether a fetch slows beside a generation in the same server: a peer's daemon holds
transform-coded caches (the default level) of several system prompts (windows of the Declaration,
700-860 tokens each), and one server (its first fetch brings the basis) fetches each, in turn alone
and while another request, with nothing cached, streams `--max-tokens` tokens: the fetch's seconds
(the server's `prefix_s`) both ways. The decoder's threads need the GIL between their NumPy, zstd
and MLX calls, and the generation thread holds it while it builds each step's graph. On
SmolLM2-135M-Instruct (float32).
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import openai
from mlx_lm.generate import generation_stream
from rich.console import Console
from rich.table import Table

from kvmesh.caches.prefill import generate_from_cache, prefill
from kvmesh.daemon.control import DaemonProcess
from kvmesh.model.testmodels import make_test_model
from support.daemons import ServerProcess, loopback_daemon, start_server

# The agent workload's tools, as an OpenAI-client agent sends them on every step.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for name, description in (
        ("read_file", "Read a file of the repository and return its text."),
        ("list_directory", "List the entries of a directory of the repository."),
        ("run_tests", "Run the tests under a path and return their output."),
    )
]


def agent_step(messages: list[dict], corpus: str, c: int, t: int) -> None:
    """What an agent appends after a step: the model's tool call (as the agent got it back) and the
    tool's result, a page of text."""
    call_id = f"call_{c}_{t}"
    arguments = json.dumps({"path": f"src/module_{c}_{t}.py"})
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": arguments}}
            ],
        }
    )
    page = corpus[(c * 7 + t) * 1200 : (c * 7 + t) * 1200 + 1200]
    messages.append({"role": "tool", "tool_call_id": call_id, "content": page})


def until_ready(server: ServerProcess, timeout: float = 300.0) -> None:
    """Wait for /health to say ok (a server calibrates its prefill rate first): the figures are the
    requests', not the calibration's."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{server.url.removesuffix('/v1')}/health", timeout=10) as answer:
                if answer.status == 200:
                    return
        except urllib.error.HTTPError:  # 503 "starting"
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.url} did not become ready")
        time.sleep(0.1)


def run(
    root: Path,
    model: Path,
    share: bool,
    conversations: int,
    turns: int,
    system: str,
    agent: str | None = None,
) -> list[dict]:
    """Rows of one run; with `agent` (the corpus for tool results), the agent workload."""
    daemons: list[DaemonProcess] = []
    processes: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            daemons.append(loopback_daemon(root / name))
        servers = {}
        for i, name in enumerate(("a", "b")):
            peer = daemons[1 - i].address
            mesh = ["--peer", peer] if share else ["--no-mesh", "--no-store"]
            server = start_server(root / name, model, "--min-store-tokens", 256, *mesh, log=root / f"{name}.serve.log")
            servers[name] = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            processes.append(server)
        for server in processes:
            until_ready(server)
        rows = []
        for c in range(conversations):
            messages = [{"role": "system", "content": system}]
            if agent is not None:
                messages.append({"role": "user", "content": f"Task {c}: find why the tests of module {c} fail."})
            for t in range(turns):
                name = "ab"[(c + t) % 2]
                if agent is None:
                    messages.append({"role": "user", "content": f"Question {t} of reader {c}: what happens next?"})
                start = time.perf_counter()
                first_at, text, usage = None, [], None
                for chunk in servers[name].chat.completions.create(
                    model=model.name,
                    messages=messages,
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                    **({"tools": TOOLS} if agent is not None else {}),
                ):
                    if chunk.choices and chunk.choices[0].delta.content and first_at is None:
                        first_at = time.perf_counter()
                    if chunk.choices:
                        text.append(chunk.choices[0].delta.content or "")
                    elif chunk.usage:
                        usage = chunk.usage
                assert usage is not None
                mesh = usage.model_extra["kvmesh"]
                rows.append(
                    {
                        "server": name,
                        "conversation": c,
                        "turn": t,
                        "ttft": (first_at or time.perf_counter()) - start,
                        "prompt": usage.prompt_tokens,
                        "cached": usage.prompt_tokens_details.cached_tokens,
                        "source": mesh["prefix_from"],
                        "messages": list(messages),
                        "fetch_s": mesh["prefix_s"],
                    }
                )
                if agent is not None:
                    agent_step(messages, agent, c, t)
                else:
                    messages.append({"role": "assistant", "content": "".join(text)})
        return rows
    finally:
        for server in processes:
            server.stop()
        for daemon in daemons:
            daemon.stop()


def streamed_request(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, *, started: threading.Event | None = None
) -> tuple[float, int]:
    """(TTFT, completion tokens) of one streamed chat request; `started` is set at its first token."""
    start = time.perf_counter()
    first_at, usage = None, None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content and first_at is None:
            first_at = time.perf_counter()
            if started is not None:
                started.set()
        elif chunk.usage:
            usage = chunk.usage
    assert usage is not None
    return (first_at or time.perf_counter()) - start, usage.completion_tokens


def concurrency(root: Path, model: Path, clients: list[int], requests: int, max_tokens: int) -> list[dict]:
    """Per client count: N clients at once, `requests` streamed requests each (distinct prompts)."""
    server = start_server(root / "concurrency", model, "--no-mesh", "--no-store", log=root / "concurrency.serve.log")
    rows = []
    try:
        for n in clients:
            barrier = threading.Barrier(n)

            def one_client(i: int, n: int = n, barrier: threading.Barrier = barrier) -> list[tuple[float, int]]:
                client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
                barrier.wait()
                return [
                    streamed_request(client, model.name, f"Client {i} of {n}, request {r}: tell a story.", max_tokens)
                    for r in range(requests)
                ]

            start = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                results = [x for xs in pool.map(one_client, range(n)) for x in xs]
            wall = time.perf_counter() - start
            ttft = sorted(t for t, _ in results)
            rows.append(
                {
                    "clients": n,
                    "requests": len(results),
                    "tokens": sum(k for _, k in results),
                    "seconds": wall,
                    "p50": statistics.median(ttft),
                    "p95": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
                }
            )
    finally:
        server.stop()
    return rows


def batching(root: Path, model: Path, clients: int, max_tokens: int, system: str) -> list[dict]:
    """Per source of the system prompt's cache: `clients` requests at once and one after another."""
    from kvmesh.caches.prefill import prefill as prefill_cache
    from kvmesh.model.fingerprint import fingerprint
    from kvmesh.store import CacheStore
    from support.stores import put

    loaded, tokenizer = mlx_lm.load(str(model))[:2]
    questions = [f"Reader {i} asks: what does part {i} of the document say?" for i in range(2 * clients)]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    cache = prefill_cache(loaded, prompts[0][:shared]).cache
    for where in ("store", "peer"):
        put(CacheStore(root / where / "store"), cache, fingerprint(model), prompts[0][:shared], codec="none")
    rows = []
    for source in ("memory", "store", "peer"):
        timings = {}
        for mode, asked in (("one after another", chats[:clients]), ("at once", chats[clients:])):
            daemon = loopback_daemon(root / "peer") if source == "peer" else None
            options = ["--peer", daemon.address, "--fetch", "always", "--no-store"] if daemon else ["--no-mesh"]
            data = root / f"{source}-{mode.replace(' ', '-')}"
            if source == "store":  # (a copy each run: one run's own caches are not the next one's)
                shutil.copytree(root / "store" / "store", data / "store")
            server = start_server(data, model, *options, log=root / f"{data.name}.serve.log")
            try:
                until_ready(server)
                client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=1800)
                if source == "memory":  # the system prompt prefilled here first, as a warm server has it
                    client.chat.completions.create(model=model.name, messages=chats[0], max_tokens=1)

                def ask(chat: list[dict], client: openai.OpenAI = client) -> str:
                    answer = client.chat.completions.create(model=model.name, messages=chat, max_tokens=max_tokens)
                    return answer.usage.model_extra["kvmesh"]["prefix_from"]

                start = time.perf_counter()
                if mode == "at once":
                    with ThreadPoolExecutor(clients) as pool:
                        froms = list(pool.map(ask, asked))
                else:
                    froms = [ask(chat) for chat in asked]
                timings[mode] = (time.perf_counter() - start, froms)
            finally:
                server.stop()
                if daemon is not None:
                    daemon.stop()
        rows.append({"source": source, **timings})
    return rows


def blocks(root: Path, model: Path, turns: int, system: str, pages: str) -> dict:
    """The figures of `--blocks`: an agent session's store bytes, then a follow-up turn's wire bytes."""
    from kvmesh.codec.compat import ReceiverProfile
    from kvmesh.codec.decode import CacheDecoder
    from kvmesh.model.fingerprint import FileHashCache, fingerprint
    from kvmesh.net.client import PeerClient
    from kvmesh.net.server import start_server as start_peer
    from kvmesh.store import CacheStore

    server = start_server(root / "a", model, "--min-store-tokens", 256, "--no-mesh", log=root / "a.serve.log")
    try:
        until_ready(server)
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            at = t * 600 % max(1, len(pages) - 600)  # (the corpus's pages again once they run out)
            page = pages[at : at + 600]
            messages.append({"role": "user", "content": f"Step {t}: the tool returned this page.\n{page}"})
            answer = client.chat.completions.create(model=model.name, messages=messages, max_tokens=8)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    finally:
        server.stop()  # (its store writes are done once it has stopped)
    store = CacheStore(root / "a" / "store", max_bytes=None)
    entries = sorted(store.entries(), key=lambda e: e.num_tokens)
    on_disk = sum(p.stat().st_size for p in store.entries_dir.glob("*.kvc"))
    figures: dict[str, Any] = {"entries": len(entries), "on_disk": on_disk, "whole": sum(e.file_bytes for e in entries)}
    # A peer that holds the second-to-last turn fetches the last one from a server over that store.
    peer = start_peer(store, "bench", "127.0.0.1:0")
    receiver = CacheStore(root / "b", max_bytes=None)
    profile = ReceiverProfile(fingerprint(model, FileHashCache(root / "hashes.sqlite3")))
    try:
        with PeerClient(f"127.0.0.1:{peer.port}") as peer_client:
            for entry, held_from in ((entries[-2], None), (entries[-1], receiver)):
                with peer_client.fetch(entry.cache_id, profile, held_from=held_from) as transfer:
                    decoder = CacheDecoder(transfer.manifest, {})
                    receiver.add(transfer.manifest, decoder.feed_iter(transfer.chunks()))
                    figures["wire"], figures["whole_wire"] = (
                        transfer.wire_bytes,
                        transfer.manifest.encoding.encoded_bytes,
                    )
        figures["tokens"] = (entries[-2].num_tokens, entries[-1].num_tokens)
    finally:
        peer.stop(grace=0)
    return figures


def main_blocks(args: argparse.Namespace) -> int:
    corpus = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    system = "You are a coding agent. Read the tool output, say what to do next.\n" + corpus[: args.prefix_tokens * 4]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-blocks-") as tmp:
        root = Path(tmp)
        model = bench_model(args, root)
        if model is None:
            return 1
        f = blocks(root, model, args.blocks, system, corpus)
    print(
        f"{args.blocks}-turn agent session through serve ({model.name}): the store holds {f['entries']} entries in "
        f"{f['on_disk']:,} bytes on disk, against {f['whole']:,} as whole copies "
        f"({f['whole'] / f['on_disk']:.1f}x less)"
    )
    held, last = f["tokens"]
    print(
        f"a follow-up turn ({last:,} tokens) fetched by a peer that holds the turn before ({held:,} tokens): "
        f"{f['wire']:,} chunk bytes on the wire, against {f['whole_wire']:,} for the whole cache "
        f"({f['wire'] / f['whole_wire']:.1%})"
    )
    return 0


def bench_model(args: argparse.Namespace, root: Path) -> Path | None:
    """The model `--model` names: the tiny one, built under `root`, or the real one (None, said
    why, when it is not installed)."""
    if args.model != "real":
        return make_test_model(root / "tiny", "tiny")
    from support.real_model import MISSING, fast_blas, smollm2_dir

    if MISSING:
        print(MISSING, file=sys.stderr)
        return None
    fast_blas()
    return smollm2_dir()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=1500, help="about this many shared tokens")
    parser.add_argument("--workload", choices=("chat", "agent"), default="chat")
    parser.add_argument("--clients", default="1,2,4", help="client counts of the concurrency row ('' for none)")
    parser.add_argument("--requests", type=int, default=6, help="requests of each client in the concurrency row")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the concurrency row's requests")
    parser.add_argument("--batching", type=int, default=0, help="measure only whether caches from elsewhere batch")
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny", help="--batching's and --blocks' model")
    parser.add_argument("--blocks", type=int, default=0, help="measure only caches by blocks, over this many turns")
    parser.add_argument(
        "--beside", type=int, default=0, help="measure only a coded fetch alone and beside a generation, rounds"
    )
    args = parser.parse_args()
    if args.beside:
        return main_beside(args)
    if args.batching:
        return main_batching(args)
    if args.blocks:
        return main_blocks(args)
    agent = args.workload == "agent"
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-serve-") as tmp:
        root = Path(tmp)
        model = make_test_model(root / "tiny", "tiny-tools" if agent else "tiny")
        corpus = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
        if agent:
            system = (
                "You are a coding agent. Use the tools to read the repository.\n" + corpus[: args.prefix_tokens * 4]
            )
        else:
            system = "You are a careful reader. Answer from this document.\n" + corpus[: args.prefix_tokens * 4]
        tool_pages = corpus[args.prefix_tokens * 4 :] if agent else None
        results = {}
        for share in (True, False):
            results[share] = run(
                root / ("on" if share else "off"), model, share, args.conversations, args.turns, system, tool_pages
            )
        clients = [int(n) for n in args.clients.split(",") if n]
        rows = concurrency(root, model, clients, args.requests, args.max_tokens) if clients else []
        # The suffix's prefill on this machine, measured directly: each peer-served request's cached
        # prefix prefilled here, then the time to the first token from the rest of its prompt.
        loaded, tokenizer = mlx_lm.load(str(model))[:2]
        for r in results[True]:
            if r["source"].startswith("peer"):
                extra = {"tools": TOOLS} if agent else {}
                tokens = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, **extra)
                cache = prefill(loaded, tokens[: r["cached"]]).cache
                start = time.perf_counter()
                next(generate_from_cache(loaded, cache, tokens[r["cached"] :], max_tokens=1))
                r["suffix_s"] = time.perf_counter() - start
                mx.synchronize(generation_stream)  # mlx-lm's next token, still computing (bench_shaped says why)

    console = Console(width=120)
    table = Table(title=f"requests with sharing on ({args.workload} workload)")
    for column in ("server", "conv", "turn", "prompt", "cached", "source", "fetch s", "TTFT s", "TTFT off s"):
        table.add_column(column, justify="right")
    for on, off in zip(results[True], results[False], strict=True):
        table.add_row(
            on["server"],
            str(on["conversation"]),
            str(on["turn"]),
            str(on["prompt"]),
            str(on["cached"]),
            on["source"],
            f"{on['fetch_s']:.3f}",
            f"{on['ttft']:.3f}",
            f"{off['ttft']:.3f}",
        )
    console.print(table)
    for share, label in ((True, "sharing on"), (False, "sharing off")):
        ttft = sorted(r["ttft"] for r in results[share])
        saved = sum(r["cached"] for r in results[share])
        p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
        print(
            f"{label}: prefill tokens saved {saved:,} of {sum(r['prompt'] for r in results[share]):,}; "
            f"TTFT p50 {statistics.median(ttft):.3f} s, p95 {p95:.3f} s"
        )
    peer = [r for r in results[True] if r["source"].startswith("peer")]
    for r in peer:
        bound = r["fetch_s"] + r["suffix_s"]
        print(
            f"from the peer: conversation {r['conversation']} turn {r['turn']}: TTFT {r['ttft']:.3f} s against "
            f"fetch {r['fetch_s']:.3f} s + suffix prefill to first token {r['suffix_s']:.3f} s = {bound:.3f} s "
            f"({r['ttft'] / bound:.2f}x; target <= 1.10x)"
        )
    if rows:
        table = Table(title=f"concurrency: {args.requests} streamed requests per client, max_tokens {args.max_tokens}")
        for column in ("clients", "requests", "tokens", "seconds", "tokens/s", "TTFT p50 s", "TTFT p95 s"):
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(
                str(row["clients"]),
                str(row["requests"]),
                str(row["tokens"]),
                f"{row['seconds']:.2f}",
                f"{row['tokens'] / row['seconds']:.1f}",
                f"{row['p50']:.3f}",
                f"{row['p95']:.3f}",
            )
        console.print(table)
    return 0


STORY = "Write a long story about a lighthouse keeper and the sea."


def coded_system_prompts(store_dir: Path, model: Path, count: int, text: str) -> list[list[dict]]:
    """`count` chats, each a system prompt (a window of `text`) and a question, the system prompt's
    cache transform coded at the default level in the store at `store_dir`, with the model's basis."""
    from kvmesh.codec.calibration import fit_model_basis
    from kvmesh.codec.coded import TransformCoding, transform_code
    from kvmesh.codec.encode import encode_cache
    from kvmesh.codec.levels import LEVELS
    from kvmesh.model.fingerprint import fingerprint
    from kvmesh.store import CacheStore
    from kvmesh.store.artifacts import artifact_store

    loaded, tokenizer = mlx_lm.load(str(model))[:2]
    fp = fingerprint(model)
    basis = fit_model_basis(loaded, tokenizer).basis
    store = CacheStore(store_dir)
    artifact_store(store.root).put(basis.to_bytes(), basis.digest)
    coding = TransformCoding.at_level(basis, LEVELS["default"])
    chats = []
    for i in range(count):
        system = [
            {"role": "system", "content": f"Reader {i}: answer from this document.\n{text[i * 500 : i * 500 + 4000]}"}
        ]
        prefix = tokenizer.apply_chat_template(system)
        store.add(*encode_cache(transform_code(prefill(loaded, prefix).cache, coding), fp, prefix))
        chats.append([*system, {"role": "user", "content": "What is the document about?"}])
    return chats


def fetched(client: openai.OpenAI, model: str, chat: list[dict]) -> dict:
    """What the server says of the prefix it took for `chat` (kvmesh's usage), and its cached tokens."""
    answer = client.chat.completions.create(model=model, messages=chat, max_tokens=1)
    return {**answer.usage.model_extra["kvmesh"], "cached": answer.usage.prompt_tokens_details.cached_tokens}


def fetched_beside_a_generation(client: openai.OpenAI, model: str, chat: list[dict], max_tokens: int) -> dict:
    """`fetched` for `chat` once another request's stream has begun; with when that stream ended
    (after the fetch, or not) and its tokens."""
    started, ended = threading.Event(), []

    def generate() -> None:
        tokens = 0
        try:
            tokens = streamed_request(client, model, STORY, max_tokens, started=started)[1]
        finally:
            started.set()  # (a request that failed fails the round below, rather than hanging it)
            ended.append((time.perf_counter(), tokens))

    thread = threading.Thread(target=generate)
    thread.start()
    started.wait(timeout=600)
    row = fetched(client, model, chat)
    fetch_ended = time.perf_counter()
    thread.join()
    [(generation_ended, tokens)] = ended
    if not tokens:
        raise RuntimeError("the generation beside the fetch streamed nothing")
    return {**row, "generation_went_on": generation_ended > fetch_ended, "generated": tokens}


def beside(root: Path, model: Path, rounds: int, max_tokens: int, text: str) -> list[dict]:
    """Per round, a coded cache's fetch alone and one beside a streamed generation, in one server
    (its first fetch, which brings the basis, is not counted)."""
    chats = coded_system_prompts(root / "peer" / "store", model, 1 + 2 * rounds, text)
    daemon = loopback_daemon(root / "peer")
    server = start_server(root / "server", model, "--peer", daemon.address, "--fetch", "always", "--no-store",
                          log=root / "server.log")  # fmt: skip
    try:
        until_ready(server)
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        fetched(client, model.name, chats[0])
        return [
            {
                "alone": fetched(client, model.name, chats[1 + 2 * r]),
                "beside": fetched_beside_a_generation(client, model.name, chats[2 + 2 * r], max_tokens),
            }
            for r in range(rounds)
        ]
    finally:
        server.stop()
        daemon.stop()


def main_beside(args: argparse.Namespace) -> int:
    from support.real_model import MISSING, fast_blas, smollm2_dir

    if MISSING:
        print(MISSING, file=sys.stderr)
        return 1
    fast_blas()
    text = (Path(__file__).parent / "data" / "declaration.txt").read_text()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-beside-") as tmp:
        rows = beside(Path(tmp), smollm2_dir(), args.beside, args.max_tokens, text)
    table = Table(
        title=f"a coded cache's fetch in `kvmesh serve`, alone and beside a generation ({args.max_tokens} tokens)"
    )
    for column in ("round", "cached tokens", "alone s", "beside s", "x slower", "from", "generation went on"):
        table.add_column(column, justify="right")
    for i, row in enumerate(rows):
        alone, with_it = row["alone"], row["beside"]
        table.add_row(
            str(i),
            f"{alone['cached']} / {with_it['cached']}",
            f"{alone['prefix_s']:.3f}",
            f"{with_it['prefix_s']:.3f}",
            f"{with_it['prefix_s'] / alone['prefix_s']:.2f}x",
            f"{alone['prefix_from']} / {with_it['prefix_from']}",
            f"{'yes' if with_it['generation_went_on'] else 'no'} ({with_it['generated']} tokens)",
        )
    Console(width=160).print(table)
    return 0


def main_batching(args: argparse.Namespace) -> int:
    if args.model == "real":
        from support.real_model import MISSING, fast_blas, smollm2_dir

        if MISSING:
            print(MISSING, file=sys.stderr)
            return 1
        fast_blas()
    corpus = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    system = "You are a careful reader. Answer from this document.\n" + corpus[: args.prefix_tokens * 4]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-batching-") as tmp:
        root = Path(tmp)
        model = smollm2_dir() if args.model == "real" else make_test_model(root / "tiny", "tiny")
        rows = batching(root, model, args.batching, args.max_tokens, system)
    table = Table(
        title=f"{args.batching} chat clients on one system prompt ({model.name}, max_tokens {args.max_tokens})"
    )
    for column in ("system prompt's cache", "one after another s", "at once s", "at once: x faster", "prefixes from"):
        table.add_column(column, justify="right")
    for row in rows:
        (alone, froms), (together, froms_at_once) = row["one after another"], row["at once"]
        table.add_row(
            row["source"],
            f"{alone:.2f}",
            f"{together:.2f}",
            f"{alone / together:.2f}x",
            ", ".join(sorted({f.split(" ")[0] for f in froms + froms_at_once})),
        )
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
