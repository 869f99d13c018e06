"""The choice for a request: the copies peers offer of one prefix, weighed against a prefill here by
this machine's rates (kvmesh.reuse.choice), each peer's link probed first when never measured.

Besides the copies peers hold, a peer that offers to code a full one on request
(Candidate.on_request; kvmesh.net.on_request) adds that coded copy, at the level the offer is sized
at (OFFERED_LEVEL, the default), when the level is within the receiver's quality floor.
"""

import logging
import math
from collections.abc import Collection, Sequence

from kvmesh.codec.levels import LEVELS
from kvmesh.codec.manifest import LOSS_METRICS, predicted
from kvmesh.errors import PeerError
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.client import PeerClient, Probe
from kvmesh.net.on_request import OFFERED_LEVEL
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.reuse.choice import MAX_PROBE_BYTES, MIN_PROBE_SECONDS, Copy, Decision, choose, probe_bytes
from kvmesh.reuse.fetch import Fetched
from kvmesh.reuse.rates import TRANSFORM_CODECS, Rates
from kvmesh.v1.service_pb2 import Candidate

log = logging.getLogger(__name__)

Offer = tuple[PeerClient, Candidate]
# A stream that took no longer than this factor of its decode time may have been paced by decoding.
DECODE_BOUND = 1.25


def codec_of(candidate: Candidate) -> str:
    """The codec a peer's copy travels in, as its lookup answer tells: a lossy cache that no press
    changed is transform coded (its layers predicted from the one before, where it says so), a
    quantize press's is quantized, any other travels as computed."""
    if candidate.method == "quantize":
        return "quantized"
    if candidate.method == "full" and candidate.lossy:
        return "predicted" if candidate.predicted else "transform"
    return "full"


def level_codec(level: str, *, predicts: bool = True) -> str:
    """The codec of a copy coded on request at `level` with a basis that `predicts` or not
    (OnRequest.unpredicted): `predicted` where both the level and the basis predict each layer from
    the one before."""
    return "predicted" if LEVELS[level].predicted_step is not None and predicts else "transform"


def within_floor(candidate: Candidate, max_kl: float | None) -> bool:
    """Whether a copy is within the receiver's quality floor `max_kl`, as `quality_problem` judges its
    manifest: lossless, or lossy with a measured loss of at most `max_kl`."""
    lossy = candidate.lossy or candidate.method != "full"
    if max_kl is None or not lossy:
        return True
    return candidate.quality.metric in LOSS_METRICS and candidate.quality.value <= max_kl


def fetch_or_prefill(
    rates: Rates,
    model_fp: ModelFingerprint,
    offers: Sequence[Offer],
    *,
    tokens: int,
    held: int,
    bases: Collection[str] = (),
    max_kl: float | None = None,
    timeout: float = TIMEOUTS.stream_idle,
) -> Decision:
    """Whether fetching one of `offers` (copies of the same prefix, on one peer or several) beats
    prefilling the `tokens` they add to the `held` ones here, and which copy.

    Each copy streams at the rate its codec's copies reached from that peer, else the link's
    (earlier transfers, else `probe_link`'s, each probe within `timeout` seconds); its decode takes
    what this machine measured for the model and codec; a transform coded copy counts its basis
    unless this machine holds one of the model's (`bases`: their ids). A full copy a peer would code
    on request adds that copy (`on_request_copy`) at each level whose loss is within `max_kl`
    (`request_levels`). Without timed prefills of the model (`ensure_calibrated`), fetching is the
    choice, the copies in the order given.
    """
    prefill = rates.prefill_model(model_fp.model_id)
    decoding = rates.decoding(model_fp.model_id)
    copies = []
    for client, candidate in offers:
        codec = codec_of(candidate)
        wire = candidate.stored_bytes * (held + tokens) // max(1, candidate.num_tokens)
        address = client.address
        if prefill is not None and rates.link_rate(address) is None:
            rates.record_probe(address, probe_link(client, wire, timeout=timeout).rate)
        copies.append(
            Copy(
                address,
                candidate.cache_id,
                codec,
                wire,
                rates.stream_rate(address, codec) or math.inf,  # unknown without a prefill to weigh: not probed
                measured=rates.link_source(address, codec),
                basis_bytes=decoding.basis_bytes if decoding and codec in TRANSFORM_CODECS and not bases else 0,
                basis_bytes_per_s=rates.basis_rate(address),
                decode_s=decoding.seconds(codec, held + tokens) if decoding else None,
                layers=model_fp.num_layers,
                setup_s=rates.link_setup(address),
            )
        )
        if candidate.HasField("on_request") and codec == "full":
            copies += [
                on_request_copy(rates, model_fp, address, candidate, tokens=held + tokens, bases=bases, level=level)
                for level in request_levels(max_kl)
            ]
    return choose(tokens, copies, prefill, context=held)


