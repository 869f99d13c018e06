"""A transform basis as bytes, read and checked without MLX: what the store, the server and a receiver
hold a basis to before it is kept, served or decoded with (the basis itself: kvmesh.codec.basis).

The bytes are a safetensors file, written with sorted names and a canonical JSON header so the same
basis always gives the same bytes. A sha256 proves the bytes are the sender's, not that they are a
basis: a sender may name NaN, inf or huge numbers by their true digest, and every cache decoded with
them would be garbage. So a basis is also held to what a PCA of float16 KV can be (`read_basis`),
and before any byte of one is fetched, to the size a basis of the cache's geometry can take
(`basis_bytes_bound`); once read, its layers to that geometry (`geometry_problem`).
"""

import json
import math
import struct
from typing import Any

import numpy as np

from kvmesh.v1 import cache_pb2 as pb

FORMAT = "kvmesh-transform-basis/1"
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
# The dtypes each tensor may have: what fit_basis writes (components in float16 unless asked for float32).
# Each layer after the first may also hold its keys' and values' predictor (kvmesh.codec.prediction).
TENSOR_DTYPES = {
    "mean": ("F32",),
    "components": ("F16", "F32"),
    "rms": ("F32",),
    "predictor": ("F16",),
    "residual_rms": ("F32",),
}
# The largest number float16 KV holds; a key with RoPE taken off moves magnitude within its rotated
# pair, so one of its features reaches sqrt(2) times that.
FLOAT16_MAX = 65504.0
FEATURE_LIMITS = {"k": math.sqrt(2) * FLOAT16_MAX, "v": FLOAT16_MAX}
# Each component is a unit row, scaled back from the space where the features were weighed
# (kvmesh.codec.attention_metric): by 1 / sqrt(weight), each weight at least WEIGHT_FLOOR of their mean
# of 1, so its norm lies between 1 / sqrt(F * (1 + WEIGHT_FLOOR)) and 1 / sqrt(WEIGHT_FLOOR) (1 for a
# basis fitted without weights). Float16 rounding of its entries moves its norm by ~2^-11: a row
# further than UNIT_TOLERANCE beyond those bounds is not one.
WEIGHT_FLOOR = 0.01
UNIT_TOLERANCE = 2**-6
# A header's bytes: per layer, six tensors' names, shapes and offsets and a rotary's settings (its
# frequencies too: up to 256 of them); beside them, how the basis was fitted (the texts' names).
HEADER_BYTES_PER_LAYER = 8 << 10
HEADER_BYTES = 64 << 10


class BasisError(ValueError):
    """Basis bytes that do not match their id, or cannot be read, or do not fit a cache."""


