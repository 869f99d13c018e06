"""Does a manifest describe a cache this receiver can use? Decided before any tensor byte moves.

The answer is None (accept) or a Rejection with a typed reason and a sentence a user can act on.
Every size and count is checked with plain integers against the manifest's own claims before the
receiver allocates anything, so a manifest that lies about its shapes is refused, not trusted.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.caches.defaults import QUANT_BITS, QUANT_GROUP_SIZES
from kvmesh.codec.limits import (
    DIGEST_BYTES,
    HASH_BYTES,
    MAX_ARTIFACT_BYTES,
    MAX_ARTIFACTS,
    MAX_BLOCK_SIZE,
    MAX_CHUNK_SIZE,
    MAX_LAYERS,
    MIN_CHUNK_SIZE,
    is_sha256_hex,
)
from kvmesh.codec.manifest import (
    BASIS_KIND,
    CODEC_NAMES,
    CODECS,
    ITEMSIZE,
    MAX_LIST_PARTS,
    MAX_STATE_ARRAYS,
    TENSOR_NAMES,
    chunk_count,
    compression_name,
    kind_name,
    leaf_layers,
    loss_text,
    lossy,
    measured_loss,
    sink_rows,
    state_names,
    tensor_dtype,
    tensor_specs,
)
from kvmesh.codec.prefix import prefix_sha256
from kvmesh.errors import CacheRejected, Rejection
from kvmesh.model.fingerprint import ModelFingerprint, dtype_name
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.versions import PREDICTED_SCHEMA, READABLE_SCHEMAS, TAIL_SCHEMA

if TYPE_CHECKING:
    from kvmesh.codec.basis import Basis as BasisLike

__all__ = ["CacheRejected", "ReceiverProfile", "Rejection", "basis_problem", "check_manifest", "validate_manifest"]


@dataclass(frozen=True)
class ReceiverProfile:
    """What a receiver has and will take."""

    model: ModelFingerprint
    codecs: frozenset[str] = frozenset(CODECS)
    max_bytes: int = 16 << 30
    # The receiver's prompt, when it wants a prefix of it; it is only hashed here, never sent.
    prompt: Sequence[int] | None = field(default=None, repr=False)
    # Same architecture and tokenizer, other weights (a fine-tune): refused unless asked for.
    accept_other_weights: bool = False
    accept_other_chat_template: bool = False
    # A quality floor: the largest measured loss ("tail_kl", nats/token) a lossy cache may have;
    # a lossy cache that carries no measurement is refused too. None: any cache.
    max_kl: float | None = None


def validate_manifest(m: pb.CacheManifest) -> Rejection | None:
    """Is the manifest consistent with itself? Checked with integers only, nothing allocated."""

    def bad(message: str) -> Rejection:
        return Rejection(pb.REJECT_REASON_MALFORMED, message)

    if not 0 < m.num_layers <= MAX_LAYERS or len(m.layers) != m.num_layers:
        return bad(f"{len(m.layers)} layer specs for num_layers={m.num_layers} (at most {MAX_LAYERS})")
    dtype = dtype_name(m.dtype)
    if dtype not in ITEMSIZE or dtype in ("uint32", "uint8"):
        return Rejection(pb.REJECT_REASON_DTYPE, f"unsupported cache dtype {dtype}")
    if m.encoding.codec not in CODEC_NAMES:
        return Rejection(pb.REJECT_REASON_CODEC, f"unknown codec {m.encoding.codec}")
    prefix = m.prefix
    if (
        not 1 <= prefix.block_size <= MAX_BLOCK_SIZE
        or len(prefix.block_hashes) != prefix.num_tokens // prefix.block_size
    ):
        return bad(
            f"{len(prefix.block_hashes)} block hashes of size {prefix.block_size} for {prefix.num_tokens} tokens"
        )
    if len(prefix.sha256) != HASH_BYTES or any(len(h) != HASH_BYTES for h in prefix.block_hashes):
        return bad(f"prefix hashes must be {HASH_BYTES} bytes each")
    if not MIN_CHUNK_SIZE <= m.encoding.chunk_size <= MAX_CHUNK_SIZE:
        return bad(f"chunk size {m.encoding.chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    for i, layer in enumerate(m.layers):
        if rejection := layer_problem(m, i, layer):
            return rejection
    if rejection := artifacts_problem(m):
        return rejection
    total = sum(t.nbytes for t in tensor_specs(m))
    if total != m.encoding.raw_bytes:
        return bad(f"tensors hold {total} bytes, the encoding claims {m.encoding.raw_bytes}")
    if m.encoding.chunk_count != chunk_count(m):
        return bad(f"{m.encoding.chunk_count} chunks announced, the tensors make {chunk_count(m)}")
    if m.encoding.payload_digest and len(m.encoding.payload_digest) != DIGEST_BYTES:
        return bad(f"the payload digest must be {DIGEST_BYTES} bytes")
    return None


def layer_problem(m: pb.CacheManifest, i: int, layer: pb.LayerSpec, in_list: bool = False) -> Rejection | None:
    """What is wrong with one layer's spec (or one part of a composite layer), checked against the
    manifest's geometry."""

    def bad(message: str) -> Rejection:
        return Rejection(pb.REJECT_REASON_MALFORMED, f"layer {i}: {message}")

    if layer.kind not in (*TENSOR_NAMES, pb.CACHE_KIND_ARRAYS, pb.CACHE_KIND_LIST):
        return Rejection(pb.REJECT_REASON_CACHE_CLASS, f"layer {i}: unsupported cache kind {kind_name(layer.kind)}")
    if layer.offset != m.prefix.num_tokens or layer.n_kept > layer.offset:
        return bad(f"{layer.n_kept} kept of offset {layer.offset}, prefix has {m.prefix.num_tokens} tokens")
    if layer.parts and layer.kind != pb.CACHE_KIND_LIST:
        return bad(f"a {kind_name(layer.kind)} layer has no parts")
    if layer.kind == pb.CACHE_KIND_LIST:
        if in_list or layer.n_kept or layer.tensors or not 1 <= len(layer.parts) <= MAX_LIST_PARTS:
            return bad(f"a composite layer holds 1 to {MAX_LIST_PARTS} parts of other kinds and no tensors")
        problems = (layer_problem(m, i, part, in_list=True) for part in layer.parts)
        return next((p for p in problems if p), None)
    if layer.kind == pb.CACHE_KIND_ARRAYS:
        return arrays_problem(i, layer, bad)
    if layer.kind == pb.CACHE_KIND_TRANSFORM_KV:
        return transform_problem(m, layer, bad)
    if layer.HasField("transform"):
        return bad(f"a {kind_name(layer.kind)} layer is not transform coded")
    if layer.kind == pb.CACHE_KIND_CHUNKED_KV and (
        layer.chunk_size < 1 or layer.n_kept != layer.offset - layer.start_position
    ):
        return bad(
            f"chunks of {layer.chunk_size} from position {layer.start_position} to {layer.offset} "
            f"holding {layer.n_kept}"
        )
    names = TENSOR_NAMES[layer.kind]
    if layer.kind == pb.CACHE_KIND_ROTATING_KV and (
        not 0 <= layer.keep < layer.window or layer.n_kept != min(layer.offset, layer.window)
    ):
        return bad(f"a window of {layer.window} (keep {layer.keep}) at offset {layer.offset} holding {layer.n_kept}")
    quantized = layer.kind == pb.CACHE_KIND_SPARSE_QUANTIZED_KV
    if quantized and (layer.bits not in QUANT_BITS or layer.group_size not in QUANT_GROUP_SIZES):
        return bad(f"quantization bits={layer.bits} group_size={layer.group_size}")
    if [t.name for t in layer.tensors] != list(names):
        return bad(f"tensors {[t.name for t in layer.tensors]}, expected {list(names)}")
    dtype = dtype_name(m.dtype)
    for t in layer.tensors:
        t_dtype = tensor_dtype(t)
        if t_dtype not in ITEMSIZE:
            return Rejection(pb.REJECT_REASON_DTYPE, f"layer {i} {t.name}: unsupported dtype {t_dtype}")
        expected_dtype = "uint32" if t.name.endswith("packed") else dtype
        width = expected_width(t.name, m.head_dim, layer.bits, layer.group_size)
        if t_dtype != expected_dtype or list(t.shape) != [layer.n_kept, m.num_kv_heads, width]:
            return bad(
                f"{t.name}: {t_dtype} {list(t.shape)}, expected {expected_dtype} "
                f"{[layer.n_kept, m.num_kv_heads, width]}"
            )
        if t.nbytes != math.prod(t.shape) * ITEMSIZE[t_dtype]:
            return bad(f"{t.name}: {t.nbytes} bytes do not match its shape")
    return None


