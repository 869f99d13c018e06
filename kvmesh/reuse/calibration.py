"""What the choice weighs with, measured once per model on this machine: its prefill rate (two timed
prefills) and how long it takes to decode the model's caches in each codec (`measure_decoding`).

`measure_decoding` times what a fetch does here once the bytes are in: the real decoder
(kvmesh.codec.decode) turning the chunks into MLX caches while the store keeps them, in a store on
the data directory's disk. It does so on small caches of the model, of arbitrary tokens and of two
lengths (a fixed cost and one per token: kvmesh.codec.timing.CodecTime), in each codec a peer may
send: as computed (zstd), 8-bit quantized, and transform coded with a basis fitted on the longer
cache (the basis's size, with the predictors `kvmesh model calibrate` adds, is what a receiver that lacks
it fetches first).
"""

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from kvmesh.caches.prefill import run_prompt, time_prefills
from kvmesh.caches.presses import Press, make_press
from kvmesh.codec.basis import Basis, fit_basis
from kvmesh.codec.calibration import full_attention_layers
from kvmesh.codec.coded import code_at_level
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.levels import PREDICTED_STEP
from kvmesh.codec.rate import fastest_run, with_zero_predictors
from kvmesh.codec.rotary import model_rotaries
from kvmesh.codec.timing import CodecTime, fit_codec_time
from kvmesh.codec.transform import layers_of_cache
from kvmesh.errors import StoreError
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.reuse.rates import Decoding, Rates
from kvmesh.reuse.receive import receive
from kvmesh.store import CacheStore

log = logging.getLogger(__name__)
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
    decoding = rates.decoding(model_id)
    # (measured before predicted copies were: measured again)
    stale = decoding is not None and "transform" in decoding.times and "predicted" not in decoding.times
    todo = rates.prefill_model(model_id) is None, decoding is None or stale
    if not any(todo):
        return False
    if announce is not None:
        announce()
    if todo[0]:
        for tokens, seconds in time_prefills(model):
            rates.record_prefill(model_id, tokens, seconds)
    if todo[1]:
        rates.record_decoding(model_id, measure_decoding(model, model_fp, scratch=rates.path.parent))
    return True


def measure_decoding(
    model: nn.Module,
    model_fp: ModelFingerprint,
    lengths: tuple[int, ...] = DECODE_SAMPLE_TOKENS,
    *,
    scratch: Path | None = None,
) -> Decoding:
    """How long this machine takes to decode and keep the model's caches in each codec, fitted to
    caches of arbitrary tokens of each of `lengths` (kept in stores made in `scratch`, a directory on
    the disk the store uses; default: the system's temporary one), and the size of a basis of the
    model's geometry."""
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
    bases: dict[str, Basis] = {}
    if layers := full_attention_layers(model, fresh[-1]):  # else nothing the transform codec codes
        calibration = [layers_of_cache([fresh[-1][i] for i in layers])]
        basis = fit_basis(calibration, model_rotaries(model, layers), info={"layers": layers})
        copies["transform"] = [(code_at_level(c, basis, "default"), None) for c in full]
        # `small`, each layer predicted from the one before: predictors of zeros cost the decoder
        # what fitted ones do, and fitting them here would take an 8B model's start seconds.
        predicting = with_zero_predictors(basis, PREDICTED_STEP)
        copies["predicted"] = [(code_at_level(c, predicting, "small"), None) for c in full]
        bases = {b.digest: b for b in (basis, predicting)}

    def timed(keep_in: Path | None) -> dict[str, CodecTime]:
        return {
            codec: fit_codec_time([
                (len(prompt), receive_seconds(cache, model_fp, prompt, press, bases=bases, scratch=keep_in))
                for prompt, (cache, press) in zip(prompts, caches, strict=True)
            ])
            for codec, caches in copies.items()
        }  # fmt: skip

    try:
        with tempfile.TemporaryDirectory(prefix="kvmesh-calibration-", dir=scratch) as tmp:
            times = timed(Path(tmp))
    except (OSError, StoreError) as e:  # a full disk, a data dir not made yet: the choice is only advice
        log.warning("cannot time keeping caches in %s (%s): timing decoding alone", scratch or "a temporary dir", e)
        times = timed(None)
    # (the basis `kvmesh model calibrate` fits holds predictors: kvmesh.codec.prediction)
    return Decoding(times, predicting.nbytes if basis else 0)


def receive_seconds(
    cache: list,
    model_fp: ModelFingerprint,
    prompt: list[int],
    press: Press | None = None,
    *,
    bases: dict[str, Basis],
    scratch: Path | None,
    repeat: int = DECODE_REPEAT,
) -> float:
    """Seconds a receiver takes to turn `cache`, encoded, into MLX caches while a store in `scratch`
    keeps it (None: kept nowhere), in the pass a fetch makes over chunks that arrived
    (`kvmesh.reuse.receive`): the fastest of `repeat` after a warm-up
    (`kvmesh.codec.rate.fastest_run`), each into a store of its own."""
    manifest, chunks = encode_cache(cache, model_fp, prompt, press)
    encoded = list(chunks)
    # Made before the timing starts, as a fetch finds its store made.
    stores = [CacheStore(Path(tempfile.mkdtemp(dir=scratch))) for _ in range(repeat + 1)] if scratch else []

    def received() -> None:
        cache = receive(manifest, encoded, bases, stores.pop() if stores else None).cache
        mx.eval([layer.state for layer in cache])  # type: ignore[union-attr]  # never a CodedLayer

    return fastest_run(received, repeat=repeat)
