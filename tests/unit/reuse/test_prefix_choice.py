"""Which cached prefix serves a prompt: among caches of one length the least lossy (a lossy cache
whose loss nobody measured never beats one whose loss is known), in the local store and across
peers; and the server's memory tier, mlx-lm's `LRUPromptCache`, never serving a cache trimmed short."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvmesh.caches.kinds import cached_tokens, trims_exactly
from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.compat import AS_GOOD_KL, loss_rank
from kvmesh.codec.encode import encode_cache
from kvmesh.net.server import start_server
from kvmesh.reuse.find import candidate_loss_rank, find_prefix
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from support.references import greedy_tokens, tokens_after

LENGTH = 256


def keep(store: CacheStore, model, fp, tokens: list[int], bits: int, *, measured: bool) -> pb.CacheManifest:
    """A `bits`-bit quantized cache of `tokens` in `store`, with its loss measured or not."""
    press = make_press("quantize", {"kv_bits": bits})
    pressed = prefill(model, tokens, press)
    loss = pressed.tail_kl if measured else None
    return store.add(*encode_cache(pressed.cache, fp, tokens, press, tail_kl=loss))


def test_loss_rank_puts_unmeasured_lossy_caches_last():
    assert loss_rank(False, None) == 0.0 == loss_rank(True, AS_GOOD_KL)  # as good as lossless
    assert 0.0 < loss_rank(True, 0.05) < loss_rank(True, 0.3) < loss_rank(True, None)
    # An older peer sends no `lossy`: a press other than "full" says so.
    assert candidate_loss_rank(spb.Candidate(method="quantize")) == float("inf")
    measured = spb.Candidate(method="quantize", lossy=True, quality=pb.Quality(metric="tail_kl", value=0.001))
    assert candidate_loss_rank(measured) == 0.0


def test_the_store_serves_the_measured_cache_before_a_smaller_unmeasured_one(tiny, tiny_fp, prompt_ids, tmp_path):
    model, _ = tiny
    tokens = prompt_ids[:LENGTH]
    store = CacheStore(tmp_path / "store")
    three = keep(store, model, tiny_fp, tokens, 3, measured=False)
    eight = keep(store, model, tiny_fp, tokens, 8, measured=True)
    assert three.encoding.encoded_bytes < eight.encoding.encoded_bytes  # the old tie-break took the 3-bit one
    match = store.lookup(tiny_fp.model_id, prompt_ids)
    assert match is not None and (match.entry.cache_id, match.tokens) == (eight.cache_id, LENGTH)
    assert match.entry.lossy and match.entry.loss == pytest.approx(eight.quality.value)


def test_a_peer_with_a_measured_cache_wins_over_one_with_an_unmeasured_one(tiny, tiny_fp, prompt_ids, tmp_path):
    """The trial's case: a 3-bit cache without a measured loss taken ahead of an 8-bit one."""
    model, _ = tiny
    tokens = prompt_ids[:LENGTH]
    stores = {name: CacheStore(tmp_path / name) for name in ("three", "eight")}
    keep(stores["three"], model, tiny_fp, tokens, 3, measured=False)
    eight = keep(stores["eight"], model, tiny_fp, tokens, 8, measured=True)
    servers = {name: start_server(store, name) for name, store in stores.items()}
    try:
        addresses = {name: f"127.0.0.1:{s.port}" for name, s in servers.items()}
        for order in (["three", "eight"], ["eight", "three"]):
            found = find_prefix(tiny_fp, prompt_ids, None, peers=[addresses[n] for n in order])
            assert (found.where, found.tokens, found.cache_id) == (f"peer {addresses['eight']}", LENGTH, eight.cache_id)
    finally:
        for s in servers.values():
            s.stop()


