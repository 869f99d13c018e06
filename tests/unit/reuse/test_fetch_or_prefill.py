"""Fetch or prefill: the cost model, the rates a machine keeps, and the choice in generate and serve."""

import json
import logging
import math
import re
from importlib import resources

import mlx.core as mx
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.coded import TransformCoding, transform_code
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.timing import CodecTime, fit_codec_time
from kvmesh.errors import PeerError
from kvmesh.net.client import PeerClient, Probe
from kvmesh.net.server import MAX_PROBE_BYTES as SERVER_PROBE_CAP
from kvmesh.reuse.choice import MAX_PROBE_BYTES, MIN_PROBE_BYTES, Copy, choose
from kvmesh.reuse.fetch import Fetched, fetch_cache
from kvmesh.reuse.find import find_prefix
from kvmesh.reuse.generate import generate
from kvmesh.reuse.rates import (
    FETCH_SETUP_S,
    PREFILL_SAMPLES,
    Decoding,
    PrefillModel,
    Rates,
    fit_prefill,
)
from kvmesh.reuse.weigh import fetch_or_prefill, on_request_copy, probe_link, record_fetch
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import ArtifactStore, artifact_store
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb
from support.processes import cli
from support.references import tokens_after
from support.stores import put

MB = 1 << 20


def test_the_prefill_model_is_recovered_from_timed_prefills():
    true = PrefillModel(per_token_s=0.004, per_pair_s=2e-6)
    samples = [(128, 0, true.seconds(128)), (512, 0, true.seconds(512)), (300, 1000, true.seconds(300, 1000))]
    fitted = fit_prefill(samples)
    assert fitted is not None
    assert (fitted.per_token_s, fitted.per_pair_s) == pytest.approx((true.per_token_s, true.per_pair_s), rel=1e-6)
    # Attention's share: per token, 4,096 tokens cost nearly twice what 128 do.
    assert true.rate(128) > 1.9 * true.rate(4096)
    # One length cannot tell the two terms apart: a per-token time that fits it exactly.
    single = fit_prefill([(256, 0, 1.0), (256, 0, 1.0)])
    assert single == PrefillModel(1 / 256) and single.seconds(256) == pytest.approx(1.0)
    assert fit_prefill([]) is None


def link(wire: int, bytes_per_s: float, **options) -> Copy:
    """A full copy of `wire` bytes over a link of `bytes_per_s`."""
    return Copy("10.0.0.2:7470", "c0ffee", "full", wire, bytes_per_s, **options)


def test_the_choice_takes_the_faster_and_says_why():
    prefill_model = PrefillModel.at_rate(1000)  # 1,000 tokens/s: 2,048 tokens take 2.05 s
    wire = 64 * MB
    fast = choose(2048, [link(wire, 1.1e9, measured="probed")], prefill_model)
    assert fast.fetch and fast.fetch_s == pytest.approx(FETCH_SETUP_S + wire / 1.1e9)
    assert fast.prefill_s == pytest.approx(2.048) and fast.where == "10.0.0.2:7470"
    assert str(fast) == (
        "2,048 cached tokens at 10.0.0.2:7470: fetching 67.1 MB full at 1,100.0 MB/s (probed) takes about 0.07 s "
        "(setup 0.01 s, wire 0.06 s, decode not measured), prefilling them here at 1,000 tokens/s about 2.05 s: fetch"
    )
    slow = choose(2048, [link(wire, 12e6)], prefill_model)  # Wi-Fi: 5.6 s
    assert not slow.fetch and str(slow).endswith("about 2.05 s: prefill")
    # After 6,000 held tokens, attention makes the same prefill slower: then fetching wins.
    held = choose(2048, [link(wire, 12e6)], PrefillModel(0.001, 5e-7), context=6000)
    assert held.prefill_s == pytest.approx(2048 * (0.001 + 5e-7 * (6000 + 1024)))
    assert held.fetch
    # A slow machine's rate keeps its digits.
    crawl = choose(2048, [link(wire, 12e6)], PrefillModel.at_rate(1.37))
    assert "prefilling them here at 1.37 tokens/s about 1494.89 s: fetch" in str(crawl)
    # No prefill timed here: fetching is the choice, without figures to weigh.
    blind = choose(2048, [link(wire, 12e6)], None)
    assert blind.fetch and str(blind) == "2,048 cached tokens at 10.0.0.2:7470: no prefill timed here: fetch"