def safetensors_bytes(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> bytes:
    """Deterministic safetensors bytes: sorted names, canonical JSON, little-endian data."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(meta.items()))}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        raw = a.tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def read_safetensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """(tensors, their safetensors dtype names, metadata) of safetensors bytes."""
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8 : 8 + n]))
        meta = header.pop("__metadata__", {})
        body = memoryview(data)[8 + n :]
        out, dtypes = {}, {}
        for name, spec in header.items():
            start, end = spec["data_offsets"]
            dt = np.dtype(_DTYPES[spec["dtype"]]).newbyteorder("<")
            out[name] = np.frombuffer(body[start:end], dtype=dt).reshape(spec["shape"]).astype(dt.newbyteorder("="))
            dtypes[name] = spec["dtype"]
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise BasisError(f"unreadable basis bytes: {e}") from None
    return out, dtypes, meta


def read_basis(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and metadata of basis bytes (their sha256 already checked), refused (BasisError)
    unless sane: every layer's mean, components and rms of its dtype, finite, and within what a PCA
    of float16 KV can be; the rotary settings' numbers finite and positive."""
    tensors, dtypes, meta = read_safetensors(data)
    if meta.get("format") != FORMAT:
        raise BasisError(f"not a transform basis (format {meta.get('format')!r}, want {FORMAT!r})")
    for name, dtype in dtypes.items():
        wanted = TENSOR_DTYPES.get(name.rsplit(".", 1)[-1], ())
        if dtype not in wanted:
            raise BasisError(f"basis tensor {name} is {dtype} (a basis holds {'/'.join(wanted) or 'no such tensor'})")
    for name, array in tensors.items():
        if problem := tensor_problem(name, array):
            raise BasisError(f"basis tensor {name}: {problem}")
    check_rotaries(meta.get("rotaries", "[]"))
    check_steps(meta.get("info", "{}"), len({name.split(".")[1] for name in tensors if name.startswith("layers.")}))
    return tensors, meta


def component_norms(features: int) -> tuple[float, float]:
    """The least and the largest norm a component of `features` may have (see WEIGHT_FLOOR)."""
    return (1 - UNIT_TOLERANCE) / math.sqrt(features * (1 + WEIGHT_FLOOR)), (1 + UNIT_TOLERANCE) / math.sqrt(
        WEIGHT_FLOOR
    )


def tensor_problem(name: str, array: np.ndarray) -> str | None:
    """Why one tensor of a basis (`layers.{i}.{k|v}.{mean|components|rms}`) cannot be a PCA of
    float16 KV, or None: a mean is within what a feature can be; a component is a unit row, weighed
    (`component_norms`); a coefficient's RMS is at most what the longest centred row (2 * limit *
    sqrt(F)) can give, in order of decreasing variance."""
    *_, kind, what = ["", *name.split(".")]
    x = array.astype(np.float64)
    if not np.isfinite(x).all():
        return f"{int(x.size - np.isfinite(x).sum()):,} of its {x.size:,} values are NaN or infinite"
    limit = FEATURE_LIMITS.get(kind, FLOAT16_MAX)
    if what == "mean" and x.size and (top := float(np.abs(x).max())) > limit:
        return f"a mean of {top:.4g}, beyond what float16 KV holds ({limit:.6g})"
    if what == "components" and x.ndim == 2 and x.size:
        norms = np.sqrt((x * x).sum(axis=1))
        low, high = component_norms(x.shape[1])
        if norms.min() < low or norms.max() > high:
            far = float(norms.min() if norms.min() < low else norms.max())
            return f"a component's norm is {far:.4g}, outside [{low:.4g}, {high:.4g}] (unit rows, weighed)"
    if what in ("rms", "residual_rms") and x.size:
        # (Coefficients of weighed rows: at most sqrt(F * (1 + WEIGHT_FLOOR)) times a row's length;
        # a residual's, in units of the tensor's scale, as large as the predictor allows: not bounded.)
        bound = 2 * limit * math.sqrt(x.size) / component_norms(x.size)[0] if what == "rms" else math.inf
        if x.min() < 0 or x.max() > bound:
            return f"an RMS of {float(x.min() if x.min() < 0 else x.max()):.4g}, outside [0, {bound:.6g}]"
        if what == "rms" and (np.diff(x) > 0).any():
            return "the RMS does not decrease (components are in order of decreasing variance)"
    return None


def check_rotaries(text: str) -> None:
    """The rotary settings (JSON) hold finite, positive bases, scales and frequencies; what they lack
    is for Basis.from_bytes, which builds them, to name."""
    try:
        rotaries = json.loads(text)
    except ValueError as e:
        raise BasisError(f"unreadable basis metadata: rotaries: {e}") from None
    for r in rotaries if isinstance(rotaries, list) else ():
        given = [r.get("base"), r.get("scale"), *(r.get("freqs") or ())] if isinstance(r, dict) else []
        if any(isinstance(x, (int, float)) and not (math.isfinite(x) and x > 0) for x in given):
            raise BasisError(f"basis rotary settings {r} hold a number that is not finite and positive")


# Fitted step factors beyond this range are no measurement (kvmesh.codec.sensitivity bounds them far
# tighter): a basis naming one is refused.
STEP_FACTOR_RANGE = (1e-3, 1e3)


def steps_problem(steps: Any, layers: int) -> str | None:
    """Why a basis's fitted step factors (None, or {"k": [...], "v": [...]} of one positive number
    per layer) cannot be used, or None."""
    if steps is None:
        return None
    if not isinstance(steps, dict) or set(steps) != {"k", "v"}:
        return f"are {steps!r:.80}, not one list for keys and one for values"
    lo, hi = STEP_FACTOR_RANGE
    for kind, factors in steps.items():
        if not isinstance(factors, list) or len(factors) != layers:
            return f"for {kind} are {factors!r:.80}, not one per layer of {layers}"
        if not all(type(f) in (int, float) and lo <= f <= hi for f in factors):
            return f"for {kind} hold a number outside [{lo:g}, {hi:g}]"
    return None


def check_steps(info_text: str, layers: int) -> None:
    """The fitted step factors in a basis's info (JSON) are one number in range per layer (of
    `layers`, as its tensors count them) for keys and for values, or absent."""
    try:
        info = json.loads(info_text)
    except ValueError as e:
        raise BasisError(f"unreadable basis metadata: {e}") from None
    steps = info.get("steps") if isinstance(info, dict) else None
    if (problem := steps_problem(steps, layers)) is not None:
        raise BasisError(f"unreadable basis metadata: its step factors {problem}")


def model_features(m: pb.CacheManifest) -> int:
    """The features of a row of a coded layer of `m` (every one has the cache's heads: compat)."""
    return int(m.num_kv_heads) * int(m.head_dim)


def basis_bytes_bound(m: pb.CacheManifest) -> int:
    """The most bytes a basis of `m`'s geometry takes: one layer per model layer at most, each of a
    key and a value part of F features (a float32 mean and rms, F x F float32 components, the
    predictors), and a header. A basis announced larger is refused before any byte of it is fetched."""
    layers, features = len(m.layers), model_features(m)
    # (and its predictors: float16 maps from 2F inputs (keys) and 3F (values) and a constant, and
    # each one's float32 residual RMS)
    predictors = 2 * (5 * features + 2) * features + 2 * 4 * features
    per_layer = 2 * (2 * 4 * features + 4 * features * features) + predictors
    return HEADER_BYTES + layers * (HEADER_BYTES_PER_LAYER + per_layer)


def geometry_problem(m: pb.CacheManifest, digest: str, covered: list[int], features: list[int]) -> str | None:
    """Why the basis `digest`, covering model layers `covered` (its layer j codes model layer
    covered[j]) with rows of `features[j]`, cannot be one of `m`'s model, or None: each model layer
    at most once, none beyond the model's, none wider than its rows, and each layer of `m` coded with
    it coded with the basis layer of its own model layer."""
    if len(set(covered)) != len(covered) or len(covered) != len(features):
        return f"it covers model layers {covered} with {len(features)} layers of tensors"
    if covered and not 0 <= min(covered) <= max(covered) < len(m.layers):
        return f"it covers model layers {min(covered)}..{max(covered)}, the cache's model has {len(m.layers)}"
    if features and max(features) > (width := model_features(m)):
        return f"a layer of {max(features)} features, the cache's rows have {width}"
    for i, layer in enumerate(m.layers):
        t = layer.transform
        if layer.kind != pb.CACHE_KIND_TRANSFORM_KV or t.basis_sha256 != digest or t.basis_layer >= len(covered):
            continue  # (a basis layer beyond the basis is basis_problem's refusal)
        if (covers := covered[t.basis_layer]) != i:
            return f"layer {i} is coded with basis layer {t.basis_layer}, which covers model layer {covers}"
    return None