def arrays_problem(i: int, layer: pb.LayerSpec, bad: Callable[[str], Rejection]) -> Rejection | None:
    """A recurrent layer: state.0..state.N-1 of float dtypes, each 1 to 4 axes, no positions."""
    if layer.n_kept or not 1 <= len(layer.tensors) <= MAX_STATE_ARRAYS:
        return bad(f"a recurrent layer of {len(layer.tensors)} arrays and {layer.n_kept} positions")
    if [t.name for t in layer.tensors] != state_names(len(layer.tensors)):
        return bad(f"tensors {[t.name for t in layer.tensors]}, expected {state_names(len(layer.tensors))}")
    for t in layer.tensors:
        t_dtype = tensor_dtype(t)
        if t_dtype not in ITEMSIZE or t_dtype == "uint32":
            return Rejection(
                pb.REJECT_REASON_DTYPE, f"layer {i} {t.name}: unsupported dtype {t_dtype} for recurrent state"
            )
        if not 1 <= len(t.shape) <= 4 or min(t.shape) < 1 or t.nbytes != math.prod(t.shape) * ITEMSIZE[t_dtype]:
            return bad(f"{t.name}: {t_dtype} {list(t.shape)} in {t.nbytes} bytes")
    return None


def transform_problem(m: pb.CacheManifest, layer: pb.LayerSpec, bad: Callable[[str], Rejection]) -> Rejection | None:
    """A transform-coded layer: no more positions than its offset (fewer when a press evicted some),
    the manifest's geometry, one `coded` uint8 tensor, sane steps and component counts, a rotary the
    codec can invert."""
    t = layer.transform
    features = t.kv_heads * t.head_dim
    if not 0 < layer.n_kept <= layer.offset or (t.kv_heads, t.head_dim) != (m.num_kv_heads, m.head_dim):
        return bad(
            f"transform coded {layer.n_kept} of {layer.offset} positions, {t.kv_heads}x{t.head_dim} "
            f"(the cache is {m.num_kv_heads}x{m.head_dim})"
        )
    regions = [(t.key_step, t.value_step, t.key_components, t.value_components)]
    if t.tail:
        regions.append((t.key_tail_step, t.value_tail_step, t.key_tail_components, t.value_tail_components))
    for key_step, value_step, key_components, value_components in regions:
        steps_ok = all(math.isfinite(x) and x > 0 for x in (key_step, value_step))
        if not steps_ok or key_components > features or value_components > features:
            return bad(
                f"transform steps {key_step}/{value_step}, components {key_components}/{value_components} of {features}"
            )
    if t.tail and m.schema_version < TAIL_SCHEMA:
        return bad(f"a tail of {t.tail} rows in a schema {m.schema_version} manifest")
    if t.predicted and m.schema_version < PREDICTED_SCHEMA:
        return bad(f"predicted from the layer before in a schema {m.schema_version} manifest")
    if t.predicted and (t.tail or t.basis_layer == 0):
        return bad(f"basis layer {t.basis_layer}, with a tail of {t.tail} rows, predicted from the layer before")
    if t.sinks + t.recent + t.tail > layer.n_kept:
        return bad(f"{sink_rows(t.sinks)}, {t.tail} tail and {t.recent} recent rows of {layer.n_kept}")
    r = t.rotary
    if not 0 < r.dims <= t.head_dim or r.dims % 2 or (r.HasField("base") == bool(r.freqs)):
        return bad(f"rotary of {r.dims} dims (head dim {t.head_dim}) needs a base or its frequencies, not both")
    if r.freqs and len(r.freqs) != r.dims // 2:
        return bad(f"{len(r.freqs)} rotary frequencies for {r.dims} dims")
    if [x.name for x in layer.tensors] != ["coded"] or tensor_dtype(layer.tensors[0]) != "uint8":
        return bad(f"tensors {[x.name for x in layer.tensors]}, expected one uint8 `coded`")
    coded = layer.tensors[0]
    if len(coded.shape) != 1 or coded.shape[0] != coded.nbytes or coded.nbytes < 1:
        return bad(f"coded: shape {list(coded.shape)} in {coded.nbytes} bytes")
    return None


