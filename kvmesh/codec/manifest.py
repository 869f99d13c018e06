"""Manifests: everything a receiver needs to accept or refuse a cache before any tensor byte.

Attention tensors are described token-major ([n_kept, kv_heads, width]) because that is how they
travel: a chunk holds whole rows of one tensor, so the first m tokens of a dense cache are a prefix
of each tensor's chunks, and a store can serve a shorter prefix without decoding the rest. The
arrays of recurrent layers travel as they are, rows along their first axis.

This module reads manifests and needs no MLX (the store, server and daemon use it); building one
from MLX caches is `kvmesh.codec.encode`'s job.
"""

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvmesh.model.fingerprint import dtype_name
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.versions import PREDICTED_SCHEMA, READABLE_SCHEMAS, TAIL_SCHEMA

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "uint32": 4, "uint8": 1}
# The tensors each attention cache kind stores, in manifest order (recurrent layers: `state_names`).
TENSOR_NAMES: dict[int, tuple[str, ...]] = {
    pb.CACHE_KIND_SPARSE_KV: ("keys", "values"),
    pb.CACHE_KIND_SPARSE_QUANTIZED_KV: tuple(
        f"{role}.{part}" for role in ("keys", "values") for part in ("packed", "scales", "biases")
    ),
    pb.CACHE_KIND_ROTATING_KV: ("keys", "values"),
    pb.CACHE_KIND_CHUNKED_KV: ("keys", "values"),
    pb.CACHE_KIND_TRANSFORM_KV: ("coded",),
}
# At most this many arrays in one recurrent layer (mlx-lm's models use 1 to 4).
MAX_STATE_ARRAYS = 8
# At most this many caches in one composite layer (mlx-lm's models use 2).
MAX_LIST_PARTS = 4
# The kind of artefact a transform-coded layer needs (kvmesh.codec.basis).
BASIS_KIND = "transform-basis"
CODECS = {"none": pb.CODEC_NONE, "zstd": pb.CODEC_ZSTD}
CODEC_NAMES = {v: k for k, v in CODECS.items()}
# Quality metrics (kvmesh.v1.Quality), both KL divergences in nats/token: "tail_kl" measured on the
# cache itself by its producer (kvmesh.caches.quality); LEVEL_KL, the worst its transform-coding
# level measured on the bench's texts, for a copy a sender coded without the model to measure it
# (kvmesh.codec.coded_copy).
LEVEL_KL = "level_kl"
LOSS_METRICS = ("tail_kl", LEVEL_KL)


def kind_name(kind: int) -> str:
    """CACHE_KIND_SPARSE_KV -> `sparse_kv`, for messages."""
    if kind in pb.CacheKind.values():
        return pb.CacheKind.Name(kind).removeprefix("CACHE_KIND_").lower()
    return f"unknown({kind})"


def state_names(n: int) -> list[str]:
    """The tensor names of a recurrent layer of `n` arrays: state.0, state.1, ..."""
    return [f"state.{i}" for i in range(n)]


def token_major(kind: int) -> bool:
    """Attention layers store positions, token-major; recurrent layers store arrays as they are, and
    a transform-coded layer its blob (bytes)."""
    return kind not in (pb.CACHE_KIND_ARRAYS, pb.CACHE_KIND_TRANSFORM_KV)


def transform_coded(manifest: pb.CacheManifest) -> bool:
    """Does any layer travel transform coded?"""
    return any(layer.kind == pb.CACHE_KIND_TRANSFORM_KV for _, layer in leaf_layers(manifest.layers))


def layer_bits(manifest: pb.CacheManifest) -> set[int]:
    """The bits of its quantized layers (empty: none is quantized)."""
    return {layer.bits for _, layer in leaf_layers(manifest.layers) if layer.bits}


def lossy(manifest: pb.CacheManifest) -> bool:
    """A press that dropped or rounded something, or a transform-coded or quantized layer. The bits
    are read from the config and the layers too, not only from the method: older kvmesh recorded
    bits alone (`prefill --kv-bits`) as `full`."""
    quantized = manifest.compression.config.HasField("kv_bits") or bool(layer_bits(manifest))
    return manifest.compression.method != "full" or quantized or transform_coded(manifest)


def predicted(manifest: pb.CacheManifest) -> bool:
    """Whether any transform-coded layer of the manifest is predicted from the layer before."""
    return any(layer.transform.predicted for _, layer in leaf_layers(manifest.layers))


