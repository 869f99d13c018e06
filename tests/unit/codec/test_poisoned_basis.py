"""A transform basis is held to what a basis is, not only to its digest (issue 32): one of NaN, inf or
huge numbers, one larger than the cache's geometry allows, or one of another geometry, is refused with
reason `artifact` by a receiver (the `kvmesh fetch` command, from a real peer process that sends it),
kept nowhere, and served by no daemon, not even one that kept it under an older version. A layer that
decodes to numbers that are not finite never reaches the store."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.basis import Basis, TensorBasis
from kvmesh.codec.basis_file import basis_bytes_bound
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.coded import TransformCoding, transform_code
from kvmesh.codec.decode import CacheDecoder, decode_chunks
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.prediction import Predictor
from kvmesh.codec.rotary import Rotary
from kvmesh.errors import IntegrityError, PeerError
from kvmesh.net.client import PeerClient
from kvmesh.reuse.receive import receive
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import ArtifactStore, Incoming, artifact_store
from kvmesh.v1 import cache_pb2 as pb
from support import artifact_peer
from support.poisoned_basis import recoded
from support.processes import cli


@pytest.fixture(scope="module")
def honest(tiny, prompt_ids):
    """(the tiny model's basis, the prompt's cache transform coded with it)."""
    model, tokenizer = tiny
    basis = fit_model_basis(model, tokenizer, tokens_per_text=200).basis
    full = prefill(model, prompt_ids, make_press("full")).cache
    return basis, transform_code(full, TransformCoding(basis, step=0.02))


def tensor_copy(tb: TensorBasis) -> TensorBasis:
    return TensorBasis(tb.mean.copy(), tb.components.copy(), tb.rms.copy(), tb.predictor)


def altered(basis: Basis, change) -> Basis:
    """A copy of `basis` that `change(keys, values, rotaries, info)` altered in place."""
    keys, values = [tensor_copy(k) for k in basis.keys], [tensor_copy(v) for v in basis.values]
    rotaries, info = list(basis.rotaries), json.loads(json.dumps(basis.info))
    change(keys, values, rotaries, info)
    return Basis(keys, values, rotaries, info)


def nan_component(keys, values, rotaries, info):
    keys[0].components[0, 0] = np.nan


def inf_mean(keys, values, rotaries, info):
    values[0].mean[0] = np.inf


def huge_rms(keys, values, rotaries, info):
    keys[0].rms[0] = 1e30


def extra_layer(keys, values, rotaries, info):
    """One more layer, of a model layer the model does not have (small: a basis under the bound)."""
    f = keys[0].features
    unit = TensorBasis(np.zeros(f, np.float32), np.eye(f, dtype=np.float16), np.ones(f, np.float32))
    # (predicted from the layer before, as every layer after the first of a basis that predicts)
    keys.append(replace(unit, predictor=Predictor(np.zeros((2 * f + 1, f), np.float16), np.ones(f, np.float32))))
    values.append(replace(unit, predictor=Predictor(np.zeros((3 * f + 1, f), np.float16), np.ones(f, np.float32))))
    rotaries.append(rotaries[0])
    info["layers"].append(len(info["layers"]))
    for factors in info["steps"].values():
        factors.append(1.0)


def huge_step(keys, values, rotaries, info):
    """A step factor no sensitivity gives (the encoder would send nothing of that tensor)."""
    info["steps"]["k"][0] = 1e9


def swapped_layers(keys, values, rotaries, info):
    """The same tensors, said to cover model layers 1 and 0 the other way round."""
    info["layers"][:2] = info["layers"][1::-1]


def sender_store(root, cache: list, basis: Basis, tiny_fp, prompt_ids) -> pb.CacheManifest:
    """A store holding `cache` and the bytes of `basis` as they are (written past the store's checks,
    as an older version or a liar keeps them)."""
    manifest = CacheStore(root).add(*encode_cache(cache, tiny_fp, prompt_ids))
    path = artifact_store(root).path(basis.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(basis.to_bytes())
    return manifest


@pytest.fixture
def peer():
    """peer(store, calls, *flags) -> address of a support.artifact_peer process, killed at the end."""
    started = []

    def start(store, calls, *flags) -> str:
        process, address = artifact_peer.start(store, calls, *flags)
        started.append(process)
        return address

    yield start
    for process in started:
        process.kill()
        process.wait()


def refused(result, digest: str, *words: str) -> None:
    """`kvmesh fetch` refused the cache in one line naming the reason `artifact`, the basis and `words`."""
    assert result.returncode == 1 and result.stdout == "", result
    assert result.stderr.startswith("kvmesh: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "artifact" in result.stderr and f"basis {digest[:12]}" in result.stderr, result.stderr
    assert all(w in result.stderr for w in words), result.stderr


def holds_nothing(store_root) -> None:
    """No cache, and no artefact nor temporary file of one, in the store."""
    assert CacheStore(store_root).entries() == []
    artifacts = store_root / "artifacts"
    assert not artifacts.exists() or not [p for p in artifacts.rglob("*") if p.is_file()]


def calls_of(path) -> list[tuple[str, int]]:
    """The Artifact calls the peer answered: (sha256, bytes sent)."""
    if not path.exists():
        return []
    return [(sha, int(n)) for sha, n in (line.split() for line in path.read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize(
    "poison, words",
    [
        (nan_component, "NaN or infinite"),
        (inf_mean, "NaN or infinite"),
        (huge_rms, "an RMS of 1e+30"),
        (huge_step, "its step factors for k hold a number outside [0.001, 1000]"),
    ],
)
def test_a_poisoned_basis_of_the_right_digest_is_refused_and_kept_nowhere(
    honest, poison, words, peer, tiny_dir, tiny_fp, prompt_ids, tmp_path
):
    basis, cache = honest
    bad = altered(basis, poison)
    manifest = sender_store(tmp_path / "a", recoded(cache, bad), bad, tiny_fp, prompt_ids)
    address = peer(tmp_path / "a", tmp_path / "calls")
    store_b = tmp_path / "b"
    result = cli("fetch", manifest.cache_id, "--peer", address, "--model", tiny_dir, "--store", store_b, check=False)
    refused(result, bad.digest, words)
    holds_nothing(store_b)
    assert calls_of(tmp_path / "calls") == [(bad.digest, bad.nbytes)]  # it arrived whole, and was refused


@pytest.mark.slow
def test_a_refused_basis_reaches_no_third_node(honest, peer, daemons, tiny_dir, tiny_fp, prompt_ids, tmp_path):
    basis, cache = honest
    bad = altered(basis, nan_component)
    manifest = sender_store(tmp_path / "a", recoded(cache, bad), bad, tiny_fp, prompt_ids)
    address = peer(tmp_path / "a", tmp_path / "calls")
    store_b, store_c = tmp_path / "b", tmp_path / "c"
    result = cli("fetch", manifest.cache_id, "--peer", address, "--model", tiny_dir, "--store", store_b, check=False)
    refused(result, bad.digest)
    b = daemons.start(tmp_path / "b.data", "--store", store_b)
    third = cli("fetch", manifest.cache_id, "--peer", b.address, "--model", tiny_dir, "--store", store_c, check=False)
    assert third.returncode == 1 and "no cache" in third.stderr, third
    holds_nothing(store_c)
    with PeerClient(b.address) as client, pytest.raises(PeerError, match="not_found"):
        client.artifact(bad.digest, bad.nbytes, lambda piece: None)


@pytest.mark.slow
def test_a_poisoned_basis_an_older_version_kept_is_never_served(
    honest, daemons, tiny_dir, tiny_fp, prompt_ids, tmp_path
):
    basis, cache = honest
    bad = altered(basis, huge_rms)
    manifest = sender_store(tmp_path / "b", recoded(cache, bad), bad, tiny_fp, prompt_ids)
    b = daemons.start(tmp_path / "b.data", "--store", tmp_path / "b")
    store_c = tmp_path / "c"
    third = cli("fetch", manifest.cache_id, "--peer", b.address, "--model", tiny_dir, "--store", store_c, check=False)
    refused(third, bad.digest, "not_found")
    holds_nothing(store_c)
    assert not artifact_store(tmp_path / "b").has(bad.digest)  # removed where it lay, once read
    assert f"cannot serve artefact {bad.digest[:12]}" in b.log.read_text()
    assert "no sane basis" in b.log.read_text()


@pytest.mark.slow
def test_a_basis_announced_larger_than_the_geometry_allows_is_refused_before_any_byte(
    honest, peer, tiny_dir, tiny_fp, prompt_ids, tmp_path
):
    basis, cache = honest
    manifest = sender_store(tmp_path / "a", cache, basis, tiny_fp, prompt_ids)
    address = peer(tmp_path / "a", tmp_path / "calls", "--announce", 1 << 30)
    store_b = tmp_path / "b"
    result = cli("fetch", manifest.cache_id, "--peer", address, "--model", tiny_dir, "--store", store_b, check=False)
    bound = basis_bytes_bound(manifest)
    refused(result, basis.digest, f"({1 << 30:,} bytes)", f"at most {bound:,}")
    assert calls_of(tmp_path / "calls") == []  # the Artifact call was never made: not a byte moved
    holds_nothing(store_b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, words",
    [
        (extra_layer, "it covers model layers 0..4, the cache's model has 4"),
        (swapped_layers, "layer 0 is coded with basis layer 0, which covers model layer 1"),
    ],
)
def test_a_basis_under_the_bound_but_of_another_geometry_is_refused(
    honest, change, words, peer, tiny_dir, tiny_fp, prompt_ids, tmp_path
):
    basis, cache = honest
    other = altered(basis, change)
    manifest = sender_store(tmp_path / "a", recoded(cache, other), other, tiny_fp, prompt_ids)
    assert other.nbytes <= basis_bytes_bound(manifest)
    address = peer(tmp_path / "a", tmp_path / "calls")
    store_b = tmp_path / "b"
    result = cli("fetch", manifest.cache_id, "--peer", address, "--model", tiny_dir, "--store", store_b, check=False)
    refused(result, other.digest, words)
    holds_nothing(store_b)


def test_the_bound_holds_the_real_basis_and_little_more(honest, tiny_fp, prompt_ids):
    basis, cache = honest
    manifest, _ = encode_cache(cache, tiny_fp, prompt_ids)
    # 4 layers of 2 heads of 64: 0.27 MB in float16, at most twice that with float32 components.
    assert basis.nbytes < basis_bytes_bound(manifest) < 3 * basis.nbytes


def test_the_artifact_store_keeps_no_poisoned_basis_and_reads_none_back(honest, tmp_path):
    basis, _ = honest
    store = ArtifactStore(tmp_path / "artifacts")
    for poison in (nan_component, inf_mean, huge_rms):
        bad = altered(basis, poison)
        with pytest.raises(IntegrityError, match="no sane basis"):
            store.put(bad.to_bytes(), bad.digest)
        assert not store.has(bad.digest)
        with Incoming(store.root) as incoming:  # as it arrives from a peer
            incoming.write(bad.to_bytes())
            with pytest.raises(IntegrityError, match="no sane basis"):
                incoming.read(bad.digest)
            with pytest.raises(IntegrityError, match="not checked"):
                store.keep(incoming, bad.digest)
        store.path(bad.digest).write_bytes(bad.to_bytes())  # kept by an older version
        with pytest.raises(IntegrityError, match="no sane basis"):
            store.get(bad.digest)
        assert not store.has(bad.digest)
    assert [p.name for p in store.root.iterdir()] == []
    with Incoming(store.root) as incoming:
        incoming.write(basis.to_bytes())
        incoming.read(basis.digest)
        store.keep(incoming, basis.digest)
    assert store.get(basis.digest) == basis.to_bytes() and [p.name for p in store.root.iterdir()] == [basis.digest]


def test_rotary_settings_that_are_not_finite_are_refused(honest):
    basis, _ = honest

    def nan_base(keys, values, rotaries, info):
        rotaries[0] = Rotary(rotaries[0].dims, rotaries[0].traditional, base=float("nan"))

    bad = altered(basis, nan_base)
    with pytest.raises(ValueError, match="not finite and positive"):
        Basis.from_bytes(bad.to_bytes(), bad.digest)


def test_a_layer_that_decodes_to_numbers_not_finite_never_reaches_the_store(honest, tiny_fp, prompt_ids, tmp_path):
    """Decoded with a poisoned basis handed over as it is (past every check of its bytes), or sent as
    plain float16 holding a NaN: the decoder refuses, and the store keeps nothing."""
    basis, cache = honest
    bad = altered(basis, nan_component)
    manifest, chunks = encode_cache(recoded(cache, bad), tiny_fp, prompt_ids)
    chunks = list(chunks)
    with pytest.raises(IntegrityError, match="NaN or infinite numbers"):
        decode_chunks(manifest, chunks, bases={bad.digest: bad})
    store = CacheStore(tmp_path / "store")
    with pytest.raises(IntegrityError, match="NaN or infinite numbers"):
        store.add(manifest, CacheDecoder(manifest, {bad.digest: bad}).feed_iter(chunks))
    # As a fetch keeps it: written and synced while its layers decode, indexed only once they have.
    with pytest.raises(IntegrityError, match="NaN or infinite numbers"):
        receive(manifest, chunks, {bad.digest: bad}, store)
    assert list(store.incoming_dir.iterdir()) == []
    values = mx.ones((1, 2, 64, 64))
    values[0, 1, 7, 3] = mx.nan
    plain = [SparseKVCache.from_arrays(mx.ones((1, 2, 64, 64)), values, 64) for _ in range(4)]
    manifest, made = encode_cache(plain, tiny_fp, list(range(64)))
    chunks = list(made)
    with pytest.raises(IntegrityError, match=r"tensor 1 \(values\) of the cache holds NaN"):
        store.add(manifest, CacheDecoder(manifest).feed_iter(chunks))
    with pytest.raises(IntegrityError, match=r"tensor 1 \(values\) of the cache holds NaN"):
        receive(manifest, chunks, {}, store)
    assert store.entries() == [] and list(store.incoming_dir.iterdir()) == []