def test_rates_are_kept_in_the_data_dir_and_shared(tmp_path, caplog):
    rates = Rates(tmp_path)
    assert rates.link_rate("a:1") is None and rates.prefill_model("m") is None
    rates.record_probe("a:1", 50e6)
    assert rates.link_rate("a:1") == 50e6 and rates.link_source("a:1") == "probed"
    rates.record_transfer("a:1", 10 * MB, 10 * MB / 100e6)  # a transfer replaces the probe
    assert rates.link_rate("a:1") == pytest.approx(100e6) and rates.link_source("a:1") == "measured on 1 transfer"
    rates.record_probe("a:1", 1e9)  # ...and a later probe never overrides transfers
    rates.record_transfer("a:1", 10 * MB, 10 * MB / 200e6)
    assert rates.link_rate("a:1") == pytest.approx(150e6) and rates.link_source("a:1") == "measured on 2 transfers"
    rates.record_transfer("a:1", 1000, 0.5)  # too small to say anything about the link
    assert rates.link_rate("a:1") == pytest.approx(150e6)
    # A stream that decoding paced says only that the link is at least that fast.
    rates.record_transfer("a:1", 10 * MB, 10 * MB / 50e6, at_least=True)
    assert rates.link_rate("a:1") == pytest.approx(150e6) and rates.link_source("a:1") == "measured on 2 transfers"
    rates.record_transfer("a:1", 10 * MB, 10 * MB / 250e6, at_least=True)
    assert rates.link_rate("a:1") == pytest.approx(200e6) and rates.link_source("a:1") == "measured on 3 transfers"

    other = Rates(tmp_path)  # another process: `kvmesh serve` next to `kvmesh generate`
    other.record_prefill("m", 128, 1.0)
    rates.record_prefill("m", 512, 4.0, context=100)
    assert json.loads((tmp_path / "rates.json").read_text())["prefill"]["m"] == [[128, 0, 1.0], [512, 100, 4.0]]
    assert Rates(tmp_path).link_rate("a:1") == pytest.approx(200e6)
    for i in range(2 * PREFILL_SAMPLES):
        rates.record_prefill("m", 100 + i, 1.0)
    assert len(Rates(tmp_path).prefill["m"]) == PREFILL_SAMPLES
    assert list(tmp_path.glob("*.part")) == []

    for damage in ("{not json", '{"links": {"a:1": 5}, "prefill": {}}', '{"links": {}, "prefill": {"m": [[1]]}}'):
        (tmp_path / "rates.json").write_text(damage)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            damaged = Rates(tmp_path)
        assert damaged.links == {} and damaged.prefill_model("m") is None and "unreadable" in caplog.text
    damaged.record_probe("b:2", 1e6)
    assert Rates(tmp_path).link_rate("b:2") == 1e6


def test_a_peer_s_setup_is_measured_on_its_fetches_and_weighed(tmp_path):
    """The seconds a fetch takes before its bytes stream (connecting, the manifest's round trip, the
    receiver's buffers) are learnt per peer, from the time to its first chunk less the basis it
    brought and that chunk's bytes at the link's rate; a copy from that peer is expected to cost
    them. The rate a basis comes ready at (fetched, checked, parsed, kept) is learnt too."""
    rates = Rates(tmp_path)
    rates.record_setup("a:1", 0.2)  # no link rate measured on transfers yet: nothing to set it beside
    rates.record_basis("a:1", 4 * MB, 0.1)  # ...nor a basis's
    assert rates.link_setup("a:1") == FETCH_SETUP_S and rates.basis_rate("a:1") is None
    candidate = spb.Candidate(cache_id="c", stored_bytes=20 * MB, num_tokens=100)
    # A 4 MB basis ready in 0.08 s, then a first chunk of 1 MB before a stream of 15 MB at 100 MB/s,
    # the last byte 0.28 s after the request: 0.04 s of it before any byte.
    fetched = Fetched(
        manifest=pb.CacheManifest(), cache=[], seconds=0.3, wire_bytes=16 * MB, basis_bytes=4 * MB,
        basis_s=0.08, wire_s=0.28, stream_bytes=15 * MB, stream_s=15 * MB / 100e6,
    )  # fmt: skip
    record_fetch(rates, "m", "a:1", candidate, fetched)
    assert rates.link_rate("a:1") == pytest.approx(100e6)
    assert rates.link_setup("a:1") == pytest.approx(0.28 - 15 * MB / 100e6 - 0.08 - 1 * MB / 100e6)
    assert rates.basis_rate("a:1") == pytest.approx(4 * MB / 0.08)
    assert Rates(tmp_path).link_setup("a:1") == pytest.approx(rates.link_setup("a:1"))  # kept in rates.json
    assert Rates(tmp_path).basis_rate("a:1") == pytest.approx(4 * MB / 0.08)
    assert Rates(tmp_path).basis_rate("b:1") is None
    slow = Copy("a:1", "c", "full", 10 * MB, 100e6, setup_s=rates.link_setup("a:1"))
    assert choose(100, [slow], None).fetch_s == pytest.approx(rates.link_setup("a:1") + 10 * MB / 100e6)


