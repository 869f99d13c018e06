"""Coding on request: a daemon that holds a full cache and the model's basis offers to transform code
it, codes it when a receiver asks (and it pays), keeps the copy, and refuses with a reason when it
would not pay or cannot be done; the receiver's choice weighs that copy against the others."""

import json
import math
import sys
from collections import deque
from importlib import resources
from pathlib import Path

import mlx.core as mx
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.coded import TransformCoding, decoded, transform_code
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.manifest import LEVEL_KL, predicted, transform_coded
from kvmesh.codec.timing import CodecTime
from kvmesh.errors import CacheRejected, Rejection
from kvmesh.net.client import PeerClient
from kvmesh.paths import coding_times_file
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.find import find_prefix
from kvmesh.reuse.rates import Decoding, Rates
from kvmesh.reuse.weigh import on_request_copy
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from support.processes import cli
from support.stores import put
from support.waiting import wait_for

MB = 1 << 20
TOKENS = 384


@pytest.fixture(scope="module")
def basis(tiny):
    model, tokenizer = tiny
    return fit_model_basis(model, tokenizer, tokens_per_text=128).basis


def sender_store(root, tiny, tiny_fp, basis):
    """(prompt, full cache): a store at `root` holding the full cache of a prompt's first TOKENS
    tokens and the model's basis (as `kvmesh model calibrate` leaves it)."""
    model, tokenizer = tiny
    prompt = tokenizer.encode(resources.files("kvmesh").joinpath("data/corpus.txt").read_text()[:2000])
    cache = prefill(model, prompt[:TOKENS]).cache
    put(CacheStore(root), cache, tiny_fp, prompt[:TOKENS])
    artifacts = artifact_store(root)
    artifacts.put(basis.to_bytes(), basis.digest)
    artifacts.set_model_basis(tiny_fp.model_id, basis.digest)
    return prompt, cache


@pytest.fixture
def full_peer(tiny, tiny_fp, basis, serve, tmp_path):
    """(address, store root, prompt, the full cache): a daemon serving `sender_store`."""
    root = tmp_path / "sender"
    prompt, cache = sender_store(root, tiny, tiny_fp, basis)
    return serve(root), root, prompt, cache


def full_candidate(address, model_id, prompt):
    """The peer's candidate for the prompt that is lossless."""
    with PeerClient(address) as client:
        return next(m.candidate for m in client.lookup(model_id, prompt) if not m.candidate.lossy)


def test_a_peer_codes_a_full_cache_on_request_and_keeps_the_copy(tiny_fp, basis, full_peer, serve, tmp_path):
    address, root, prompt, cache = full_peer
    [entry] = CacheStore(root).entries()
    offer = full_candidate(address, tiny_fp.model_id, prompt).on_request
    assert offer.basis_sha256 == basis.digest and offer.basis_bytes == basis.nbytes
    assert offer.fp16_bytes == entry.raw_bytes // 2  # (a float32 cache)
    assert offer.coded_bytes == int(offer.fp16_bytes / LEVELS["default"].ratio)
    assert offer.encode_s == 0  # it has coded nothing yet

    profile = ReceiverProfile(tiny_fp, prompt=prompt)
    with PeerClient(address) as client:
        got = fetch_cache(
            client, entry.cache_id, profile, store=CacheStore(tmp_path / "b"), code=spb.CodeRequest(level="default")
        )
    assert transform_coded(got.manifest) and got.basis_bytes == basis.nbytes
    assert got.manifest.quality.metric == LEVEL_KL and got.manifest.quality.value == LEVELS["default"].kl
    assert got.wire_bytes < entry.file_bytes / 4
    # Exactly what coding it here at the level (its step for this basis, its tail) would give.
    here = decoded(transform_code(cache, TransformCoding.at_level(basis, LEVELS["default"])))
    for a, b in zip(got.cache, here, strict=True):
        assert all(mx.array_equal(x, y) for x, y in zip(a.keys_and_values(), b.keys_and_values(), strict=True))

    if sys.platform.startswith("linux"):  # (the daemon loaded MLX to code it)
        assert "mlx" in Path(f"/proc/{serve.processes[address].pid}/maps").read_text()
    # The sender kept the copy, offers it in lookups, and now knows its coding rate.
    sender = {e.cache_id: e for e in CacheStore(root).entries()}
    assert set(sender) == {entry.cache_id, got.manifest.cache_id}
    assert full_candidate(address, tiny_fp.model_id, prompt).on_request.encode_s > 0
    with PeerClient(address) as client:
        listed = {m.candidate.cache_id: m.candidate for m in client.lookup(tiny_fp.model_id, prompt)}
    assert listed[got.manifest.cache_id].lossy and not listed[got.manifest.cache_id].HasField("on_request")
    # Named by the metric it was measured by: its level's loss on the bench's texts, not its own.
    assert listed[got.manifest.cache_id].quality.metric == LEVEL_KL
    assert listed[got.manifest.cache_id].quality.value == pytest.approx(LEVELS["default"].kl)
    # For a prompt that shares only its first block, it would be cut: then it claims no loss (its
    # manifest will not: kvmesh.codec.cut); the full copy is lossless either way.
    with PeerClient(address) as client:
        shorter = {m.candidate.cache_id: m for m in client.lookup(tiny_fp.model_id, prompt[:130] + [5] * 200)}
    assert shorter[got.manifest.cache_id].tokens == 128 and not shorter[got.manifest.cache_id].candidate.HasField(
        "quality"
    )
    # Asked again: the same copy, nothing coded or kept twice.
    with PeerClient(address) as client:
        again = fetch_cache(client, entry.cache_id, profile, code=spb.CodeRequest(level="default"))
    assert again.manifest.cache_id == got.manifest.cache_id and len(CacheStore(root).entries()) == 2


