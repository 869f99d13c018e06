"""Honest loss labels between real daemons (issue #30), as a user makes and fetches caches: a cache
`kvmesh prefill --kv-bits` made is recorded as lossy with its measured loss, a quality floor below
that loss refuses it before any cache byte, and a full-precision copy of the same prefix on another
peer wins over it, though it is the smaller."""

import json

import pytest

from kvmesh.store import CacheStore
from support.processes import cli

pytestmark = pytest.mark.slow

PROMPT = "The lighthouse keeper wrote down every ship that passed, and the weather, and the tide. " * 12
# 2 bits: the tiny model measures 3-bit quantization within AS_GOOD_KL (ranked as good as exact), 2-bit
# well beyond it, as the real model does 3-bit (0.25 nats/token).
BITS = "2"


@pytest.fixture(scope="module")
def copies(tiny_dir, tmp_path_factory):
    """{"bits": ..., "full": ...}: (store dir, `prefill --json`'s result) of the prompt prefilled with
    `--kv-bits` alone, and at full precision, each in a store of its own."""
    root = tmp_path_factory.mktemp("copies")
    made = {}
    for name, options in (("bits", ["--kv-bits", BITS]), ("full", [])):
        store = root / name
        out = cli("prefill", tiny_dir, "--prompt", PROMPT, *options, "--store", store, "--json")
        made[name] = (store, json.loads(out.stdout))
    return made


def test_kv_bits_alone_is_recorded_as_lossy_with_its_measured_loss(copies):
    store, result = copies["bits"]
    assert result["compression"] == f"quantize {BITS}-bit" and result["tail_kl"] > 0
    entry = CacheStore(store).entry(result["cache_id"])
    assert (
        entry.method == "quantize"
        and entry.lossy
        and entry.loss_metric == "tail_kl"
        and entry.loss == pytest.approx(result["tail_kl"])
    )
    _, full = copies["full"]
    assert full["compression"] == "full" and full["tail_kl"] is None
    assert result["stored_bytes"] < full["stored_bytes"]


def test_full_with_kv_bits_is_one_clear_line(tiny_dir, tmp_path):
    refused = cli("prefill", tiny_dir, "--prompt", PROMPT, "--method", "full", "--kv-bits", "3", check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "full keeps every value as computed: kv_bits needs quantize" in refused.stderr


def test_a_quality_floor_below_its_loss_refuses_it(copies, tiny_dir, daemons, tmp_path):
    store, result = copies["bits"]
    assert result["tail_kl"] > 0.0001
    peer = daemons.start(tmp_path / "a.data", "--store", store)
    mine = tmp_path / "mine"
    refused = cli(
        "fetch", result["cache_id"], "--peer", peer.address, "--model", tiny_dir, "--store", mine, "--max-kl", "0.0001",
        check=False,
    )  # fmt: skip
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert f"a quantize {BITS}-bit cache measured at {result['tail_kl']:.4f} nats/token" in refused.stderr
    assert not CacheStore(mine).entries()


def test_a_full_copy_on_another_peer_wins_over_the_smaller_kv_bits_one(copies, tiny_dir, daemons, tmp_path):
    peers = {name: daemons.start(tmp_path / f"{name}.data", "--store", copies[name][0]) for name in copies}
    asked = [arg for name in ("bits", "full") for arg in ("--peer", peers[name].address)]  # the lossy one first
    out = cli(
        "generate", tiny_dir, "--prompt", PROMPT + " And", "--max-tokens", "2", "--fetch", "always",
        "--store", tmp_path / "mine", "--json", *asked, data_dir=tmp_path / "me",
    )  # fmt: skip
    found = json.loads(out.stdout)
    assert (found["prefix_from"], found["cache_id"]) == (f"peer {peers['full'].address}", copies["full"][1]["cache_id"])