@pytest.fixture
def peer_with_a_cache(tiny, tiny_fp, serve, tmp_path):
    """(address, prompt text, its tokens): a daemon serving the cache of the prompt's first 384 tokens."""
    model, tokenizer = tiny
    text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()[:2000]
    prompt = tokenizer.encode(text)
    assert len(prompt) > 384
    put(CacheStore(tmp_path / "a"), prefill(model, prompt[:384]).cache, tiny_fp, prompt[:384], codec="none")
    return serve(tmp_path / "a"), text, prompt


def test_generate_fetches_only_when_that_is_faster(tiny, tiny_fp, peer_with_a_cache, tmp_path):
    model, _ = tiny
    address, _, prompt = peer_with_a_cache
    expected = tokens_after(model, prefill(model, prompt[:-1]).cache, prompt[-1:], 6)

    # A machine that prefills 10 tokens a second: fetching wins, the link is probed first.
    slow = Rates(tmp_path / "slow")
    slow.record_prefill(tiny_fp.model_id, 128, 12.8)
    slow.record_prefill(tiny_fp.model_id, 512, 51.2)
    fetched = generate(model, tiny_fp, prompt, CacheStore(tmp_path / "b"), peers=[address], max_tokens=6, rates=slow)
    assert fetched.prefix.where == f"peer {address}" and fetched.prefix.tokens == 384
    assert fetched.tokens == expected
    [choice] = fetched.prefix.fetch_or_prefill
    assert choice.fetch and choice.where == address and choice.best.copy.measured == "probed"
    assert str(choice).startswith(f"384 cached tokens at {address}: fetching") and str(choice).endswith(": fetch")
    assert slow.link_source(address) == "measured on 1 transfer"
    # The fetch measured this peer's setup, which the next choice weighs.
    assert "setup_s" in json.loads((tmp_path / "slow" / "rates.json").read_text())["links"][address]
    setup = slow.link_setup(address)
    again = generate(model, tiny_fp, prompt, CacheStore(tmp_path / "b2"), peers=[address], max_tokens=1, rates=slow)
    assert again.prefix.fetch_or_prefill[0].best.cost.setup_s == pytest.approx(setup)

    # A machine that prefills ten million tokens a second: it prefills, and says why.
    fast = Rates(tmp_path / "fast")
    fast.record_prefill(tiny_fp.model_id, 128, 128e-7)
    fast.record_prefill(tiny_fp.model_id, 512, 512e-7)
    recomputed = generate(model, tiny_fp, prompt, CacheStore(tmp_path / "c"), peers=[address], max_tokens=6, rates=fast)
    assert recomputed.prefix.where == "none" and recomputed.prefix.wire_bytes == 0
    assert recomputed.tokens == expected
    [choice] = recomputed.prefix.fetch_or_prefill
    assert not choice.fetch and choice.prefill_s < choice.fetch_s and str(choice).endswith(": prefill")
    assert CacheStore(tmp_path / "c").entries() == []  # nothing was fetched

    # A machine that never timed this model times two prefills first, and its decoders.
    fresh = Rates(tmp_path / "fresh")
    generate(model, tiny_fp, prompt, CacheStore(tmp_path / "d"), peers=[address], max_tokens=2, rates=fresh)
    assert [m for m, _, _ in fresh.prefill[tiny_fp.model_id][:2]] == [128, 512]
    decoding = fresh.decoding(tiny_fp.model_id)
    assert decoding is not None and set(decoding.times) == {"full", "quantized", "transform", "predicted"}
    for time in decoding.times.values():  # decodes of two lengths: a cost per token, at the least
        assert time.per_token_s > 0 and time.fixed_s >= 0
    assert decoding.basis_bytes > 0
    # Each decode was kept by a store in the data dir, as a fetch's is, and the stores are gone.
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["rates.json"]


