"""A sender's side of coding on request: what its lookups offer, whether a request pays, the copies made.

A receiver on a slow link saves more by fetching a small transform-coded copy than the coding costs
the sender; on a fast link the coding costs more than it saves. So a daemon that holds the model's
basis offers, with each full cache a lookup finds (Candidate.on_request), what coding it would take
and give: the coded copy's expected size and the seconds this daemon expects the coding to take
(fitted to its latest codings of the model: kvmesh.codec.timing). A receiver that weighs it the
fastest option asks for it (FetchOpen.code) with its link rate. The sender checks once more and
refuses (REJECT_REASON_CODEC, before any manifest) when coding would take longer than the smaller
copy saves on that link, or longer than a receiver waits for a manifest. Otherwise it codes the
cache (kvmesh.codec.coded_copy), keeps the copy in its store and serves that copy. The copy is made
once; later lookups offer it as a stored coded cache.

The coding needs MLX, the codec and the parsed basis (importing took 1.4 s on a 2-core Linux box),
and a process's first coding builds MLX's kernels (1 s for 128 tokens, against 0.1 s after): a
daemon that starts with a model's basis in its store, or first offers coding with one, readies all
that in the background (`_ready`), so that a request does not wait for it and the first timing
does not stand for the rest; a daemon that holds no basis never loads MLX.

A daemon keeps its timings in its data directory (`coding-times.json`: kvmesh.paths), so that after a
restart its offers say what coding takes here from the first lookup, not 0 until it has coded again.
An offer gives the fit's fixed part too: a receiver that wants a shorter prefix scales the rest.
"""

import json
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.codec.cut import cut_prefix
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.manifest import fp16_bytes, uncodable_reason
from kvmesh.codec.timing import CodecTime, fit_codec_time
from kvmesh.errors import KvmeshError, NotFoundError, Rejection, StoreError
from kvmesh.files.atomic import write_atomic
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store
from kvmesh.store.index import StoredEntry
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb

if TYPE_CHECKING:
    from kvmesh.codec.basis import Basis

log = logging.getLogger(__name__)
# The level a lookup's offer is sized at (a request may ask for any of LEVELS).
OFFERED_LEVEL = "default"
# Float16 bytes a second coding is taken to run at before this daemon has timed one: well below the
# 0.17-0.20 GB/s a 2-core Linux box measured (scripts/bench_transform.py), so a first request too
# large to code within Timeouts.code_on_request is refused rather than left to time out.
ASSUMED_ENCODE_RATE = 50e6
# Synthetic tokens a daemon codes with a basis before a request: enough to build every kernel.
WARM_UP_TOKENS = 32
# Codings on request kept per model for the fit of its coding time.
CODING_TIMINGS = 8


def expected_coded_bytes(manifest: pb.CacheManifest, level: str, *, predicts: bool = True) -> int:
    """What a coded copy of the cache at `level` is expected to take, with a basis that `predicts`
    or not: its float16 bytes over the level's ratio on the bench's worst text (kvmesh.codec.levels)."""
    return LEVELS[level].coded_bytes(fp16_bytes(manifest), predicts=predicts)


