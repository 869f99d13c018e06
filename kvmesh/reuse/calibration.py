"""What the choice weighs with, measured once per model on this machine: its prefill rate (two timed
prefills) and how long it takes to decode the model's caches in each codec (`measure_decoding`).

`measure_decoding` times the real decoder (kvmesh.codec.decode) on small caches of the model, of
arbitrary tokens and of two lengths (a fixed cost and one per token: kvmesh.reuse.rates.DecodeTime),
in each codec a peer may send: as computed (zstd), 8-bit quantized, and transform coded with a
basis fitted on the longer cache (the basis's size is what a receiver that lacks it fetches first).
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
from kvmesh.reuse.rates import Decoding, Rates, fit_decode_time

# The caches the decoders are timed on: two lengths, so that a layer's fixed costs are told apart
# from its cost per token, short enough that their prefills cost a server's start little (512
# tokens and three prefills took 4.4 s of a tiny model's start here; one prefill of 256, about a
# second).
DECODE_SAMPLE_TOKENS = (64, 256)
# Timed decodes of each codec's copy of each (after one that warms the decoder up).
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


def measure_decoding(
    model: nn.Module, model_fp: ModelFingerprint, lengths: tuple[int, ...] = DECODE_SAMPLE_TOKENS
) -> Decoding:
    """How long this machine takes to decode the model's caches in each codec, fitted to decodes of
    caches of arbitrary tokens of each of `lengths`, and the size of a basis of the model's geometry."""
    prompts = [[1 + i % 97 for i in range(n)] for n in lengths]
    # mlx-lm's own caches, run once per length: every copy is made of them.
    fresh = [run_prompt(model, prompt)[0] for prompt in prompts]
    full = [Press().apply(cache) for cache in fresh]
    quantize = make_press("quantize", {"kv_bits": 8})
    copies: dict[str, list[tuple[list, Press | None]]] = {
        "full": [(c, None) for c in full],
        "quantized": [(quantize.apply(cache), quantize) for cache in fresh],
    }
    basis = None
    if layers := full_attention_layers(model, fresh[-1]):  # else nothing the transform codec codes
        calibration = [layers_of_cache([fresh[-1][i] for i in layers])]
        basis = fit_basis(calibration, model_rotaries(model, layers), info={"layers": layers})
        coding = TransformCoding(basis, step=LEVELS["default"].step_for(basis.has_step_factors))
        copies["transform"] = [(transform_code(c, coding), None) for c in full]
    bases = {basis.digest: basis} if basis else {}
    times = {
        codec: fit_decode_time([
            (len(prompt), decode_seconds(cache, model_fp, prompt, press, bases=bases))
            for prompt, (cache, press) in zip(prompts, caches, strict=True)
        ])
        for codec, caches in copies.items()
    }  # fmt: skip
    return Decoding(times, basis.nbytes if basis else 0)


def decode_seconds(
    cache: list, model_fp: ModelFingerprint, prompt: list[int], press=None, *, bases=None, repeat: int = DECODE_REPEAT
) -> float:
    """Seconds the real decoder takes to turn `cache`, encoded, into MLX caches: the fastest of
    `repeat` decodes after a warm-up (`kvmesh.codec.rate.fastest_run`)."""
    manifest, chunks = encode_cache(cache, model_fp, prompt, press)
    encoded = list(chunks)

    def decode() -> None:
        decoded = decode_chunks(manifest, encoded, bases=bases or {})
        mx.eval([layer.state for layer in decoded])  # type: ignore[union-attr]  # decoded: never a CodedLayer

    return fastest_run(decode, repeat=repeat)
