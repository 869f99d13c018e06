"""A conversation through a `kvmesh serve` process (real HTTP, the official OpenAI client) stores
each block of its history once (#30): each turn's cache extends the last one's, so the store's
files hold about one copy, where whole entries held one per turn."""

import openai
import pytest

from kvmesh.store import CacheStore
from support.daemons import start_server

SYSTEM = "You answer questions about rivers, briefly and plainly. " * 24  # about 300 tokens
QUESTIONS = [
    "Where do rivers go?",
    "What is a delta?",
    "Why do rivers bend?",
    "What is an oxbow lake?",
    "How old is the Nile?",
]


@pytest.mark.slow  # (five generations over HTTP)
def test_a_five_turn_conversation_stores_each_history_block_once(tiny_dir, tmp_path):
    server = start_server(tmp_path / "s", tiny_dir, "--no-mesh", "--min-store-tokens", 128, log=tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}]
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
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