def timed(data_dir, model_id, tokens_per_s):
    """A data dir whose rates say this machine prefills the model at `tokens_per_s`."""
    rates = Rates(data_dir)
    rates.record_prefill(model_id, 128, 128 / tokens_per_s)
    rates.record_prefill(model_id, 512, 512 / tokens_per_s)
    return data_dir


def explained(*args, data_dir):
    """`kvmesh generate ARGS --explain`'s lines on stderr, by their first word."""
    lines = cli(*args, "--explain", data_dir=data_dir).stderr.splitlines()
    return {word: [line for line in lines if line.startswith(word)] for word in ("prefix:", "choice:", "estimated")}


def test_the_cli_explains_its_choice_and_every_line_agrees_with_it(tiny_fp, tiny_dir, peer_with_a_cache, tmp_path):
    address, text, prompt = peer_with_a_cache
    args = ["generate", tiny_dir, "--prompt", text, "--peer", address, "--max-tokens", 2]

    # 10 tokens/s here: fetched; the time saved is reckoned from the prefill time the choice weighed.
    fetched = explained(*args, data_dir=timed(tmp_path / "slow", tiny_fp.model_id, 10))
    [choice] = fetched["choice:"]
    weighed = re.fullmatch(
        rf"choice: 384 cached tokens at {address}: fetching .* MB full at .* takes about [\d.]+ s \(setup [\d.]+ s, "
        rf"wire [\d.]+ s, decode [\d.]+ s\), prefilling them here at [\d.]+ tokens/s about ([\d.]+) s: fetch",
        choice,
    )
    [prefix] = fetched["prefix:"]
    took = re.fullmatch(
        rf"prefix: 384 of {len(prompt)} tokens from peer {address} \([\d,]+ bytes on the wire, ([\d.]+) s\)", prefix
    )
    [saved] = fetched["estimated"]
    saving = re.fullmatch(
        r"estimated time saved: ([\d.]+) s \(prefilling the 384 cached tokens here takes about ([\d.]+) s at this "
        r"Mac's measured rate; getting them took ([\d.]+) s\)",
        saved,
    )
    assert weighed and took and saving, (choice, prefix, saved)
    assert weighed[1] == saving[2] == "38.40" and took[1] == saving[3]
    assert float(saving[1]) == pytest.approx(float(saving[2]) - float(saving[3]), abs=0.011)

    # Ten million tokens/s here: prefilled, and no line says there was nothing cached or time saved.
    prefilled = explained(*args, data_dir=timed(tmp_path / "fast", tiny_fp.model_id, 1e7))
    assert [line.endswith(": prefill") for line in prefilled["choice:"]] == [True]
    assert prefilled["prefix:"] == [
        f"prefix: a peer's cache was weighed but not used (--explain says why); all {len(prompt)} tokens prefilled here"
    ]
    assert prefilled["estimated"] == []

    # --fetch always weighs nothing, and says so, both of the fetch and of the local store's copy after it.
    always = [*args, "--fetch", "always"]
    forced = json.loads(cli(*always, "--json", data_dir=tmp_path / "b").stdout)
    assert forced["prefix_from"] == f"peer {address}" and forced["fetch_or_prefill"] == []
    again = explained(*always, data_dir=tmp_path / "b")
    assert again["prefix:"][0].startswith(f"prefix: 384 of {len(prompt)} tokens from local store")
    assert again["choice:"] == ["choice: no peer had a longer cached prefix than the local store's: nothing to choose"]
    other = explained(*always, data_dir=tmp_path / "c")
    assert other["choice:"] == [
        f"choice: --fetch always: the cache at {address} was fetched without weighing a prefill here"
    ]


