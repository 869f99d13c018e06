"""Cross-layer prediction (kvmesh.codec.prediction): layers coded as the residual of their prediction
from the layer before decode to what the sender decoded, alike in NumPy and in MLX's graph, on the
layer threads and one by one, cut to prefixes, on the wire; and what cannot decode says why."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.basis_file import basis_bytes_bound
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.coded import TransformCoding, code_at_level, decoded
from kvmesh.codec.compat import validate_manifest
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.layer_blob import MAGIC_PREDICTED, TransformCodecError, cut_layer, read_header
from kvmesh.codec.layer_pool import map_layers
from kvmesh.codec.levels import LEVELS, PREDICTED_STEP
from kvmesh.codec.prediction import LayerChain, Predictor
from kvmesh.codec.rate import synthetic_basis, synthetic_layers
from kvmesh.codec.transform import encode_layers, layers_of_cache
from kvmesh.codec.transform_decode import decode_layer, decode_layers
from kvmesh.errors import IntegrityError
from kvmesh.reuse.weigh import codec_of, level_codec
from kvmesh.store import CacheStore
from kvmesh.v1 import service_pb2 as spb
from kvmesh.versions import PREDICTED_SCHEMA
from support.references import rounded_alike


@pytest.fixture(scope="module")
def basis(tiny) -> Basis:
    """The tiny model's basis as `kvmesh model calibrate` fits it: with predictors."""
    model, tokenizer = tiny
    return fit_model_basis(model, tokenizer, tokens_per_text=200).basis


@pytest.fixture(scope="module")
def layers(tiny, prompt_ids):
    """The 300-token prompt's cache, per layer (keys, values, positions)."""
    model, _ = tiny
    return layers_of_cache(prefill(model, prompt_ids, make_press("full")).cache)


def at_step(basis: Basis, step: float) -> Basis:
    """The basis with its predictors said to be fitted at `step` (so the encoder predicts there)."""
    return dataclasses.replace(basis, info={**basis.info, "predicted_step": step}, _bytes=None, _digest=None)


def largest_error(layers, decoded_layers) -> float:
    return max(
        float(mx.abs(got.astype(mx.float32) - mx.array(want).astype(mx.float32)).max())
        for (k, v, _), pair in zip(layers, decoded_layers, strict=True)
        for got, want in zip(pair, (k, v), strict=True)
    )


def test_calibration_fits_a_predictor_for_every_layer_after_the_first(basis):
    assert basis.predicted_step == PREDICTED_STEP == LEVELS["small"].predicted_step
    assert basis.keys[0].predictor is None and basis.values[0].predictor is None
    f = basis.keys[0].features
    for tb in basis.keys[1:]:
        assert tb.predictor is not None and tb.predictor.weights.shape == (2 * f + 1, f)
    for tb in basis.values[1:]:
        assert tb.predictor is not None and tb.predictor.weights.shape == (3 * f + 1, f)
    again = Basis.from_bytes(basis.to_bytes(), basis.digest)
    for mine, theirs in zip(basis.keys + basis.values, again.keys + again.values, strict=True):
        if mine.predictor is not None:
            assert np.array_equal(mine.predictor.weights, theirs.predictor.weights)
            assert np.array_equal(mine.predictor.residual_rms, theirs.predictor.residual_rms)
    assert basis.step_at(LEVELS["small"]) == PREDICTED_STEP
    assert basis.without_predictors().step_at(LEVELS["small"]) == LEVELS["small"].step


def test_only_the_predicted_step_predicts(basis, layers):
    predicted = encode_layers(layers, basis, step=PREDICTED_STEP).blobs
    assert [read_header(b)[0].get("predicted", False) for b in predicted] == [False] + [True] * (len(layers) - 1)
    assert all(b[:5] == MAGIC_PREDICTED for b in predicted[1:])
    for other in (encode_layers(layers, basis, step=0.3), encode_layers(layers, basis, ratio=6.0)):
        assert not any("predicted" in read_header(b)[0] for b in other.blobs)
    tail = encode_layers(layers, basis, step=PREDICTED_STEP, tail=16, tail_factor=0.5).blobs
    assert not any("predicted" in read_header(b)[0] for b in tail)


def test_at_a_fine_step_a_predicted_cache_decodes_as_close_as_one_coded_alone(basis, layers):
    """The sender predicts from what the receiver will decode: were they to disagree (another input,
    order or step), the error would grow layer by layer instead of staying within the step's."""
    step = 1e-3  # (every component sent, alone and predicted)
    fine = at_step(basis, step)
    alone = encode_layers(layers, fine.without_predictors(), step=step).blobs
    predicted = encode_layers(layers, fine, step=step).blobs
    f = basis.keys[0].features
    for blob in predicted[1:]:
        header = read_header(blob)[0]
        assert header["predicted"] and header["k"]["n"] == header["v"]["n"] == f
    bound = largest_error(layers, decode_layers(alone, fine.without_predictors()))
    assert largest_error(layers, decode_layers(predicted, fine)) < 2 * bound


