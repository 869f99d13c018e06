"""Honest loss labels (issue #30): bits alone (`prefill --kv-bits` without `--method`) quantize, and are
measured, ranked and held to quality floors as `quantize` is; a cache whose layers are quantized is
never taken for lossless, whatever method its manifest names (older kvmesh recorded bits alone as
`full`), and a store's index of those days is rebuilt."""

import math
import sqlite3

import pytest

from kvmesh.caches.prefill import prefill, run_prompt
from kvmesh.caches.presses import Press, make_press, press_named
from kvmesh.caches.sparse import SparseQuantizedKVCache
from kvmesh.codec.compat import loss_rank, quality_problem
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.manifest import compression_name, lossy, measured_loss
from kvmesh.errors import PressConfigError
from kvmesh.store import CacheStore
from kvmesh.store.cache_store import INDEX
from kvmesh.v1 import cache_pb2 as pb

LENGTH = 256


def test_bits_alone_quantize_and_measure_their_loss(tiny, prompt_ids):
    press = press_named(None, {"kv_bits": 3})
    assert press == make_press("quantize", {"kv_bits": 3}) and press.lossy
    assert press_named(None, {}) == Press() and not Press().lossy
    pressed = prefill(tiny[0], prompt_ids[:LENGTH], press)
    assert all(isinstance(c, SparseQuantizedKVCache) and c.bits == 3 for c in pressed.cache)
    assert pressed.tail_kl is not None and pressed.tail_kl > 0


def test_full_with_bits_is_refused():
    with pytest.raises(PressConfigError, match="^full keeps every value as computed: kv_bits needs quantize"):
        make_press("full", {"kv_bits": 3})


def old_label(model, fp, tokens: list[int], bits: int) -> tuple[pb.CacheManifest, list]:
    """A `bits`-bit cache of `tokens` recorded as older kvmesh recorded bits alone: method `full`, no
    loss measured."""
    quantized = make_press("quantize", {"kv_bits": bits}).apply(run_prompt(model, tokens)[0])
    manifest, chunks = encode_cache(quantized, fp, tokens, Press())
    assert manifest.compression.method == "full" and not manifest.HasField("quality")
    return manifest, list(chunks)


def test_quantized_layers_are_lossy_whatever_the_method_says(tiny, tiny_fp, prompt_ids):
    manifest, _ = old_label(tiny[0], tiny_fp, prompt_ids[:LENGTH], 3)
    assert lossy(manifest) and compression_name(manifest) == "full 3-bit"
    assert loss_rank(lossy(manifest), measured_loss(manifest)) == math.inf
    rejection = quality_problem(manifest, 0.0001)
    assert rejection is not None and rejection.reason == pb.REJECT_REASON_QUALITY
    assert rejection.message.startswith("a full 3-bit cache whose loss its producer did not measure")


def test_an_index_of_version_4_is_rebuilt_so_an_old_label_loses_to_the_full_copy(tiny, tiny_fp, prompt_ids, tmp_path):
    model, _ = tiny
    tokens = prompt_ids[:LENGTH]
    store = CacheStore(tmp_path / "store")
    three = store.add(*old_label(model, tiny_fp, tokens, 3))
    full = store.add(*encode_cache(prefill(model, tokens).cache, tiny_fp, tokens))
    assert three.encoding.encoded_bytes < full.encoding.encoded_bytes  # smaller: it won ties before
    with sqlite3.connect(tmp_path / "store" / INDEX) as db:  # as kvmesh with index version 4 left it
        db.execute("UPDATE entries SET lossy = 0")
        db.execute("PRAGMA user_version = 4")
    reopened = CacheStore(tmp_path / "store")
    old = reopened.entry(three.cache_id)
    assert old.lossy and old.loss is None
    match = reopened.lookup(tiny_fp.model_id, prompt_ids)
    assert match is not None and (match.entry.cache_id, match.tokens) == (full.cache_id, LENGTH)