def framed(n: int) -> range:
    """What a probe of `n` bytes receives: the data, and its framing."""
    return range(n, n + 4096)


def test_a_probe_measures_the_link_within_its_cap(tmp_path, serve):
    address = serve(tmp_path / "a")
    with PeerClient(address) as client:
        probe = client.probe(1 << 20)
        assert probe.bytes in framed(1 << 20) and probe.rate > 1e6  # loopback moves a MiB at more than a MB/s
        assert sum(map(len, client._probe(spb.ProbeRequest(bytes=100 << 20)))) in framed(SERVER_PROBE_CAP)


def test_a_probe_over_too_soon_is_made_again_at_its_largest(tmp_path, serve):
    """Before a fetch: a share of its bytes, then, after a probe that was over too soon, the largest
    (one probe when the share is the largest already); a second probe that fails leaves the first."""
    address = serve(tmp_path / "a")
    with PeerClient(address) as client:
        asked: list[int] = []
        second_fails = [False]
        real_probe = client.probe

        def probe(nbytes: int, **options) -> Probe:
            asked.append(nbytes)
            if len(asked) > 1 and second_fails[0]:
                raise PeerError(address, "the second probe ran out of time")
            return real_probe(nbytes, **options)

        client.probe = probe  # type: ignore[method-assign]  # (the real probe, its sizes noted)
        wire, share = 8 * MIN_PROBE_BYTES, 2 * MIN_PROBE_BYTES
        for wire_bytes, min_seconds, failing, want, kept in (
            (wire, 0.0, False, [share], share),
            (wire, math.inf, False, [share, MAX_PROBE_BYTES], MAX_PROBE_BYTES),
            (wire, math.inf, True, [share, MAX_PROBE_BYTES], share),
            (1 << 30, math.inf, False, [MAX_PROBE_BYTES], MAX_PROBE_BYTES),
        ):
            asked.clear()
            second_fails[0] = failing
            got = probe_link(client, wire_bytes, timeout=10, min_seconds=min_seconds)
            assert asked == want and got.bytes in framed(kept)


def copies(wire_full: int, wire_coded: int, bytes_per_s: float, *, basis_bytes: int = 0) -> list[Copy]:
    """A full and a transform coded copy of one prefix over one link, decoded at this machine's rates
    (fp16 at 2 GB/s, the transform codec at 40 MB/s of wire), 32 layers."""
    return [
        Copy("a:1", "full", "full", wire_full, bytes_per_s, decode_s=wire_full / 2e9, layers=32),
        Copy("b:1", "coded", "transform", wire_coded, bytes_per_s, basis_bytes=basis_bytes, decode_s=wire_coded / 40e6,
             layers=32),
    ]  # fmt: skip


def test_decoding_is_counted_and_the_soonest_copy_is_weighed():
    prefill_model = PrefillModel.at_rate(500)  # 4,096 tokens: 8.19 s
    # The expected fetch: setup, then the slower of the wire and decoding, then the last layer's decode.
    [full, coded] = [choose(4096, [c], prefill_model).best.cost for c in copies(200 * MB, 50 * MB, 1.1e9)]
    assert coded.wire_s == pytest.approx(50 * MB / 1.1e9) and coded.decode_s == pytest.approx(50 * MB / 40e6)
    assert coded.seconds == pytest.approx(FETCH_SETUP_S + 50 * MB / 40e6 * (1 + 1 / 32))
    assert full.seconds == pytest.approx(FETCH_SETUP_S + 200 * MB / 1.1e9 + 200 * MB / 2e9 / 32)

    # 10 GbE: decoding the coded copy takes longer than the fp16 copy's four times the bytes.
    fast = choose(4096, copies(200 * MB, 50 * MB, 1.1e9), prefill_model)
    assert (
        fast.fetch and fast.best.copy.codec == "full" and [w.copy.codec for w in fast.weighed] == ["full", "transform"]
    )
    assert "decode 1.31 s" in str(fast) and str(fast).endswith(": fetch")
    # 30 MB/s: the coded copy's fewer bytes win, over the fp16 copy and over the prefill.
    slow = choose(4096, copies(200 * MB, 50 * MB, 30e6), prefill_model)
    assert slow.fetch and slow.best.copy.codec == "transform" and slow.fetch_s < slow.prefill_s
    # ...unless this machine lacks the basis: it travels first, and then the fp16 copy is sooner.
    lacking = choose(4096, copies(200 * MB, 50 * MB, 30e6, basis_bytes=200 * MB), prefill_model)
    assert lacking.best.copy.codec == "full"
    assert lacking.weighed[1].cost.basis_s == pytest.approx(200 * MB / 30e6)
    assert "after a 209.72 MB basis" in str(lacking)
    # On Wi-Fi with the basis to fetch, neither copy beats the prefill.
    wifi = choose(4096, copies(200 * MB, 50 * MB, 12e6, basis_bytes=200 * MB), prefill_model)
    assert not wifi.fetch and str(wifi).endswith(": prefill")


