"""Transform-coded layers in a cache list: how the transform codec (kvmesh.codec.transform) meets
the manifest, the wire and the store.

`transform_code(cache, coding)` replaces each full-attention layer that kept every position (a float
`SparseKVCache`) by a `CodedLayer`: that layer's blob, which travels as one uint8 tensor `coded` of a
CACHE_KIND_TRANSFORM_KV layer. Sliding windows, recurrent state, quantized and evicted layers are
left as they are and travel as before. A receiver turns a coded layer back into a `SparseKVCache` of
the cache's dtype (`decode_coded`), with the basis the manifest names (CacheManifest.artifacts).

Transform coding runs after a press, on what it left: a layer a press evicted from is coded with the
positions it kept (`SparseKVCache.kept_positions`: the codec needs each key's position to take RoPE
off), which its blob carries; quantized layers stay as the press made them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kvmesh.caches.sparse import SparseKVCache
from kvmesh.codec.basis import Basis, BasisError, LayerKV
from kvmesh.codec.layer_blob import CODING_FIELDS, TransformCodecError, coding_fields, read_header
from kvmesh.codec.levels import LEVELS, Level
from kvmesh.codec.manifest import BASIS_KIND
from kvmesh.codec.prediction import LayerChain
from kvmesh.codec.rotary import Rotary
from kvmesh.codec.transform import SINKS, Encoded, encode_layers
from kvmesh.codec.transform_decode import decode_layer
from kvmesh.errors import KvmeshError
from kvmesh.v1 import cache_pb2 as pb


@dataclass(frozen=True)
class TransformCoding:
    """How to transform code a cache: the model's basis, the quantization step (in units of each
    tensor's calibration RMS, times the basis's factor for the tensor; for a basis without fitted
    factors, the keys' is `key_factor` times it) and the rows kept raw."""

    basis: Basis
    step: float
    sinks: int = SINKS
    # The last coded rows, at `tail_factor` times each tensor's step (kvmesh.codec.transform).
    tail: int = 0
    tail_factor: float = 1.0
    recent: int = 0
    key_factor: float = 2.0

    @classmethod
    def at_level(cls, basis: Basis, level: Level) -> TransformCoding:
        """A `--compress` level's coding (kvmesh.codec.levels): its step for `basis`, its tail."""
        return cls(basis, step=basis.step_at(level), tail=level.tail, tail_factor=level.tail_factor)

    def encode(self, layers: Sequence[LayerKV], basis_layers: Sequence[int] | None = None) -> Encoded:
        """`encode_layers` of (keys, values, positions) per layer, coded as this says."""
        return encode_layers(
            layers,
            self.basis,
            step=self.step,
            basis_layers=basis_layers,
            sinks=self.sinks,
            tail=self.tail,
            tail_factor=self.tail_factor,
            recent=self.recent,
            key_factor=self.key_factor,
        )


@dataclass(frozen=True)
class CodedLayer:
    """One full-attention layer, transform coded: its blob, what the manifest says of it, the dtype
    it decodes to and the basis it needs."""

    blob: bytes
    spec: pb.TransformSpec
    offset: int
    dtype: str
    basis: Basis = field(repr=False, compare=False)
    # The positions it holds, when a press evicted some (None: every one of its offset).
    kept: int | None = None

    @property
    def n_kept(self) -> int:
        return self.offset if self.kept is None else self.kept

    @property
    def nbytes(self) -> int:
        return len(self.blob)


def rotary_to_proto(r: Rotary) -> pb.Rotary:
    message = pb.Rotary(dims=r.dims, traditional=r.traditional, scale=r.scale, freqs=list(r.freqs or ()))
    if r.base is not None:
        message.base = r.base
    return message


def rotary_from_proto(m: pb.Rotary) -> Rotary:
    return Rotary(
        dims=m.dims,
        traditional=m.traditional,
        base=m.base if m.HasField("base") else None,
        scale=m.scale,
        freqs=tuple(m.freqs) if m.freqs else None,
    )