def test_a_restarted_peer_offers_the_coding_times_it_measured_before(tiny_fp, full_peer, serve, tmp_path):
    """A daemon keeps its codings' timings in its data directory (kvmesh.paths.coding_times_file): after
    a restart its offers say what coding takes from the first lookup; an unreadable file is timed again."""
    address, root, prompt, _ = full_peer
    [entry] = CacheStore(root).entries()
    with PeerClient(address) as client:
        fetch_cache(client, entry.cache_id, ReceiverProfile(tiny_fp), code=spb.CodeRequest(level="default"))
    before = full_candidate(address, tiny_fp.model_id, prompt).on_request
    assert before.encode_s > 0 and 0 <= before.encode_fixed_s <= before.encode_s

    def restarted(address):
        process = serve.processes.pop(address)
        process.terminate()
        assert process.wait(timeout=30) == 0
        return serve(root)

    address = restarted(address)
    after = full_candidate(address, tiny_fp.model_id, prompt).on_request
    assert (after.encode_s, after.encode_fixed_s) == (before.encode_s, before.encode_fixed_s)

    coding_times_file(f"{root}.data").write_text(json.dumps({"models": {tiny_fp.model_id: [[384, "soon"]]}}))
    address = restarted(address)
    assert full_candidate(address, tiny_fp.model_id, prompt).on_request.encode_s == 0
    assert "coding-times.json is unreadable" in Path(f"{root}.log").read_text()


def test_a_peer_whose_basis_does_not_predict_says_so_and_its_small_copy_is_weighed_as_coded(
    tiny, tiny_fp, basis, full_peer, serve, tmp_path
):
    """`small` predicts each layer from the one before only with a basis fitted with predictors; a peer
    whose basis has none (fitted before them) codes it layer by layer: larger and quicker to decode.
    Its offer says so once it has read its basis, and the receiver weighs the copy as that."""
    address, _, prompt, _ = full_peer
    bare = basis.without_predictors()
    root = tmp_path / "bare"
    sender_store(root, tiny, tiny_fp, bare)
    bare_address = serve(root)
    # (the daemon reads its basis in the background once it starts: kvmesh.net.on_request._ready)
    wait_for(
        lambda: full_candidate(bare_address, tiny_fp.model_id, prompt).on_request.unpredicted,
        seconds=60,
        what="the peer to say its basis does not predict",
    )
    rates = Rates(tmp_path / "receiver")  # (decoding a predicted copy taking longer, as on a CPU)
    times = {"transform": CodecTime(0, 1e-4), "predicted": CodecTime(0, 3e-4)}
    rates.record_decoding(tiny_fp.model_id, Decoding(times, basis_bytes=0))
    weighed = {}
    for name, at in (("bare", bare_address), ("predicting", address)):
        candidate = full_candidate(at, tiny_fp.model_id, prompt)
        weighed[name] = on_request_copy(rates, tiny_fp, at, candidate, tokens=TOKENS, bases=(), level="small")
    fp16 = full_candidate(address, tiny_fp.model_id, prompt).on_request.fp16_bytes
    small = LEVELS["small"]
    assert (weighed["bare"].codec, weighed["bare"].wire_bytes) == ("transform", int(fp16 / small.ratio))
    assert (weighed["predicting"].codec, weighed["predicting"].wire_bytes) == (
        "predicted",
        int(fp16 / small.predicted_ratio),
    )
    assert weighed["bare"].decode_s < weighed["predicting"].decode_s
    # What it codes is what it said: layer by layer.
    with PeerClient(bare_address) as client:
        candidate = full_candidate(bare_address, tiny_fp.model_id, prompt)
        coded = fetch_cache(client, candidate.cache_id, ReceiverProfile(tiny_fp), code=spb.CodeRequest(level="small"))
    assert not predicted(coded.manifest)