def test_memory_is_mlx_lm_s_prompt_cache_bounded_in_number(tiny, tiny_fp, prompt_ids):
    model, _ = tiny
    memory = MeshPromptCache(tiny_fp, None, max_caches=2)
    prompts = [prompt_ids[i * 40 : i * 40 + 30] for i in range(3)]  # three unrelated prompts
    for p in prompts:
        memory.insert(p, prefill(model, p).cache)
    assert len(memory.memory) == 2
    assert memory.fetch([*prompts[0], 7]).where == "none"  # the least recently used went first
    for p in prompts[1:]:
        hit = memory.fetch([*p, 7])
        assert (hit.where, hit.tokens, cached_tokens(hit.cache)) == ("memory", len(p), len(p))


def test_memory_keeps_recently_served_caches_and_the_newest_over_its_budget(tiny, tiny_fp, prompt_ids):
    model, _ = tiny
    prompts = [prompt_ids[i * 40 : i * 40 + 30] for i in range(4)]
    caches = [prefill(model, p).cache for p in prompts]
    memory = MeshPromptCache(tiny_fp, None, max_caches=2)
    memory.insert(prompts[0], caches[0])
    memory.insert(prompts[1], caches[1])
    assert memory.fetch([*prompts[0], 7]).where == "memory"  # served: now the most recently used
    memory.insert(prompts[2], caches[2])
    assert [memory.fetch([*p, 7]).where for p in prompts[:3]] == ["memory", "none", "memory"]
    # One cache larger than the whole budget: kept alone (mlx-lm's own would evict all, then it).
    small = MeshPromptCache(tiny_fp, None, max_bytes=sum(c.nbytes for c in caches[3]) - 1)
    small.insert(prompts[0], caches[0])
    small.insert(prompts[3], caches[3])
    assert len(small.memory) == 1 and small.fetch([*prompts[3], 7]).where == "memory"


def test_memory_leaves_one_token_to_feed_and_trims_a_copy(tiny, tiny_fp, prompt_ids):
    model, _ = tiny
    memory = MeshPromptCache(tiny_fp, None)
    prompt = prompt_ids[:100]
    memory.insert(prompt, prefill(model, prompt).cache)
    again = memory.fetch(prompt)  # the same prompt again: one token is left to feed
    assert (again.tokens, cached_tokens(again.cache)) == (99, 99)
    shorter = memory.fetch([*prompt[:60], 5])  # a prompt that leaves the entry at 60: a trimmed copy
    assert (shorter.tokens, cached_tokens(shorter.cache)) == (60, 60)
    assert cached_tokens(memory.fetch(prompt).cache) == 99  # the entry itself is untouched
    assert tokens_after(model, shorter.cache, [5], 4) == greedy_tokens(model, [*prompt[:60], 5], 4)


def test_memory_never_serves_a_sparse_cache_trimmed_short(tiny, tiny_fp, prompt_ids):
    """A pressed cache from a peer can trim only the positions appended after its evictions: a
    prompt that leaves it earlier is not served from it (mlx-lm's `is_trimmable` says yes)."""
    model, _ = tiny
    base = prompt_ids[:200]
    cache = prefill(model, base, make_press("knorm", {"ratio": 0.5})).cache
    assert all(isinstance(c, SparseKVCache) and c.n_tail == 0 for c in cache)
    tail = prompt_ids[200:230]
    model(mx.array([tail]), cache=cache)  # a request's own tokens after the fetched prefix
    mx.eval([c.state for c in cache])
    assert all(c.is_trimmable() for c in cache) and trims_exactly(cache, 30) and not trims_exactly(cache, 31)
    memory = MeshPromptCache(tiny_fp, None)
    memory.insert([*base, *tail], cache)
    within = memory.fetch([*base, *tail[:10], 9])  # leaves it within what it appended: served
    assert (within.where, within.tokens, cached_tokens(within.cache)) == ("memory", 210, 210)
    before = memory.fetch([*base[:150], 9])  # leaves it inside the pressed part: not served
    assert before.where == "none" and before.cache is None


def test_trims_exactly_follows_each_kind():
    dense = KVCache()
    dense.update_and_fetch(mx.zeros((1, 2, 10, 4)), mx.zeros((1, 2, 10, 4)))
    assert trims_exactly([dense], 10) and not trims_exactly([dense], 11) and trims_exactly([], 3)