def test_a_peer_s_coding_on_request_of_a_shorter_prefix_costs_its_fixed_part_whole(tiny_fp, tmp_path):
    """An offer says what coding the whole entry takes and the part of it fixed however short the
    prefix (OnRequest.encode_fixed_s): a receiver that wants half the tokens expects the fixed part
    and half the rest; a peer that does not say (0) is scaled whole, as before."""
    candidate = spb.Candidate(cache_id="c" * 32, num_tokens=1000)
    candidate.on_request.CopyFrom(spb.OnRequest(fp16_bytes=10 * MB, encode_s=1.0, encode_fixed_s=0.4))

    def expected_coding(tokens: int) -> float:
        copy = on_request_copy(Rates(tmp_path), tiny_fp, "127.0.0.1:1", candidate, tokens=tokens, bases=[])
        assert copy.encode_measured == "measured there"
        return copy.encode_s

    assert expected_coding(1000) == pytest.approx(1.0)
    assert expected_coding(500) == pytest.approx(0.4 + 0.6 * 0.5)
    candidate.on_request.encode_fixed_s = 0
    assert expected_coding(500) == pytest.approx(0.5)


def test_decode_times_are_kept_beside_the_link_rates(tmp_path):
    (tmp_path / "rates.json").write_text('{"links": {"a:1": {"bytes_per_s": 5e6, "transfers": 1}}, "prefill": {}}')
    rates = Rates(tmp_path)  # a file from before decoding was measured
    assert rates.link_rate("a:1") == 5e6 and rates.decoding("m") is None
    full, coded = CodecTime(0.001, 1e-5), CodecTime(0.03, 1e-4)
    rates.record_decoding("m", Decoding({"full": full, "transform": coded}, basis_bytes=4_530_000))
    Rates(tmp_path).record_decoding("m", Decoding({"transform": CodecTime(0.05, 3e-4)}, basis_bytes=4_530_000))
    kept = Rates(tmp_path).decoding("m")
    assert kept is not None and kept.times["full"] == full
    blended = kept.times["transform"]  # blended, as links are
    assert (blended.fixed_s, blended.per_token_s) == pytest.approx((0.04, 2e-4))
    assert kept.seconds("transform", 1000) == pytest.approx(0.24) and kept.seconds("quantized", 1) is None
    assert Rates(tmp_path).link_rate("a:1") == 5e6
    # A file of one decode rate per codec (kvmesh before decode times): measured again.
    data = json.loads((tmp_path / "rates.json").read_text())
    data["decode"]["m"] = {"bytes_per_s": {"full": 2e9}, "basis_bytes": 4_530_000}
    (tmp_path / "rates.json").write_text(json.dumps(data))
    assert Rates(tmp_path).decoding("m") is None and Rates(tmp_path).link_rate("a:1") == 5e6


