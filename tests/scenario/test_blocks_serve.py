"""A conversation through a `kvmesh serve` process (real HTTP, the official OpenAI client) stores
each block of its history once (#30): each turn's cache extends the last one's, so the store's
files hold about one copy, where whole entries held one per turn. And the answer never waits for
that write: the store keeps the cache after the answer is out."""

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvmesh.store import CacheStore
from kvmesh.store.index import INDEX
from support.daemons import start_server
from support.waiting import wait_for

SYSTEM = "You answer questions about rivers, briefly and plainly. " * 24  # about 300 tokens
QUESTIONS = [
    "Where do rivers go?",
    "What is a delta?",
    "Why do rivers bend?",
    "What is an oxbow lake?",
    "How old is the Nile?",
]


def kept(log: Path) -> int:
    """How many caches the server has said it kept in its store."""
    return log.read_text().count("kvmesh.serve.engine: kept request")


@contextlib.contextmanager
def index_held_by_another_writer(store: Path) -> Iterator[None]:
    """The store's index locked for writing, as another process's long write holds it (readers go on:
    the index is in WAL mode)."""
    db = sqlite3.connect(store / INDEX, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        yield
        db.execute("ROLLBACK")
    finally:
        db.close()


@pytest.mark.slow  # (five generations over HTTP)
def test_a_five_turn_conversation_stores_each_history_block_once(tiny_dir, tmp_path):
    log = tmp_path / "serve.log"
    server = start_server(tmp_path / "s", tiny_dir, "--no-mesh", "--min-store-tokens", 128, log=log)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}]
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        wait_for(lambda: kept(log) == len(QUESTIONS), 60, what="every turn's cache in the store")
    finally:
        server.stop()
    store = CacheStore(tmp_path / "s" / "store", max_bytes=None)
    entries = store.entries()
    assert len(entries) == len(QUESTIONS)
    whole = sum(e.file_bytes for e in entries)  # each turn's entry as a whole copy
    on_disk = sum(p.stat().st_size for p in store.entries_dir.glob("*.kvc"))
    assert on_disk == store.total_bytes()
    # Turns of about 300 to 420 tokens: a whole copy each would be five; by blocks the store keeps
    # the last turn, and the partial last block of each earlier one.
    assert on_disk < whole / 2.5, (on_disk, whole, [e.num_tokens for e in entries])


@pytest.mark.slow
def test_an_answer_is_out_before_its_cache_is_written(tiny_dir, tmp_path):
    log = tmp_path / "serve.log"
    server = start_server(tmp_path / "s", tiny_dir, "--no-mesh", "--min-store-tokens", 128, log=log)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        with index_held_by_another_writer(tmp_path / "s" / "store"):
            # No write can reach the store now; the whole answer comes all the same.
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
            assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 24
            # Nor does the next request wait for it: generation goes on beside the pending write.
            other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
            second = client.chat.completions.create(model="tiny", messages=other, max_tokens=24)
            assert second.usage.completion_tokens == 24
            assert kept(log) == 0
        # The writes waited for the index, and land once it is free.
        wait_for(lambda: kept(log) == 2, 60, what="both caches kept in the store")
    finally:
        server.stop()
    first, then = CacheStore(tmp_path / "s" / "store", max_bytes=None).entries()  # in the order written
    # Each conversation so far, answer and all.
    assert first.num_tokens >= answer.usage.prompt_tokens and then.num_tokens >= second.usage.prompt_tokens