def artifacts_problem(m: pb.CacheManifest) -> Rejection | None:
    """Every basis a coded layer names is listed once, with a well-formed sha256 and a bounded size."""
    listed = {}
    for a in m.artifacts:
        if a.kind != BASIS_KIND or not is_sha256_hex(a.sha256):
            return Rejection(pb.REJECT_REASON_ARTIFACT, f"an artefact of kind {a.kind!r}, id {a.sha256[:70]!r}")
        if not 0 < a.nbytes <= MAX_ARTIFACT_BYTES:
            return Rejection(
                pb.REJECT_REASON_ARTIFACT,
                f"artefact {a.sha256[:12]} of {a.nbytes:,} bytes (at most {MAX_ARTIFACT_BYTES:,})",
            )
        listed[a.sha256] = a
    if len(m.artifacts) > MAX_ARTIFACTS or len(listed) != len(m.artifacts):
        return Rejection(
            pb.REJECT_REASON_MALFORMED, f"{len(m.artifacts)} artefacts listed (at most {MAX_ARTIFACTS}, each once)"
        )
    named = {
        layer.transform.basis_sha256 for _, layer in leaf_layers(m.layers) if layer.kind == pb.CACHE_KIND_TRANSFORM_KV
    }
    if named != set(listed):
        return Rejection(
            pb.REJECT_REASON_MALFORMED,
            f"coded layers name bases {sorted(x[:12] for x in named)}, "
            f"the manifest lists {sorted(x[:12] for x in listed)}",
        )
    return None