def test_decode_time_is_fitted_as_a_fixed_cost_and_one_per_token():
    true = CodecTime(0.035, 8e-5)
    fitted = fit_codec_time([(64, true.seconds(64)), (256, true.seconds(256))])
    assert (fitted.fixed_s, fitted.per_token_s) == pytest.approx((true.fixed_s, true.per_token_s))
    # A 1,024-token cache: one rate timed on 256 tokens would have said 0.2 s, not 0.117 s.
    assert fitted.seconds(1024) == pytest.approx(0.035 + 1024 * 8e-5)
    # A loaded machine that timed the shorter cache slower, or a line that would start below zero:
    # the longest's rate, all per token.
    assert fit_codec_time([(64, 0.05), (256, 0.04)]) == CodecTime(0.0, 0.04 / 256)
    assert fit_codec_time([(64, 0.001), (256, 0.04)]) == CodecTime(0.0, 0.04 / 256)


def test_each_codec_s_stream_rate_is_measured_per_peer(tiny_fp, tmp_path):
    """A copy of many small chunks streams slower than the link's bytes say: what each codec's copies
    reached from a peer is what its next copy is expected at; a codec never fetched from it, the link's."""
    peer = "127.0.0.1:9"  # never called: every rate the choice needs is known
    rates = Rates(timed(tmp_path, tiny_fp.model_id, 1))
    rates.record_probe(peer, 100e6)
    assert rates.stream_rate(peer, "quantized") == 100e6 and rates.link_source(peer, "quantized") == "probed"
    rates.record_transfer(peer, 10 * MB, 10 * MB / 120e6, codec="full")
    rates.record_transfer(peer, 10 * MB, 10 * MB / 40e6, codec="quantized")
    reread = Rates(tmp_path)
    assert reread.stream_rate(peer, "quantized") == pytest.approx(40e6)
    assert reread.link_source(peer, "quantized") == "quantized copies measured on 1 transfer"
    assert reread.stream_rate(peer, "full") == pytest.approx(120e6)
    assert reread.link_rate(peer) == pytest.approx(80e6)  # every stream, as before
    assert reread.stream_rate(peer, "transform") == pytest.approx(80e6)
    assert reread.link_source(peer, "transform") == "measured on 2 transfers"

    # Each copy is weighed at its codec's rate, and the basis a coded one needs at the link's.
    reread.record_decoding(tiny_fp.model_id, Decoding({}, basis_bytes=8 * MB))
    offers = {
        codec: spb.Candidate(cache_id=codec, num_tokens=100, stored_bytes=12 * MB, method=method, lossy=lossy)
        for codec, method, lossy in [("full", "full", False), ("quantized", "quantize", True),
                                     ("transform", "full", True)]
    }  # fmt: skip
    with PeerClient(peer) as client:
        decision = fetch_or_prefill(reread, tiny_fp, [(client, c) for c in offers.values()], tokens=100, held=0)
    costs = {w.copy.codec: w.cost for w in decision.weighed}
    assert costs["full"].wire_s == pytest.approx(12 * MB / 120e6)
    assert costs["quantized"].wire_s == pytest.approx(12 * MB / 40e6)
    assert costs["transform"].wire_s == pytest.approx(12 * MB / 80e6)
    assert costs["transform"].basis_s == pytest.approx(8 * MB / 80e6)
    assert "12.6 MB quantized at 40.0 MB/s (quantized copies measured on 1 transfer)" in str(decision)


@pytest.fixture
def two_copies(tiny, tiny_fp, serve, tmp_path):
    """(prompt, full peer, coded peer, basis): the cache of a prompt's first 384 tokens, as computed on
    one daemon and transform coded on another (with the basis it needs)."""
    model, tokenizer = tiny
    text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()[:2000]
    prompt = tokenizer.encode(text)
    cache = prefill(model, prompt[:384]).cache
    put(CacheStore(tmp_path / "full"), cache, tiny_fp, prompt[:384], codec="none")
    basis = fit_model_basis(model, tokenizer, tokens_per_text=128).basis
    coded = CacheStore(tmp_path / "coded")
    put(coded, transform_code(cache, TransformCoding.at_level(basis, LEVELS["default"])), tiny_fp, prompt[:384])
    artifact_store(coded.root).put(basis.to_bytes(), basis.digest)
    return prompt, serve(tmp_path / "full"), serve(tmp_path / "coded"), basis