def basis_layer_of(basis: Basis, layer: int) -> int:
    """Which of the basis's layers codes model layer `layer` (the basis records the model layers it
    was fitted on: only full-attention ones)."""
    layers = basis.info.get("layers", list(range(len(basis))))
    if layer not in layers:
        raise BasisError(f"the basis has no layer for model layer {layer} (it covers {layers})")
    return int(layers.index(layer))


def codable(layer: object) -> bool:
    """A float full-attention layer that kept every position of its prefix, or knows which it kept."""
    if type(layer) is not SparseKVCache or layer.keys is None:
        return False
    return layer.n_kept == layer.offset or layer.kept_positions() is not None


def _positions(layer: SparseKVCache) -> np.ndarray:
    """The positions of a codable layer's rows: (n,) when it kept every one, else (n_kv_heads, n)."""
    kept = layer.kept_positions()
    return np.arange(layer.n_kept) if kept is None else np.asarray(kept)


def transform_code(cache: Sequence, coding: TransformCoding) -> list:
    """The cache with every codable layer the basis covers replaced by its CodedLayer (one step for
    all of them)."""
    covered = set(coding.basis.info.get("layers", range(len(coding.basis))))
    at = [i for i, layer in enumerate(cache) if codable(layer) and i in covered]
    if not at:
        return list(cache)
    layers = []
    for i in at:
        keys, values = cache[i].keys_and_values()
        layers.append((keys, values, _positions(cache[i])))
    basis_layers = [basis_layer_of(coding.basis, i) for i in at]
    encoded = coding.encode(layers, basis_layers)
    out = list(cache)
    for i, j, blob in zip(at, basis_layers, encoded.blobs, strict=True):
        header, _ = read_header(blob)
        _, heads, _, head_dim = header["shape"]
        spec = pb.TransformSpec(
            basis_sha256=coding.basis.digest,
            basis_layer=j,
            kv_heads=heads,
            head_dim=head_dim,
            rotary=rotary_to_proto(coding.basis.rotaries[j]),
            **coding_fields(header),
        )
        dtype = str(cache[i].keys.dtype).rsplit(".", 1)[-1]
        kept = cache[i].n_kept if cache[i].n_kept != cache[i].offset else None
        out[i] = CodedLayer(blob, spec, cache[i].offset, dtype, coding.basis, kept)
    return out


def code_at_level(cache: Sequence, basis: Basis, level: str) -> list:
    """`transform_code` at a `--compress` level (kvmesh.codec.levels): its step for `basis` (with
    per-layer step factors or without); KvmeshError for a level that does not exist."""
    if level not in LEVELS:
        raise KvmeshError(f"unknown compression level {level!r}; choose one of {', '.join(LEVELS)}")
    return transform_code(cache, TransformCoding.at_level(basis, LEVELS[level]))


def coded_artifacts(cache: Sequence) -> list[pb.Artifact]:
    """The artefacts a cache list's coded layers need (each basis once)."""
    seen: dict[str, pb.Artifact] = {}
    for layer in cache:
        if isinstance(layer, CodedLayer):
            digest = layer.basis.digest
            seen.setdefault(digest, pb.Artifact(kind=BASIS_KIND, sha256=digest, nbytes=layer.basis.nbytes))
    return list(seen.values())


def decode_coded(
    spec: pb.LayerSpec,
    blob: bytes | memoryview,
    bases: Mapping[str, Basis],
    dtype: mx.Dtype,
    memo: dict | None = None,
    chain: LayerChain | None = None,
) -> SparseKVCache:
    """A CACHE_KIND_TRANSFORM_KV layer back into a SparseKVCache of `dtype` (`chain`: the cache's
    layers decoded before it, for one predicted from the layer before: kvmesh.codec.prediction)."""
    basis = bases.get(spec.transform.basis_sha256)
    if basis is None:
        raise BasisError(f"no basis {spec.transform.basis_sha256[:16]}... to decode this cache with")
    t = spec.transform
    expect = {
        "shape": [1, t.kv_heads, spec.n_kept, t.head_dim],
        "layer": t.basis_layer,
        **{name: getattr(t, name) for name in CODING_FIELDS},
    }
    if spec.n_kept == spec.offset:
        expect["start"] = 0  # it kept every position
    else:
        check_kept_positions(read_header(blob)[0], spec)
    keys, values = decode_layer(blob, basis, memo, expect=expect, chain=chain)
    if keys.dtype != dtype:
        keys, values = keys.astype(dtype), values.astype(dtype)
        mx.eval(keys, values)
    return SparseKVCache.from_arrays(keys, values, spec.offset)