def basis_problem(m: pb.CacheManifest, basis: "BasisLike") -> Rejection | None:
    """Does `basis` (its bytes checked against their sha256) fit every layer that names it: the
    layer index, the width, the very rotary settings the manifest states?"""

    def bad(message: str) -> Rejection:
        return Rejection(pb.REJECT_REASON_ARTIFACT, f"basis {basis.digest[:12]}: {message}")

    for i, layer in leaf_layers(m.layers):
        t = layer.transform
        if layer.kind != pb.CACHE_KIND_TRANSFORM_KV or t.basis_sha256 != basis.digest:
            continue
        if t.basis_layer >= len(basis):
            return bad(f"layer {i} is coded with basis layer {t.basis_layer}, the basis has {len(basis)}")
        if basis.keys[t.basis_layer].features != t.kv_heads * t.head_dim:
            return bad(f"layer {i}: {basis.keys[t.basis_layer].features} features, the cache {t.kv_heads * t.head_dim}")
        rotary = basis.rotaries[t.basis_layer]
        stated = (
            t.rotary.dims,
            t.rotary.traditional,
            t.rotary.base if t.rotary.HasField("base") else None,
            t.rotary.scale,
        )
        if (rotary.dims, rotary.traditional, rotary.base, rotary.scale) != stated or tuple(t.rotary.freqs) != (
            rotary.freqs or ()
        ):
            return bad(f"layer {i}: the basis's rotary settings differ from the manifest's")
    return None


# A lossy cache measured within this loss (tail KL, nats/token) counts as good as a lossless one when
# two caches of the same length compete: 8-bit quantization measures 0.0003-0.0011 on the real model
# and the transform codec's default level 0.0009-0.0024 (README), where greedy text does not change.
AS_GOOD_KL = 0.003


def loss_rank(lossy: bool, tail_kl: float | None) -> float:
    """How a cache ranks against others of the same length, lower first: 0 for a lossless one or one
    measured as good (AS_GOOD_KL), else its measured loss; a lossy cache nobody measured comes last,
    so that it is never preferred to one whose loss is known."""
    if not lossy:
        return 0.0
    if tail_kl is None:
        return math.inf
    return 0.0 if tail_kl <= AS_GOOD_KL else tail_kl