def receiver(data_dir, model_id, full, coded, *, bytes_per_s, basis_bytes):
    """Rates of a receiver that prefills at 1 token/s, reaches both peers at `bytes_per_s`, decodes
    fp16 at 1 GB/s and the transform codec at 10 MB/s, and counts `basis_bytes` for a missing basis."""
    rates = Rates(timed(data_dir, model_id, 1))
    for address in (full, coded):
        rates.record_transfer(address, 10 * MB, 10 * MB / bytes_per_s)
    # The 384-token copies: about 1.2 MB of fp16 and 0.35 MB coded.
    times = {"full": CodecTime(0, 1.2 * MB / 1e9 / 384), "transform": CodecTime(0, 0.35 * MB / 10e6 / 384)}
    rates.record_decoding(model_id, Decoding(times, basis_bytes=basis_bytes))
    return rates


def test_the_receiver_takes_the_copy_expected_soonest_across_peers(tiny_fp, two_copies, tmp_path):
    prompt, full, coded, basis = two_copies

    def found(name, **link):
        rates = receiver(tmp_path / name, tiny_fp.model_id, full, coded, **link)
        got = find_prefix(tiny_fp, prompt, CacheStore(tmp_path / name / "store"), peers=[full, coded], rates=rates)
        [decision] = got.fetch_or_prefill
        assert decision.fetch and {w.copy.codec for w in decision.weighed} == {"full", "transform"}
        assert got.tokens == 384 and got.where == f"peer {decision.where}"
        return decision

    # A fast link: the fp16 copy, which decodes at once, comes sooner than the coded one.
    assert found("fast", bytes_per_s=1e9, basis_bytes=basis.nbytes).where == full
    # A slow link: the coded copy's fewer bytes, basis and all, come sooner.
    slow = found("slow", bytes_per_s=200e3, basis_bytes=basis.nbytes)
    assert slow.where == coded and slow.best.copy.basis_bytes == basis.nbytes
    # A basis as large as a big model's tips it to the fp16 copy; once held here, back to the coded one.
    assert found("big", bytes_per_s=200e3, basis_bytes=40 * MB).where == full
    held = artifact_store(tmp_path / "held" / "store")
    held.put(basis.to_bytes(), basis.digest)
    held.set_model_basis(tiny_fp.model_id, basis.digest)
    assert found("held", bytes_per_s=200e3, basis_bytes=40 * MB).where == coded
    # A basis that came with a fetched copy is held too, from then on (the fetched cache dropped here).
    CacheStore(tmp_path / "slow" / "store").delete(slow.best.copy.cache_id)
    assert Rates(tmp_path / "slow").bases[tiny_fp.model_id] == [basis.digest]
    assert found("slow", bytes_per_s=200e3, basis_bytes=40 * MB).where == coded


def test_a_basis_held_here_is_read_and_hashed_once_per_process(tiny_fp, two_copies, tmp_path, monkeypatch):
    """Reading and hashing a basis (an 8B model's is ~130 MB) took longer than decoding a short cache:
    once this process parsed it, a fetch into a store that keeps it reads it no more. A store that
    lacks it still gets it from the sender, and keeps it."""
    prompt, _, coded, basis = two_copies
    [entry] = CacheStore(tmp_path / "coded").entries()
    profile = ReceiverProfile(tiny_fp, prompt=prompt)

    def fetch_into(store_dir):
        with PeerClient(coded) as client:
            return fetch_cache(client, entry.cache_id, profile, store=CacheStore(store_dir))

    first = fetch_into(tmp_path / "b")
    assert first.basis_bytes == basis.nbytes and artifact_store(tmp_path / "b").has(basis.digest)
    again = fetch_into(tmp_path / "b2")  # a store without the basis: it travels, and is kept
    assert again.basis_bytes == basis.nbytes and artifact_store(tmp_path / "b2").has(basis.digest)
    reads = []  # (the peer serves in this process too: it reads the basis to send it)
    read = ArtifactStore.get
    monkeypatch.setattr(ArtifactStore, "get", lambda self, digest: reads.append(digest) or read(self, digest))
    held = fetch_into(tmp_path / "b2")
    assert held.basis_bytes == 0 and reads == []
    for fetched in (first, again, held):
        assert all(mx.array_equal(a, b) for x, y in zip(first.cache, fetched.cache) for a, b in zip(x.state, y.state))