def probe_link(client: PeerClient, wire: int, *, timeout: float, min_seconds: float = MIN_PROBE_SECONDS) -> Probe:
    """The probe of a link never measured, before a fetch of `wire` bytes over it: a share of them
    (`probe_bytes`), then MAX_PROBE_BYTES when that share arrived in under `min_seconds` (a fast
    link: the short probe measured its round trip or a shaper's burst more than its rate). Each
    within `timeout` seconds; a second probe that fails or runs out of time (a slow link whose
    shaper let the first through in a burst) leaves the first's measurement, not none."""
    asked = probe_bytes(wire)
    probe = client.probe(asked, timeout=timeout)
    if asked < MAX_PROBE_BYTES and probe.seconds < min_seconds:
        try:
            return client.probe(MAX_PROBE_BYTES, timeout=timeout)
        except PeerError as e:
            log.info("a second probe of %s failed (%s): its first is kept", client.address, e)
    return probe


def request_levels(max_kl: float | None) -> list[str]:
    """The levels a receiver with the quality floor `max_kl` weighs asking a peer to code at: each
    whose measured loss (kvmesh.codec.levels) is within the floor; without a floor, OFFERED_LEVEL
    alone (the level `--compress` codes at: a receiver that set no floor is not sent a lossier
    copy made for it)."""
    if max_kl is None:
        return [OFFERED_LEVEL]
    return [name for name, level in LEVELS.items() if level.kl <= max_kl]


def on_request_copy(
    rates: Rates,
    model_fp: ModelFingerprint,
    address: str,
    candidate: Candidate,
    *,
    tokens: int,
    bases: Collection[str],
    level: str = OFFERED_LEVEL,
) -> Copy:
    """The copy of `tokens` of `candidate` that its peer offers to code on request at `level`, as
    this machine would fetch it: the coded bytes the peer expects (its float16 bytes over the level's
    ratio on the bench, as the offer sizes OFFERED_LEVEL's; a level that predicts, at its ratio
    without predictors where the offer says its basis has none: OnRequest.unpredicted), streaming
    at the rate coded copies reached from it, its basis unless held here, the coding as long as the
    peer expects (its fixed part and a share of the rest for a shorter prefix; the same at any
    level, which changes only the step; before the peer has coded one: this machine's decode time
    of the copy, a like amount of work) and this machine's decode."""
    offer = candidate.on_request
    share = tokens / max(1, candidate.num_tokens)
    decoding = rates.decoding(model_fp.model_id)
    codec = level_codec(level, predicts=not offer.unpredicted)
    decode_s = decoding.seconds(codec, tokens) if decoding else None
    if offer.encode_s > 0:
        fixed = min(offer.encode_fixed_s, offer.encode_s)  # (0 from a peer that does not say)
        encode_s, how = fixed + (offer.encode_s - fixed) * share, "measured there"
    else:
        encode_s, how = decode_s or 0.0, "not measured there yet: taken as this machine's decode"
    return Copy(
        address,
        candidate.cache_id,
        codec,
        LEVELS[level].coded_bytes(offer.fp16_bytes * share, predicts=not offer.unpredicted),
        rates.stream_rate(address, codec) or math.inf,
        measured=rates.link_source(address, codec),
        basis_bytes=0 if offer.basis_sha256 in bases else offer.basis_bytes,
        basis_bytes_per_s=rates.basis_rate(address),
        decode_s=decode_s,
        layers=model_fp.num_layers,
        setup_s=rates.link_setup(address),
        level=level,
        encode_s=encode_s,
        encode_measured=how,
    )


def record_fetch(
    rates: Rates, model_id: str, address: str, candidate: Candidate, fetched: Fetched, *, on_request: bool = False
) -> None:
    """What a fetch of `candidate` from `address` says of the rate its codec's copies stream at and of
    the link (its stream, setup and basis excluded; a stream that decoding may have paced, within
    DECODE_BOUND of this machine's decode time of it, only ever raises the link's rate), of the rate
    a basis comes ready at from that peer (fetched, checked, parsed, kept), of its setup (the time to
    its first chunk, less the time its basis took and that chunk's bytes at the link's rate) and of
    the bases the model's caches are coded with. A copy coded `on_request` is a transform coded one
    (predicted where its manifest says so); its setup, which the peer's coding took part of, is not
    recorded."""
    codec = ("predicted" if predicted(fetched.manifest) else "transform") if on_request else codec_of(candidate)
    decoding = rates.decoding(model_id)
    decode_s = decoding.seconds(codec, fetched.manifest.prefix.num_tokens) if decoding else None
    paced = decode_s is not None and fetched.stream_s <= DECODE_BOUND * decode_s
    rates.record_transfer(address, fetched.stream_bytes, fetched.stream_s, codec=codec, at_least=paced)
    rates.record_basis(address, fetched.basis_bytes, fetched.basis_s)
    if fetched.stream_s > 0 and not on_request and (rate := rates.link_rate(address)):
        # Before the first chunk: the setup, the basis, and that chunk at the link's rate.
        first = fetched.wire_bytes - fetched.stream_bytes
        rates.record_setup(address, max(0.0, fetched.wire_s - fetched.stream_s - fetched.basis_s - first / rate))
    rates.record_bases(model_id, [a.sha256 for a in fetched.manifest.artifacts])
