"""Transform-coded caches between real daemons, as a user makes and fetches them: `kvmesh prefill
--compress` codes a cache (fitting the model's basis on first use), one daemon serves it, and a Mac
that never saw the basis fetches it first from that daemon, or refuses with the reason and receives
no cache byte."""

import json
import shutil

import mlx.core as mx
import pytest

from kvmesh.caches.kinds import fork
from kvmesh.net.client import PeerClient
from kvmesh.reuse.find import load_prefix
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store
from kvmesh.v1 import cache_pb2 as pb
from support.daemons import Daemons
from support.processes import cli
from support.waiting import wait_for

pytestmark = pytest.mark.slow

PROMPT = "The lighthouse keeper wrote down every ship that passed, and the weather, and the tide. " * 12


@pytest.fixture
def daemons():
    started = Daemons()
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def coded(tiny_dir, tmp_path_factory):
    """(store dir, cache id, basis sha256) of a cache `kvmesh prefill --compress` made (the tests
    only read that store, or copy it)."""
    store = tmp_path_factory.mktemp("coded") / "a-store"
    made = cli("prefill", tiny_dir, "--prompt", PROMPT, "--compress", "--store", store, "--json")
    result = json.loads(made.stdout)
    assert "calibrating the transform codec" in made.stderr
    assert result["compression"] == "full + transform" and result["tail_kl"] is not None
    manifest = CacheStore(store).manifest(result["cache_id"])
    (artifact,) = manifest.artifacts
    return store, result["cache_id"], artifact.sha256


def logits_after(model, cache, tokens):
    return model(mx.array(tokens)[None], cache=[fork(c) for c in cache])[0]


def test_a_fetch_brings_the_basis_first_and_decodes_as_the_sender_would(coded, tiny, tiny_dir, daemons, tmp_path):
    store_a, cache_id, basis = coded
    a = daemons.start(tmp_path / "a.data", "--store", store_a)
    store_b = tmp_path / "b-store"
    assert not artifact_store(store_b).has(basis)
    fetched = cli("fetch", cache_id, "--peer", a.address, "--model", tiny_dir, "--store", store_b)
    assert fetched.stdout.startswith(f"fetched {cache_id} from {a.address}")
    assert artifact_store(store_b).get(basis) == artifact_store(store_a).get(basis)
    theirs, ours = CacheStore(store_a), CacheStore(store_b)
    assert list(theirs.chunk_records(cache_id)) == list(ours.chunk_records(cache_id))
    n = ours.manifest(cache_id).prefix.num_tokens
    here, there = load_prefix(ours, cache_id, n), load_prefix(theirs, cache_id, n)
    model, tokenizer = tiny
    probe = tokenizer.encode(" The keeper", add_special_tokens=False)
    assert mx.array_equal(logits_after(model, here, probe), logits_after(model, there, probe))
    # The second daemon now holds the basis, so it takes a publish of another cache coded with it.
    b = daemons.start(tmp_path / "b.data", "--store", store_b)
    mine = tmp_path / "mine"
    shutil.copytree(store_a, mine)
    made = cli("prefill", tiny_dir, "--prompt", PROMPT + " And then", "--compress", "--store", mine, "--json")
    assert "calibrating" not in made.stderr  # the store's basis is used, not fitted again
    other = json.loads(made.stdout)["cache_id"]
    published = cli("publish", other, b.address, "--store", mine, data_dir=tmp_path / "me")
    assert published.stdout.endswith(f"stored there as {other}\n")