def test_a_request_is_weighed_by_what_the_basis_codes_before_the_daemon_read_it(tiny, tiny_fp, basis, tmp_path):
    """A daemon restarted with its coding times but not yet its basis read weighs a request for
    `small` by what its basis codes: without predictors, layer by layer (larger: it saves less), so
    a link on which a predicted copy would pay and this one does not is refused."""
    from kvmesh.net.on_request import OnRequestCoding, expected_coded_bytes, write_timings

    model, tokenizer = tiny
    root = tmp_path / "sender"
    store = CacheStore(root)
    prompt = tokenizer.encode(resources.files("kvmesh").joinpath("data/corpus.txt").read_text()[:2000])
    manifest = put(store, prefill(model, prompt[:TOKENS]).cache, tiny_fp, prompt[:TOKENS])
    bare = basis.without_predictors()
    artifacts = artifact_store(root)
    artifacts.put(bare.to_bytes(), bare.digest)
    timings = tmp_path / "coding-times.json"
    write_timings(timings, {tiny_fp.model_id: deque([(TOKENS, 0.5)])})
    coding = OnRequestCoding(store, "sender", timings=timings)  # (no model basis yet: none read at start)
    artifacts.set_model_basis(tiny_fp.model_id, bare.digest)
    coding_s = coding.coding_s(tiny_fp.model_id, TOKENS)
    assert coding_s is not None
    saved = {
        predicts: manifest.encoding.encoded_bytes - expected_coded_bytes(manifest, "small", predicts=predicts)
        for predicts in (True, False)
    }
    assert saved[False] < saved[True]
    link = math.sqrt(saved[False] * saved[True]) / coding_s  # (a predicted copy would pay; this one not)
    refused = coding.coded(manifest.cache_id, manifest, spb.CodeRequest(level="small", link_bytes_per_s=link), 0)
    assert isinstance(refused, Rejection) and "fetch it as stored" in refused.message


def test_a_shorter_prefix_is_cut_then_coded(tiny_fp, full_peer):
    address, root, prompt, _ = full_peer
    [entry] = CacheStore(root).entries()
    with PeerClient(address) as client:
        got = fetch_cache(
            client, entry.cache_id, ReceiverProfile(tiny_fp), num_tokens=128, code=spb.CodeRequest(level="small")
        )
    assert got.manifest.prefix.num_tokens == 128 and transform_coded(got.manifest)
    assert got.manifest.quality.value == LEVELS["small"].kl
    assert all(layer.keys_and_values()[0].shape[2] == 128 for layer in got.cache)


def test_a_peer_refuses_coding_that_would_not_pay_or_cannot_be_done(tiny_fp, full_peer):
    address, root, prompt, _ = full_peer
    [entry] = CacheStore(root).entries()
    profile = ReceiverProfile(tiny_fp)

    def refused(**request):
        with PeerClient(address) as client, pytest.raises(CacheRejected) as e:
            fetch_cache(client, entry.cache_id, profile, code=spb.CodeRequest(**request))
        assert e.value.rejection.reason == pb.REJECT_REASON_CODEC
        return str(e.value)

    assert "unknown level 'tiny'" in refused(level="tiny")
    # Once it has timed a coding, a link so fast that the smaller copy saves less than coding costs.
    with PeerClient(address) as client:
        fetch_cache(client, entry.cache_id, profile, code=spb.CodeRequest(level="default"))
    assert "fetch it as stored" in refused(level="default", link_bytes_per_s=1e15)
    # A lossy cache is not coded again.
    coded = next(e for e in CacheStore(root).entries() if e.lossy)
    with PeerClient(address) as client, pytest.raises(CacheRejected, match="lossy already"):
        fetch_cache(client, coded.cache_id, profile, code=spb.CodeRequest(level="default"))


def test_a_daemon_told_not_to_code_neither_offers_nor_codes(tiny, tiny_fp, basis, serve, tmp_path):
    prompt, _ = sender_store(tmp_path / "a", tiny, tiny_fp, basis)
    address = serve(tmp_path / "a", "--no-code-on-request")
    candidate = full_candidate(address, tiny_fp.model_id, prompt)
    assert not candidate.HasField("on_request")
    with PeerClient(address) as client, pytest.raises(CacheRejected, match="--no-code-on-request"):
        fetch_cache(client, candidate.cache_id, ReceiverProfile(tiny_fp), code=spb.CodeRequest(level="default"))
    assert len(CacheStore(tmp_path / "a").entries()) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_without_the_model_s_basis_nothing_is_offered(tiny, tiny_fp, serve, tmp_path):
    model, tokenizer = tiny
    prompt = list(range(1, 300))
    put(CacheStore(tmp_path / "a"), prefill(model, prompt[:256]).cache, tiny_fp, prompt[:256])
    address = serve(tmp_path / "a")
    candidate = full_candidate(address, tiny_fp.model_id, prompt)
    assert not candidate.HasField("on_request")
    with PeerClient(address) as client, pytest.raises(CacheRejected, match="no transform basis"):
        fetch_cache(client, candidate.cache_id, ReceiverProfile(tiny_fp), code=spb.CodeRequest(level="default"))
    # Neither the lookup nor the refusal loaded MLX into the daemon (it loads it to code, and only then).
    assert "mlx" not in Path(f"/proc/{serve.processes[address].pid}/maps").read_text()