def quality_problem(m: pb.CacheManifest, max_kl: float | None) -> Rejection | None:
    """Is a lossy cache within the receiver's quality floor? Lossless caches always are."""
    if max_kl is None or not lossy(m):
        return None
    if (kl := measured_loss(m)) is None:
        return Rejection(
            pb.REJECT_REASON_QUALITY,
            f"a {compression_name(m)} cache whose loss its producer did not measure (this receiver "
            f"accepts at most {max_kl} nats/token)",
        )
    if not kl <= max_kl:
        return Rejection(
            pb.REJECT_REASON_QUALITY,
            f"a {compression_name(m)} cache measured at {loss_text(m.quality)}, above this receiver's floor "
            f"of {max_kl}",
        )
    return None


def expected_width(name: str, head_dim: int, bits: int, group_size: int) -> int:
    if name.endswith("packed"):
        return head_dim * bits // 32
    if name.endswith(("scales", "biases")):
        return head_dim // group_size
    return head_dim


def check_manifest(m: pb.CacheManifest, profile: ReceiverProfile, *, validated: bool = False) -> Rejection | None:
    """None if the receiver can use the cache, else why not (the first reason found). `validated`:
    `validate_manifest` passed it already (a sender's own, from its store), so it is not run again
    (0.3 ms of a fetch's path for a 30-layer cache); a manifest from a peer is never that."""
    if m.schema_version not in READABLE_SCHEMAS:
        return Rejection(
            pb.REJECT_REASON_SCHEMA,
            f"manifest schema {m.schema_version}, this kvmesh reads {', '.join(map(str, READABLE_SCHEMAS))}",
        )
    if not validated and (rejection := validate_manifest(m)):
        return rejection
    ours = profile.model
    geometry = {
        "layers": (m.num_layers, ours.num_layers),
        "kv heads": (m.num_kv_heads, ours.num_kv_heads),
        "head dim": (m.head_dim, ours.head_dim),
        "dtype": (dtype_name(m.dtype), ours.dtype),
    }
    for what, (theirs_value, ours_value) in geometry.items():
        if theirs_value != ours_value:
            return Rejection(
                pb.REJECT_REASON_GEOMETRY, f"{what} {theirs_value} in the cache, {ours_value} in this model"
            )
    theirs = m.model
    model_checks = [
        (pb.REJECT_REASON_MODEL_CONFIG, "model config", theirs.config_sha256, ours.config_sha256, False),
        (pb.REJECT_REASON_WEIGHTS, "weights", theirs.weights_sha256, ours.weights_sha256, profile.accept_other_weights),
        (pb.REJECT_REASON_TOKENIZER, "tokenizer", theirs.tokenizer_sha256, ours.tokenizer_sha256, False),
        (
            pb.REJECT_REASON_CHAT_TEMPLATE,
            "chat template",
            theirs.chat_template_sha256,
            ours.chat_template_sha256,
            profile.accept_other_chat_template,
        ),
    ]
    for reason, what, their_bytes, our_hash, allowed in model_checks:
        their_hash = their_bytes.hex()
        if their_hash != our_hash and not allowed:
            return Rejection(
                reason,
                f"the cache was made with other {what} ({their_hash[:12] or 'none'}) than this "
                f"model's ({our_hash[:12] or 'none'}; model {ours.model_id})",
            )
    if profile.prompt is not None:
        n = m.prefix.num_tokens
        if n > len(profile.prompt) or prefix_sha256(profile.prompt[:n], m.prefix.block_size) != m.prefix.sha256:
            return Rejection(pb.REJECT_REASON_PREFIX, f"the cache's {n}-token prefix is not a prefix of this prompt")
    if rejection := quality_problem(m, profile.max_kl):
        return rejection
    codec = CODEC_NAMES[m.encoding.codec]
    if codec not in profile.codecs:
        return Rejection(pb.REJECT_REASON_CODEC, f"codec {codec} is not among {sorted(profile.codecs)}")
    if m.encoding.raw_bytes > profile.max_bytes:
        return Rejection(
            pb.REJECT_REASON_SIZE_LIMIT,
            f"{m.encoding.raw_bytes:,} bytes decoded exceed this receiver's limit of {profile.max_bytes:,}",
        )
    return None
