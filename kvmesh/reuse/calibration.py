"""What the choice weighs with, measured once per model on this machine: its prefill rate (two timed
prefills) and how fast it decodes the model's caches in each codec (`measure_decoding`).

`measure_decoding` times the real decoder (kvmesh.codec.decode) on a small cache of the model, of
arbitrary tokens, in each codec a peer may send: as computed (zstd), 8-bit quantized, and transform
coded with a basis fitted on that cache (the basis's size is what a receiver that lacks it fetches
first). It is one function so that the codec's own cheap decode-rate measurement can replace it.
"""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from kvmesh.caches.prefill import run_prompt, time_prefills
from kvmesh.caches.presses import Press, make_press
from kvmesh.codec.basis import fit_basis
from kvmesh.codec.calibration import full_attention_layers
from kvmesh.codec.coded import TransformCoding, transform_code
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.rate import fastest_run
from kvmesh.codec.rotary import model_rotaries
from kvmesh.codec.transform import layers_of_cache
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.reuse.rates import Decoding, Rates

# The cache the decoders are timed on: long enough that per-chunk costs are a small share, short
# enough that its one prefill costs a server's start little (512 tokens and three prefills took
# 4.4 s of a tiny model's start here; this, one prefill of 256, about a second).
DECODE_SAMPLE_TOKENS = 256
# Timed decodes of each codec's copy of it (after one that warms the decoder up).
DECODE_REPEAT = 2


def ensure_calibrated(
    model: nn.Module, model_fp: ModelFingerprint, rates: Rates, *, announce: Callable[[], None] | None = None
) -> bool:
    """Measure the model's prefill rate and decode rates here, each unless it was measured before;
    `announce` is called first when anything is to be measured (it takes seconds). Whether it was."""
    model_id = model_fp.model_id
    todo = rates.prefill_model(model_id) is None, rates.decoding(model_id) is None
    if not any(todo):
        return False
    if announce is not None:
        announce()
    if todo[0]:
        for tokens, seconds in time_prefills(model):
            rates.record_prefill(model_id, tokens, seconds)
    if todo[1]:
        rates.record_decoding(model_id, measure_decoding(model, model_fp))
    return True


def measure_decoding(model: nn.Module, model_fp: ModelFingerprint, tokens: int = DECODE_SAMPLE_TOKENS) -> Decoding:
    """This machine's decode rate of the model's caches in each codec (bytes on the wire per second),
    timed on a cache of `tokens` arbitrary tokens, and the size of a basis of the model's geometry."""
    prompt = [1 + i % 97 for i in range(tokens)]
    fresh, _, _ = run_prompt(model, prompt)  # mlx-lm's own caches, run once: every copy is made of them
    full = Press().apply(fresh)
    rates = {"full": decode_rate(full, model_fp, prompt)}
    quantize = make_press("quantize", {"kv_bits": 8})
    rates["quantized"] = decode_rate(quantize.apply(fresh), model_fp, prompt, quantize)
    layers = full_attention_layers(model, fresh)
    if not layers:  # nothing the transform codec codes in this model
        return Decoding(rates)
    calibration = [layers_of_cache([fresh[i] for i in layers])]
    basis = fit_basis(calibration, model_rotaries(model, layers), info={"layers": layers})
    coded = transform_code(full, TransformCoding(basis, step=LEVELS["default"].step_for(basis.has_step_factors)))
    rates["transform"] = decode_rate(coded, model_fp, prompt, bases={basis.digest: basis})
    return Decoding(rates, basis.nbytes)


def decode_rate(
    cache: list, model_fp: ModelFingerprint, prompt: list[int], press=None, *, bases=None, repeat: int = DECODE_REPEAT
) -> float:
    """Bytes on the wire per second the real decoder turns into MLX caches, for `cache` encoded: the
    fastest of `repeat` decodes after a warm-up (`kvmesh.codec.rate.fastest_run`). On a cache this
    short a layer's fixed costs weigh more than on a long one: on this box the transform rate so
    measured is about a third of what a 1,024-token fetch of SmolLM2 decodes."""
    manifest, chunks = encode_cache(cache, model_fp, prompt, press)
    encoded = list(chunks)

    def decode() -> None:
        decoded = decode_chunks(manifest, encoded, bases=bases or {})
        mx.eval([layer.state for layer in decoded])  # type: ignore[union-attr]  # decoded: never a CodedLayer

    return sum(len(c.data) for c in encoded) / fastest_run(decode, repeat=repeat)