def receiver_rates(data_dir, model_id, address, *, bytes_per_s):
    """A receiver that prefills at 1 token/s, reaches `address` at `bytes_per_s`, decodes fp16 at
    1 GB/s and the transform codec at 10 MB/s."""
    rates = Rates(data_dir)
    rates.record_prefill(model_id, 128, 128.0)
    rates.record_prefill(model_id, 512, 512.0)
    rates.record_transfer(address, 10 * MB, 10 * MB / bytes_per_s)
    times = {"full": CodecTime(0, 1.2 * MB / 1e9 / TOKENS), "transform": CodecTime(0, 0.35 * MB / 10e6 / TOKENS)}
    rates.record_decoding(model_id, Decoding(times, basis_bytes=0))
    return rates


def test_the_receiver_asks_for_a_coded_copy_when_that_comes_sooner(tiny_fp, basis, full_peer, tmp_path):
    address, root, prompt, _ = full_peer

    def found(name, bytes_per_s, **options):
        rates = receiver_rates(tmp_path / name, tiny_fp.model_id, address, bytes_per_s=bytes_per_s)
        got = find_prefix(
            tiny_fp, prompt, CacheStore(tmp_path / name / "store"), peers=[address], rates=rates, **options
        )
        [decision] = got.fetch_or_prefill
        assert decision.fetch and got.tokens == TOKENS
        return got, decision

    # A fast link: the full copy as stored; the copy it would code is weighed, and slower.
    fast, decision = found("fast", 1e9)
    assert decision.best.copy.codec == "full" and not transform_coded(
        CacheStore(tmp_path / "fast" / "store").manifest(fast.cache_id)
    )
    assert [w.copy.level for w in decision.weighed] == ["", "default"]
    # A slow link: the coded copy, asked for, coded there, fetched with its basis, kept here.
    slow, decision = found("slow", 100e3)
    best = decision.best.copy
    assert (best.codec, best.level, best.encode_measured) == (
        "transform",
        "default",
        "not measured there yet: taken as this machine's decode",
    )
    assert "transform on request after a" in str(decision) and "coding it there at level default" in str(decision)
    assert transform_coded(CacheStore(tmp_path / "slow" / "store").manifest(slow.cache_id))
    assert len(CacheStore(root).entries()) == 2
    # A receiver whose quality floor is below the level's loss is not offered it.
    _, strict = found("strict", 100e3, max_kl=LEVELS["default"].kl / 2)
    assert [w.copy.level for w in strict.weighed] == [""]
    # One whose floor admits the smaller level (and that holds the basis) weighs coding at both,
    # beside the full copy and the default level's copy kept there, and asks for the smaller.
    artifacts = artifact_store(tmp_path / "loose" / "store")
    artifacts.put(basis.to_bytes(), basis.digest)
    artifacts.set_model_basis(tiny_fp.model_id, basis.digest)
    loose, decision = found("loose", 100e3, max_kl=LEVELS["small"].kl)
    assert sorted(w.copy.level for w in decision.weighed) == ["", "", "default", "small"]
    assert decision.best.copy.level == "small" and "coding it there at level small" in str(decision)
    kept = CacheStore(tmp_path / "loose" / "store").manifest(loose.cache_id)
    assert kept.quality.metric == LEVEL_KL and kept.quality.value == LEVELS["small"].kl


def test_the_cli_fetches_a_copy_coded_on_request(tiny_fp, tiny_dir, full_peer, tmp_path):
    address, root, _, _ = full_peer
    [entry] = CacheStore(root).entries()
    store = tmp_path / "b"
    done = cli("fetch", entry.cache_id[:12], "--peer", address, "--model", tiny_dir, "--compress", "--store", store)
    assert f"from {address}, coded there at level default:" in done.stdout
    [kept] = CacheStore(store).entries()
    assert (
        kept.lossy and kept.num_tokens == TOKENS and kept.loss_metric == LEVEL_KL and kept.loss == LEVELS["default"].kl
    )
    shown = cli("cache", "show", kept.cache_id, "--store", store).stdout
    assert "level_kl" in shown and "its coding level's worst on the bench's texts" in shown
    wrong = cli("fetch", entry.cache_id, "--peer", address, "--model", tiny_dir, "--compress", "huge", check=False)
    assert wrong.returncode == 2 and "invalid choice: 'huge'" in wrong.stderr