class OnRequestCoding:
    """Coding `store`'s full caches on request, for one daemon (one coding at a time: it takes the
    cores)."""

    def __init__(self, store: CacheStore, node_id: str, *, enabled: bool = True, timings: Path | None = None):
        """`timings`: the file that keeps this machine's codings across restarts (None: memory only)."""
        self.store = store
        self.node_id = node_id
        self.enabled = enabled and not store.read_only
        self.artifacts = artifact_store(store.root)
        self._lock = threading.Lock()
        # Per model id: the latest codings on request, (tokens, seconds) from reading the full copy
        # to keeping the coded one.
        self._timings: dict[str, deque[tuple[float, float]]] = {}
        self._timings_path = timings
        if timings is not None and self.enabled:
            self._timings = read_timings(timings)
        # (source id, tokens, level, basis) -> the id of the coded copy made for it.
        self._made: dict[tuple[str, int, str, str], str] = {}
        self._readied: set[str] = set()
        # The bases read so far with which no level predicts (OnRequest.unpredicted): fitted before
        # cross-layer predictors, or with them at another step.
        self._unpredicted: set[str] = set()
        if self.enabled:  # a Mac that holds a basis is ready to code with it (module docstring)
            try:
                bases = set(self.artifacts.model_bases().values())
            except StoreError as e:
                log.warning("%s", e)
                bases = set()
            for digest in sorted(bases):
                self._ready_soon(digest)

    def _basis_of(self, model_id: str) -> str | None:
        try:
            return self.artifacts.model_basis(model_id)
        except StoreError:
            return None

    def offer(self, entry: StoredEntry) -> spb.OnRequest | None:
        """What coding `entry` at OFFERED_LEVEL would take and give, or None when this daemon does
        not code it (turned off, no basis for its model, a lossy or not wholly attention cache)."""
        if not self.enabled or entry.lossy or entry.method != "full":
            return None
        if (digest := self._basis_of(entry.model_id)) is None:
            return None
        try:
            manifest = self.store.manifest(entry.cache_id)
            basis_bytes = self.artifacts.path(digest).stat().st_size
        except (KvmeshError, OSError):
            return None
        if uncodable_reason(manifest):
            return None
        self._ready_soon(digest)
        timed = self.coding_time(entry.model_id)
        return spb.OnRequest(
            basis_sha256=digest,
            basis_bytes=basis_bytes,
            fp16_bytes=fp16_bytes(manifest),
            coded_bytes=expected_coded_bytes(manifest, OFFERED_LEVEL),
            encode_s=timed.seconds(entry.num_tokens) if timed else 0.0,
            encode_fixed_s=timed.fixed_s if timed else 0.0,
            unpredicted=digest in self._unpredicted,
        )

    def coding_time(self, model_id: str) -> CodecTime | None:
        """What coding the model's caches is expected to take here, fitted to the latest codings
        (kvmesh.codec.timing); None before the first."""
        timings = self._timings.get(model_id)
        return fit_codec_time(list(timings)) if timings else None

    def coding_s(self, model_id: str, tokens: int) -> float | None:
        """The seconds coding `tokens` tokens of the model's caches is expected to take here."""
        timed = self.coding_time(model_id)
        return timed.seconds(tokens) if timed else None

    def coded(
        self, cache_id: str, manifest: pb.CacheManifest, request: spb.CodeRequest, num_tokens: int
    ) -> str | Rejection:
        """The id of the stored coded copy of `cache_id` (its first `num_tokens`, 0: all) that
        `request` asks for, made now if need be; or why this daemon will not make it."""
        digest = self._basis_of(manifest.model.model_id)
        if why := self._refusal(manifest, request, num_tokens, digest):
            return Rejection(pb.REJECT_REASON_CODEC, f"this peer does not code cache {cache_id} on request: {why}")
        assert digest is not None  # (_refusal says why when it is)
        key = (cache_id, num_tokens or manifest.prefix.num_tokens, request.level, digest)
        with self._lock:
            if (made := self._made.get(key)) is not None and self._held(made):
                return made
            try:
                return self._code(key, manifest)
            except (KvmeshError, ValueError) as e:  # (a damaged basis is a ValueError: BasisError)
                log.warning("cannot code %s on request: %s", cache_id, e)
                return Rejection(pb.REJECT_REASON_CODEC, f"this peer could not code cache {cache_id}: {e}")

    def _refusal(
        self, manifest: pb.CacheManifest, request: spb.CodeRequest, num_tokens: int, digest: str | None
    ) -> str | None:
        """Why coding (the first `num_tokens` of) the cache of `manifest` as `request` asks, with the
        model's basis `digest` (None: none held), will not be done, or None: the module docstring's
        checks."""
        model_id = manifest.model.model_id
        if not self.enabled:
            return "it codes no cache on request (its store is read-only, or it runs with --no-code-on-request)"
        if request.level not in LEVELS:
            return f"unknown level {request.level!r}; the levels are {', '.join(LEVELS)}"
        if why := uncodable_reason(manifest):
            return why
        if digest is None:
            return f"it holds no transform basis for model {model_id}"
        tokens = num_tokens or manifest.prefix.num_tokens
        share = tokens / max(1, manifest.prefix.num_tokens)
        timed = self.coding_s(model_id, tokens)
        coding_s = fp16_bytes(manifest) * share / ASSUMED_ENCODE_RATE if timed is None else timed
        if coding_s > TIMEOUTS.code_on_request:
            return (
                f"coding its {tokens:,} tokens would take about {coding_s:.1f} s, longer than a receiver "
                f"waits ({TIMEOUTS.code_on_request:g} s)"
            )
        if timed is not None and request.link_bytes_per_s > 0:
            try:
                predicts = self._predicts(digest)
            except (KvmeshError, ValueError) as e:  # (a damaged basis is a ValueError: BasisError)
                return f"its basis {digest[:12]} cannot be read: {e}"
            expected = expected_coded_bytes(manifest, request.level, predicts=predicts)
            saved = (manifest.encoding.encoded_bytes - expected) * share
            saved_s = saved / request.link_bytes_per_s
            if coding_s >= saved_s:
                return (
                    f"coding it would take about {coding_s:.2f} s, more than the {max(0.0, saved_s):.2f} s its "
                    f"smaller size saves at {request.link_bytes_per_s / 1e6:,.1f} MB/s: fetch it as stored"
                )
        return None

    def _ready_soon(self, digest: str) -> None:
        """Ready the basis `digest` for coding (`_ready`) in the background, once."""
        if digest not in self._readied:
            self._readied.add(digest)
            threading.Thread(target=self._ready, args=(digest,), name="kvmesh-coding-ready", daemon=True).start()

    def _ready(self, digest: str) -> None:
        """Import what coding runs (MLX, the codec), parse the basis `digest` and code a few synthetic
        tokens with it (a process's first coding builds MLX's kernels, starts the layer threads and
        took 1 s for 128 tokens, against 0.1 s after), ahead of a request."""
        import kvmesh.codec.coded_copy  # noqa: F401
        from kvmesh.codec.coded import TransformCoding
        from kvmesh.codec.rate import synthetic_layers

        try:
            basis = self._basis(digest)
            TransformCoding.at_level(basis, LEVELS[OFFERED_LEVEL]).encode(synthetic_layers(basis, WARM_UP_TOKENS))
        except (KvmeshError, ValueError) as e:  # the request that follows says so
            log.warning("cannot ready basis %s for coding on request: %s", digest[:12], e)

    def _basis(self, digest: str) -> "Basis":
        """The basis of that id, parsed once per process (kvmesh.codec.coded.parse_basis)."""
        from kvmesh.codec.coded import parse_basis, parsed_basis

        if (basis := parsed_basis(digest)) is None:
            if (data := self.artifacts.get(digest)) is None:
                raise StoreError(f"its basis {digest[:12]} is gone")
            basis = parse_basis(data, digest)
        if not any(basis.predicts_at(level) for level in LEVELS.values() if level.predicted_step is not None):
            self._unpredicted.add(digest)
        return basis

    def _predicts(self, digest: str) -> bool:
        """Whether some level predicts with the basis `digest`, read now if this process has not
        read it yet (timings kept from before a restart weigh a request before the background read)."""
        self._basis(digest)
        return digest not in self._unpredicted

    def _held(self, cache_id: str) -> bool:
        try:
            self.store.entry(cache_id)
        except NotFoundError:
            return False
        return True

    def _code(self, key: tuple[str, int, str, str], manifest: pb.CacheManifest) -> str:
        """Code and keep the copy `key` names (the same content has the same id: coding it again
        keeps nothing twice), timing it for the model's fit."""
        from kvmesh.codec.coded_copy import code_copy

        cache_id, tokens, level, digest = key
        start = time.perf_counter()
        records = self.store.chunk_records(cache_id)
        if tokens != manifest.prefix.num_tokens:
            manifest, records = cut_prefix(manifest, lambda: self.store.chunk_records(cache_id), tokens)
        encoded = code_copy(manifest, records, level=level, basis=self._basis(digest), node_id=self.node_id)
        coded = self.store.add(encoded.manifest, encoded.chunks)
        seconds = time.perf_counter() - start
        self._timings.setdefault(manifest.model.model_id, deque(maxlen=CODING_TIMINGS)).append((tokens, seconds))
        if self._timings_path is not None:
            write_timings(self._timings_path, self._timings)
        self._made[key] = coded.cache_id
        log.info(
            "coded %s (%d tokens) at level %s on request in %.2f s: %s, %d bytes",
            cache_id, tokens, level, seconds, coded.cache_id, coded.encoding.encoded_bytes,
        )  # fmt: skip
        return coded.cache_id


def read_timings(path: Path) -> dict[str, deque[tuple[float, float]]]:
    """The codings on request timed in `path` (`write_timings`), per model: none when there is no
    file, or (with a warning) when it cannot be read; a timing that is not a positive number is
    left out. They are advice: a daemon without them times its codings again."""
    try:
        models = json.loads(path.read_text())["models"]
        return {
            str(model): deque(
                [
                    (float(t), float(s))
                    for t, s in timings
                    if all(math.isfinite(float(x)) and float(x) > 0 for x in (t, s))
                ][-CODING_TIMINGS:],
                maxlen=CODING_TIMINGS,
            )
            for model, timings in models.items()
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("%s is unreadable (%s): codings on request are timed again", path, e)
        return {}


def write_timings(path: Path, timings: dict[str, deque[tuple[float, float]]]) -> None:
    """Keep the codings timed here in `path`, replacing it whole (atomically); a full disk only
    costs the timings."""
    data = {"models": {model: [list(t) for t in kept] for model, kept in timings.items()}}
    try:
        write_atomic(path, json.dumps(data, indent=1))
    except OSError as e:
        log.warning("cannot keep the codings' timings in %s: %s", path, e.strerror or e)