def manifest_schema(leaves: Iterable[pb.LayerSpec]) -> int:
    """The oldest schema that describes these (leaf) layers (kvmesh.versions): the predicted layers'
    where a transform-coded layer is predicted from the one before, the tails' where one has a
    tail, else the oldest this kvmesh reads."""
    layers = list(leaves)
    if any(layer.transform.predicted for layer in layers):
        return PREDICTED_SCHEMA
    return TAIL_SCHEMA if any(layer.transform.tail for layer in layers) else READABLE_SCHEMAS[0]


def measured_loss(manifest: pb.CacheManifest) -> float | None:
    """The loss its producer measured (nats/token: LOSS_METRICS), or None when it did not."""
    if manifest.HasField("quality") and manifest.quality.metric in LOSS_METRICS:
        return manifest.quality.value
    return None


def uncodable_reason(manifest: pb.CacheManifest) -> str | None:
    """Why a cache cannot be transform coded whole (kvmesh.codec.coded_copy), or None when it can:
    it must be lossless and every layer a float attention layer that kept every position."""
    if lossy(manifest):
        return "it is lossy already"
    for _, layer in leaf_layers(manifest.layers):
        if layer.kind != pb.CACHE_KIND_SPARSE_KV or layer.n_kept != layer.offset:
            return "not every layer is a full attention layer that kept every position"
    return None


def fp16_bytes(manifest: pb.CacheManifest) -> int:
    """The bytes of a cache's tensors in float16: what the transform codec reads, as rates count it."""
    return manifest.encoding.raw_bytes * 2 // ITEMSIZE[dtype_name(manifest.dtype)]


def loss_text(quality: pb.Quality) -> str:
    """A measured loss in words: where its figure comes from."""
    if quality.metric == LEVEL_KL:
        return f"{quality.value:.4f} nats/token, its coding level's worst on the bench's texts (coded on request)"
    return f"{quality.value:.4f} nats/token over its context's last {quality.tokens} tokens"


def compression_name(manifest: pb.CacheManifest) -> str:
    """The press with what it kept and its bits (its layers' when the config names none), and
    `+ transform` when layers are transform coded: `full`, `quantize 3-bit`, `snapkv 50% 8-bit`,
    `full + transform`, for people."""
    config = manifest.compression.config
    parts = [manifest.compression.method]
    if config.HasField("budget"):
        parts.append(f"{config.budget} kept")
    elif manifest.compression.method not in ("full", "quantize") and config.ratio:
        parts.append(f"{1 - config.ratio:.0%} kept")
    bits = config.kv_bits if config.HasField("kv_bits") else max(layer_bits(manifest), default=0)
    if bits:
        parts.append(f"{bits}-bit")
    return " ".join(parts) + (" + transform" if transform_coded(manifest) else "")


def model_name(model: Any) -> str:
    """A model for people: its Hugging Face repo id when known, else its type, with its short id."""
    return f"{model.repo_id or model.model_type or 'model'} ({model.model_id[:8]})"


def tensor_dtype(t: pb.TensorSpec) -> str:
    return dtype_name(t.dtype)


@dataclass(frozen=True)
class ChunkSlot:
    """Where one chunk belongs: its tensor (index over all layers' tensors) and byte range."""

    tensor: int
    byte_offset: int
    raw_length: int
    row_bytes: int


def leaf_layers(layers: Iterable[pb.LayerSpec]) -> list[tuple[int, pb.LayerSpec]]:
    """(model layer, spec) of every cache that holds tensors, in payload order: a composite layer
    (CACHE_KIND_LIST) stands for its parts."""
    return [
        (i, part)
        for i, layer in enumerate(layers)
        for part in (layer.parts if layer.kind == pb.CACHE_KIND_LIST else [layer])
    ]


def tensor_specs(manifest: pb.CacheManifest) -> list[pb.TensorSpec]:
    return [t for _, layer in leaf_layers(manifest.layers) for t in layer.tensors]