def test_without_the_basis_anywhere_the_cache_is_refused_with_its_reason(coded, tiny_dir, daemons, tmp_path):
    store_a, cache_id, basis = coded
    # A daemon that holds the cache but lost its basis: it cannot give it, so the receiver refuses.
    bare = tmp_path / "bare-store"
    shutil.copytree(store_a, bare)
    shutil.rmtree(bare / "artifacts")
    d = daemons.start(tmp_path / "d.data", "--store", bare)
    store_c = tmp_path / "c-store"
    result = cli("fetch", cache_id, "--peer", d.address, "--model", tiny_dir, "--store", store_c, check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("kvmesh: error: ") and result.stderr.count("\n") == 1
    assert "artifact" in result.stderr and f"basis {basis[:12]}" in result.stderr
    assert CacheStore(store_c).entries() == [] and not artifact_store(store_c).has(basis)
    with PeerClient(d.address) as client:
        stats = client.info().transfers
    assert stats.chunk_bytes_sent == 0 and stats.fetches_rejected == 1
    # A daemon without the basis refuses a publish of such a cache at once, and stores nothing (one
    # that holds the cache already is sent nothing: d answers so, tests/scenario/test_cli_transfers.py).
    empty = tmp_path / "e-store"
    e = daemons.start(tmp_path / "e.data", "--store", empty)
    published = cli("publish", cache_id, e.address, "--store", store_a, data_dir=tmp_path / "me", check=False)
    assert published.returncode == 1 and "lacks the basis" in published.stderr
    with PeerClient(e.address) as client:
        assert client.info().transfers.publishes_rejected == 1
    assert CacheStore(empty).entries() == []


def test_cache_show_prints_each_layer_codec_and_the_prefixes_it_serves(coded):
    store, cache_id, basis = coded
    shown = cli("cache", "show", cache_id, "--store", store, "--json").stdout
    layers = json.loads(shown)["layers"]
    n = CacheStore(store).manifest(cache_id).prefix.num_tokens
    longest = (n - 1) // 128 * 128
    assert json.loads(shown)["serves"] == {
        "num_tokens": n,
        "block_size": 128,
        "shorter": True,
        "longest_shorter": longest,
    }
    text = cli("cache", "show", cache_id, "--store", store).stdout
    assert f"serves       its prefix of {n:,} tokens and every multiple of 128 up to {longest:,}\n" in text
    # A coded layer's rows are not one per token: the entry is stored and sent whole, and says so.
    assert "stored       whole (layer 0 is " in text
    assert all(layer["codec"].startswith("transform k ") for layer in layers)
    manifest = CacheStore(store).manifest(cache_id)
    assert [layer["bytes"] for layer in layers] == [layer.tensors[0].nbytes for layer in manifest.layers]
    assert all(layer.kind == pb.CACHE_KIND_TRANSFORM_KV for layer in manifest.layers)


def test_serve_compress_keeps_its_caches_transform_coded(tiny_dir, tmp_path):
    """`kvmesh serve --compress`: the basis fitted at start and kept beside the store, a request's
    cache kept there transform coded, with its measured loss."""
    import openai

    from support.daemons import start_server

    data = tmp_path / "data"
    server = start_server(
        data, tiny_dir, "--no-mesh", "--compress", "--min-store-tokens", "64", log=tmp_path / "serve.log"
    )
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none")
        messages = [{"role": "user", "content": PROMPT}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        store = CacheStore(data / "store")
        wait_for(lambda: store.entries(), 60, what="the coded cache kept after the answer")
        (entry,) = store.entries()
        manifest = store.manifest(entry.cache_id)
        assert manifest.artifacts and all(layer.kind == pb.CACHE_KIND_TRANSFORM_KV for layer in manifest.layers)
        assert artifact_store(store.root).has(manifest.artifacts[0].sha256)
        assert manifest.quality.metric == "tail_kl"
    finally:
        assert server.stop() == 0


def test_serve_compress_answers_a_second_question_on_a_document_from_its_coded_cache(tiny, tiny_dir, serve, tmp_path):
    """Issue 30: a coded cache serves the document's blocks to the next question on it, from the store
    of the same Mac (a server whose memory is empty) and from a peer (a daemon serving that store,
    asked by a second server with --peer), as a dense cache does."""
    from importlib import resources

    from support.daemons import start_server

    document = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    document_tokens = len(tiny[1].encode(document))
    data = tmp_path / "a"

    def ask(server, question):
        import openai

        client = openai.OpenAI(base_url=server.url, api_key="none")
        messages = [{"role": "system", "content": document}, {"role": "user", "content": question}]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens, r.usage.model_extra["kvmesh"]

    first = start_server(data, tiny_dir, "--no-mesh", "--compress", log=tmp_path / "first.log")
    try:
        assert ask(first, "Who wrote this?")[0] == 0
    finally:
        assert first.stop() == 0
    (entry,) = CacheStore(data / "store").entries()
    assert CacheStore(data / "store").manifest(entry.cache_id).artifacts and entry.cuttable

    again = start_server(data, tiny_dir, "--no-mesh", "--compress", log=tmp_path / "again.log")
    try:
        cached, usage = ask(again, "What is it about?")
    finally:
        assert again.stop() == 0
    assert usage["prefix_from"] == "local store" and usage["cache_id"] == entry.cache_id
    assert cached % 128 == 0 and document_tokens - 256 < cached <= document_tokens + 128

    address = serve(data / "store")
    other = start_server(tmp_path / "b", tiny_dir, "--peer", address, "--fetch", "always", log=tmp_path / "other.log")
    try:
        from_peer, usage = ask(other, "Where does it happen?")
    finally:
        assert other.stop() == 0
    assert usage["prefix_from"] == f"peer {address}" and from_peer == cached