def test_numpy_and_mlx_and_the_layer_threads_decode_a_predicted_cache_alike(basis, layers):
    blobs = encode_layers(layers, basis, step=PREDICTED_STEP).blobs
    assert encode_layers(layers, basis, step=PREDICTED_STEP, numpy=False).blobs == blobs
    decodes = {}
    for numpy in (True, False):
        chain = LayerChain()
        decodes[numpy] = [decode_layer(blob, basis, numpy=numpy, chain=chain) for blob in blobs]
    for mine, theirs in zip(decodes[True], decodes[False], strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert mx.allclose(a, b, atol=1e-4).item()
    together = decode_layers(blobs, basis)
    for mine, theirs in zip(decodes[mx.default_device() == mx.cpu], together, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert mx.array_equal(a, b).item()


def test_mlx_s_graph_decodes_a_predicted_cache_on_the_layer_threads(basis, layers):
    """What a Mac's GPU runs: each layer's graph on a thread of its own, the layer before's
    coefficients evaluated where they were made before the next thread reads them."""
    blobs = encode_layers(layers, basis, step=PREDICTED_STEP).blobs
    chain = LayerChain()
    for i in range(len(blobs)):
        chain.expect(i)
    threaded = map_layers(lambda blob: decode_layer(blob, basis, numpy=False, chain=chain), blobs)
    for mine, theirs in zip(threaded, decode_layers(blobs, basis), strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert mx.allclose(a, b, atol=1e-4).item()


def test_a_layer_predicted_from_one_handed_out_after_it_fails_at_once(basis, layers):
    """A sender's manifest may list layers in any order: a layer never waits for one the threads take
    after it (which could leave every thread waiting), and reads the layer before's coefficients once."""
    blobs = encode_layers(layers, basis, step=PREDICTED_STEP).blobs
    with pytest.raises(TransformCodecError, match="which comes after it"):
        decode_layers(blobs[::-1], basis)
    chain = LayerChain()
    decode_layer(blobs[0], basis, chain=chain)
    decode_layer(blobs[1], basis, chain=chain)
    with pytest.raises(TransformCodecError, match="not decoded before it"):  # (read, and dropped)
        decode_layer(blobs[1], basis, chain=chain)


def test_layers_at_other_positions_are_coded_alone(basis, layers):
    shifted = list(layers)
    keys, values, positions = shifted[2]
    shifted[2] = (keys, values, np.asarray(positions) + 5)
    blobs = encode_layers(shifted, basis, step=PREDICTED_STEP).blobs
    assert [read_header(b)[0].get("predicted", False) for b in blobs] == [False, True, False, False]


def test_a_predicted_cache_cuts_to_its_first_rows(basis, layers):
    blobs = encode_layers(layers, basis, step=PREDICTED_STEP).blobs
    whole = decode_layers(blobs, basis)
    for n in (1, 2, 57, 299):
        cut = [cut_layer(blob, n) for blob in blobs]
        assert all(read_header(b)[0].get("predicted") for b in cut[1:])
        for got, want in zip(decode_layers(cut, basis), whole, strict=True):
            for a, b in zip(got, want, strict=True):
                assert rounded_alike(a, b[:, :, :n])


def test_what_a_predicted_layer_cannot_decode_from_is_named(basis, layers):
    blobs = encode_layers(layers, basis, step=PREDICTED_STEP).blobs
    with pytest.raises(TransformCodecError, match="needs that layer decoded first"):
        decode_layer(blobs[1], basis)
    with pytest.raises(TransformCodecError, match="layer 1, which is not decoded before it"):
        decode_layer(blobs[2], basis, chain=LayerChain())
    broken = blobs[1][:-8]  # the layer before does not decode: the next fails with it, and waits for nothing
    with pytest.raises(TransformCodecError):
        decode_layers([blobs[0], broken, blobs[2]], basis)
    chain = LayerChain()
    decode_layer(blobs[0], basis, chain=chain)
    with pytest.raises(TransformCodecError):
        decode_layer(broken, basis, chain=chain)
    with pytest.raises(TransformCodecError, match="did not decode"):
        decode_layer(blobs[2], basis, chain=chain)
    bare = basis.without_predictors()
    bare = dataclasses.replace(bare, _digest=basis.digest)  # (the same id, no predictors: a basis that lies)
    with pytest.raises(BasisError, match="no predictor"):
        decode_layers(blobs[:2], bare)


def test_a_basis_with_predictors_for_some_layers_only_or_poisoned_ones_is_refused(basis):
    def changed(predictor) -> Basis:
        keys = [dataclasses.replace(tb, predictor=predictor) if i == 2 else tb for i, tb in enumerate(basis.keys)]
        return dataclasses.replace(basis, keys=keys, _bytes=None, _digest=None)

    weights, rms = basis.keys[2].predictor.weights, basis.keys[2].predictor.residual_rms
    nan = weights.copy()
    nan[0, 0] = np.nan
    for bad, why in [
        (None, "every layer after the first"),
        (Predictor(nan, rms), "NaN or infinite"),
        (Predictor(weights[:-1], rms), "a predictor"),
        (Predictor(weights, -rms), "outside"),
    ]:
        poisoned = changed(bad)
        with pytest.raises(BasisError, match=why):
            Basis.from_bytes(poisoned.to_bytes(), poisoned.digest)


def test_a_small_cache_travels_predicted_in_schema_4_and_decodes_as_where_it_was_made(tiny, basis, prompt_ids, tiny_fp):
    model, _ = tiny
    full = prefill(model, prompt_ids, make_press("full")).cache
    cache = code_at_level(full, basis, "small")
    manifest, chunks = encode_cache(cache, tiny_fp, prompt_ids)
    chunks = list(chunks)
    assert manifest.schema_version == PREDICTED_SCHEMA and validate_manifest(manifest) is None
    assert basis.nbytes <= basis_bytes_bound(manifest)  # (a receiver fetches a basis that predicts)
    assert [layer.transform.predicted for layer in manifest.layers] == [False] + [True] * (len(full) - 1)
    got = decode_chunks(manifest, chunks, bases={basis.digest: basis})
    for layer, same in zip(got, decoded(cache), strict=True):
        for a, b in zip(layer.keys_and_values(), same.keys_and_values(), strict=True):
            assert mx.array_equal(a, b).item()
    older = type(manifest)()
    older.CopyFrom(manifest)
    older.schema_version = PREDICTED_SCHEMA - 1
    assert "predicted from the layer before" in str(validate_manifest(older))
    default, _ = encode_cache(code_at_level(full, basis, "default"), tiny_fp, prompt_ids)
    assert default.schema_version < PREDICTED_SCHEMA


def test_a_lying_manifest_that_hides_the_prediction_is_refused(tiny, basis, prompt_ids, tiny_fp):
    model, _ = tiny
    full = prefill(model, prompt_ids, make_press("full")).cache
    manifest, chunks = encode_cache(code_at_level(full, basis, "small"), tiny_fp, prompt_ids)
    for layer in manifest.layers:
        layer.transform.predicted = False
    with pytest.raises(IntegrityError, match="predicted"):
        decode_chunks(manifest, list(chunks), bases={basis.digest: basis})


def test_a_synthetic_basis_that_predicts_codes_and_decodes_as_a_fitted_one():
    """The benchmarks' 8B-geometry basis: predictors of zeros, which cost the codec what fitted ones do."""
    synthetic = synthetic_basis(3, 2, 16, predicted_step=PREDICTED_STEP)
    layers = synthetic_layers(synthetic, 40)
    coded = TransformCoding.at_level(synthetic, LEVELS["small"]).encode(layers)
    assert [read_header(b)[0].get("predicted", False) for b in coded.blobs] == [False, True, True]
    alone = TransformCoding.at_level(synthetic.without_predictors(), LEVELS["small"])
    assert alone.step == LEVELS["small"].one_step  # (no factors, no predictors)
    assert largest_error(layers, decode_layers(coded.blobs, synthetic)) < 10 * float(synthetic.keys[0].rms[0])


def test_a_store_says_which_caches_are_predicted_and_the_choice_weighs_them_apart(
    tiny, basis, prompt_ids, tiny_fp, tmp_path
):
    """A lookup answers `predicted` from the store's index, so the choice weighs such a copy with
    this machine's decode time of predicted caches (slower on a CPU), not of those coded alone."""
    model, _ = tiny
    full = prefill(model, prompt_ids, make_press("full")).cache
    store = CacheStore(tmp_path / "store")
    for level in ("default", "small"):
        store.add(*encode_cache(code_at_level(full, basis, level), tiny_fp, prompt_ids))
    assert sorted(e.predicted for e in store.entries()) == [False, True]
    coded = {"method": "full", "lossy": True}
    assert codec_of(spb.Candidate(**coded, predicted=True)) == "predicted"
    assert codec_of(spb.Candidate(**coded)) == "transform"
    assert level_codec("small") == "predicted" and level_codec("default") == "transform"