def rows_per_chunk(row_bytes: int, chunk_size: int) -> int:
    return max(1, chunk_size // row_bytes)


# The cache kinds whose rows are one token each, from the first: a block of them is the same bytes
# in every cache of that prefix. Windows, attention chunks, recurrent state and coded blobs are not.
BLOCKWISE_KINDS = (pb.CACHE_KIND_SPARSE_KV, pb.CACHE_KIND_SPARSE_QUANTIZED_KV)


def whole_entry_reason(manifest: pb.CacheManifest) -> str | None:
    """Why the cache is stored and sent whole rather than by blocks (None: it goes by blocks).

    Blocks fit per-token KV layers that kept every position (full attention, any float dtype, or
    quantized); a layer of another kind (a sliding window, recurrent state, a transform-coded
    blob) or one that evicted tokens keeps the whole-entry layout."""
    for i, layer in leaf_layers(manifest.layers):
        if layer.kind not in BLOCKWISE_KINDS:
            return f"layer {i} is {kind_name(layer.kind)}, whose state is not one row per token"
        if layer.n_kept != layer.offset:
            return f"layer {i} evicted tokens"
    return None


def storage_text(manifest: pb.CacheManifest) -> str:
    """How the cache is stored and sent, for people (`kvmesh cache show`): by blocks, or whole and why."""
    if manifest.encoding.block_rows:
        return f"by blocks of {manifest.encoding.block_rows} tokens (shared prefixes stored and sent once)"
    why = whole_entry_reason(manifest) or "made before caches went by blocks"
    return f"whole ({why})"


def block_rows_for(manifest: pb.CacheManifest) -> int:
    """The Encoding.block_rows a new cache of this manifest gets: its block size when it goes by
    blocks (`whole_entry_reason`), else 0."""
    return 0 if whole_entry_reason(manifest) else manifest.prefix.block_size


def block_chunk_rows(block: int, most: int) -> int:
    """Rows per chunk of a blockwise tensor that takes at most `most` rows a chunk: one block, or
    the largest part of one that divides it (a block larger than a chunk travels in equal parts)."""
    return block if most >= block else max(d for d in range(1, most + 1) if block % d == 0)


def _rows_of_chunks(manifest: pb.CacheManifest) -> list[tuple[pb.TensorSpec, int]]:
    """Each tensor and the rows each of its chunks holds (the last one fewer): as many as the chunk
    size takes, or for a blockwise cache's tensors whole blocks (`block_chunk_rows`)."""
    block = manifest.encoding.block_rows
    found = []
    for _, layer in leaf_layers(manifest.layers):
        for t in layer.tensors:
            if not t.shape[0]:
                found.append((t, 0))
                continue
            rows = rows_per_chunk(t.nbytes // t.shape[0], manifest.encoding.chunk_size)
            found.append((t, block_chunk_rows(block, rows) if block and layer.kind in BLOCKWISE_KINDS else rows))
    return found


def chunk_count(manifest: pb.CacheManifest) -> int:
    """How many chunks the manifest's tensors make, without building the plan."""
    return sum(-(-t.shape[0] // rows) for t, rows in _rows_of_chunks(manifest) if rows)


def chunk_plan(manifest: pb.CacheManifest) -> list[ChunkSlot]:
    """The payload's chunks in order; sender and receiver both derive it from the manifest."""
    plan = []
    for i, (t, rows) in enumerate(_rows_of_chunks(manifest)):
        n = t.shape[0]
        if not n:
            continue
        row_bytes = t.nbytes // n
        for r0 in range(0, n, rows):
            plan.append(ChunkSlot(i, r0 * row_bytes, min(rows, n - r0) * row_bytes, row_bytes))
    return plan


def content_id(manifest: pb.CacheManifest) -> str:
    """An id that is the same for the same cache content, wherever and whenever it was encoded."""
    stable = pb.CacheManifest()
    stable.CopyFrom(manifest)
    stable.ClearField("cache_id")
    stable.ClearField("created_unix_ms")
    stable.ClearField("node_id")
    stable.ClearField("held")
    return hashlib.sha256(stable.SerializeToString(deterministic=True)).hexdigest()[:32]


def uncuttable_reason(manifest: pb.CacheManifest) -> str | None:
    """Why the cache serves only its exact prefix, or None when any shorter one can be cut from it.

    A shorter prefix needs every layer to hold every position of it (a transform-coded layer holds
    each position's row: `kvmesh.codec.cut` re-codes its prefix).
    """
    for i, layer in leaf_layers(manifest.layers):
        if layer.kind == pb.CACHE_KIND_ARRAYS:
            return f"layer {i} is recurrent state, which folds in every token and cannot be cut back"
        if layer.n_kept != layer.offset:
            if layer.kind == pb.CACHE_KIND_ROTATING_KV:
                return f"layer {i}'s sliding window of {layer.window} has dropped earlier tokens"
            if layer.kind == pb.CACHE_KIND_CHUNKED_KV:
                return f"layer {i}'s attention chunks of {layer.chunk_size} have dropped earlier tokens"
            return f"layer {i} evicted tokens"
    return None


def served_prefixes(manifest: pb.CacheManifest) -> dict[str, Any]:
    """Which prompt prefixes the cache serves, derived from its layers (`kvmesh cache show`): its own
    `num_tokens`, and, when `shorter`, every multiple of `block_size` below it (the longest is
    `longest_shorter`); else `exact_only` says why not."""
    n, block = manifest.prefix.num_tokens, manifest.prefix.block_size
    served: dict[str, Any] = {"num_tokens": n, "block_size": block}
    if why := uncuttable_reason(manifest):
        return {**served, "shorter": False, "exact_only": why}
    return {**served, "shorter": True, "longest_shorter": (n - 1) // block * block}


def served_text(served: dict[str, Any]) -> str:
    """`served_prefixes` for people: `its prefix of 300 tokens and every multiple of 128 up to 256`."""
    n, block = f"{served['num_tokens']:,}", served["block_size"]
    if not served["shorter"]:
        return f"only its exact prefix of {n} tokens ({served['exact_only']})"
    if not served["longest_shorter"]:
        return f"its prefix of {n} tokens (no shorter one of whole {block}-token blocks)"
    return f"its prefix of {n} tokens and every multiple of {block} up to {served['longest_shorter']:,}"


def cuttable(manifest: pb.CacheManifest) -> bool:
    """Can the cache serve any shorter (block-aligned) prefix of itself?"""
    return uncuttable_reason(manifest) is None


def layer_report(manifest: pb.CacheManifest) -> list[dict[str, Any]]:
    """What each cache holds, for people: its layer and kind, the positions it kept of the prefix (or
    the shapes of its recurrent arrays), its quantization and bytes; a composite layer gives a row
    per part."""
    report = []
    for i, layer in leaf_layers(manifest.layers):
        row: dict[str, Any] = {"layer": i, "kind": kind_name(layer.kind)}
        if token_major(layer.kind) or layer.kind == pb.CACHE_KIND_TRANSFORM_KV:  # (a blob of rows per position)
            row.update(kept=layer.n_kept, of=layer.offset)
        else:
            row["arrays"] = [list(t.shape) for t in layer.tensors]
        if layer.kind == pb.CACHE_KIND_ROTATING_KV:
            row.update(window=layer.window, keep=layer.keep)
        if layer.kind == pb.CACHE_KIND_CHUNKED_KV:
            row.update(chunk_size=layer.chunk_size)
        if layer.bits:
            row.update(bits=layer.bits, group_size=layer.group_size)
        row["codec"] = layer_codec(layer)
        row["bytes"] = sum(t.nbytes for t in layer.tensors)
        report.append(row)
    return report


def sink_rows(count: int) -> str:
    """'1 sink', '4 sinks': a transform-coded layer's leading raw rows, as messages name them."""
    return f"{count} sink{'s' if count != 1 else ''}"


def layer_codec(layer: pb.LayerSpec) -> str:
    """How a layer's tensors are coded, for people: `fp16`, `8-bit`, or the transform's steps and
    components (keys / values; its tail's when it has one)."""
    if layer.kind == pb.CACHE_KIND_TRANSFORM_KV:
        t = layer.transform
        features = t.kv_heads * t.head_dim
        tail = (
            f", last {t.tail} rows k {t.key_tail_components} @{t.key_tail_step:.3g}, "
            f"v {t.value_tail_components} @{t.value_tail_step:.3g}"
            if t.tail
            else ""
        )
        return (
            f"transform k {t.key_components}/{features} @{t.key_step:.3g}, "
            f"v {t.value_components}/{features} @{t.value_step:.3g}{tail}, {sink_rows(t.sinks)} raw"
        )
    if layer.bits:
        return f"{layer.bits}-bit (groups of {layer.group_size})"
    return ", ".join(sorted({tensor_dtype(t) for t in layer.tensors})) or "-"


def press_config_to_proto(config: dict[str, Any]) -> pb.PressConfig:
    """A press's config (kvmesh.caches.presses.Press.config()) as the typed message; None stays unset."""
    return pb.PressConfig(**{k: v for k, v in config.items() if v is not None})