def check_kept_positions(header: dict, spec: pb.LayerSpec) -> None:
    """A layer a press evicted from lists its kept positions head by head, or, when they are one run
    for every head, gives where the run starts: inside the layer's offset either way."""
    positions = header.get("positions", {})
    start = positions.get("start")
    if start is None:
        fits = positions.get("shape") == [1, spec.transform.kv_heads, spec.n_kept]
    else:
        fits = isinstance(start, int) and 0 <= start <= spec.offset - spec.n_kept
    if not fits:
        raise TransformCodecError(f"positions {positions} for {spec.n_kept} kept of {spec.offset}")


def decoded(cache: Sequence) -> list:
    """A cache list with its CodedLayers decoded (what a receiver will hold): for measuring a coded
    cache's loss where it was made."""
    memo: dict = {}
    chain = LayerChain()
    out = []
    for layer in cache:
        if isinstance(layer, CodedLayer):
            spec = pb.LayerSpec(
                kind=pb.CACHE_KIND_TRANSFORM_KV, n_kept=layer.n_kept, offset=layer.offset, transform=layer.spec
            )
            dtype = getattr(mx, layer.dtype)
            layer = decode_coded(spec, layer.blob, {layer.basis.digest: layer.basis}, dtype, memo, chain)
        out.append(layer)
    return out


def coded_tensor(layer: CodedLayer) -> mx.array:
    """The blob as the layer's one tensor, (1, bytes) uint8."""
    return mx.array(np.frombuffer(layer.blob, dtype=np.uint8))[None]


_PARSED: dict[str, Basis] = {}
_PARSED_LOCK = threading.Lock()
# Bases kept parsed per process (an 8B model's is ~130 MB): the most recently used few.
PARSED_BASES = 4


def parsed_basis(sha256: str) -> Basis | None:
    """The basis of that id if this process parsed it already, else None (bases are content-addressed:
    one parsed and checked once needs neither its bytes read nor hashed again, which for an 8B
    model's took longer than decoding a short cache)."""
    with _PARSED_LOCK:
        if sha256 in _PARSED:
            _PARSED[sha256] = _PARSED.pop(sha256)  # most recent last
            return _PARSED[sha256]
    return None


def parse_basis(data: bytes, sha256: str) -> Basis:
    """A basis from its bytes, checked against its id; parsed once per process (`parsed_basis`)."""
    if (basis := parsed_basis(sha256)) is not None:
        return basis
    basis = Basis.from_bytes(data, sha256)
    with _PARSED_LOCK:
        _PARSED[sha256] = basis
        while len(_PARSED) > PARSED_BASES:
            _PARSED.pop(next(iter(_PARSED)))
    return basis


def bases_for(manifest: pb.CacheManifest, get: Callable[[str], bytes | None]) -> dict[str, Basis]:
    """The bases a manifest names, by sha256, their bytes read with `get` (e.g. an ArtifactStore's)
    unless this process parsed them already; BasisError when one is missing or damaged."""
    out = {}
    for a in manifest.artifacts:
        if (parsed := parsed_basis(a.sha256)) is not None:
            out[a.sha256] = parsed
            continue
        data = get(a.sha256)
        if data is None:
            raise BasisError(
                f"the cache needs transform basis {a.sha256[:12]}, which is not here: fetch the cache "
                "from a peer (its basis comes with it)"
            )
        out[a.sha256] = parse_basis(data, a.sha256)
    return out
