"""Rotary position embedding (RoPE) of a model's keys: taken off before a transform codec, put back after.

A cached key is `rope(k_proj(x), position)`. Its rotation depends on the position, so keys of one head
at different positions do not share a basis; without it they do (the transform codec's PCA works on
keys with RoPE removed). Removal is `mx.fast.rope` with the angle negated (scale -> -scale), the very
kernel the model used, so removal then re-application is exact to float rounding (a few 1e-7).

Positions are given per stored row: a sparse cache keeps positions that need not be contiguous, and a
press may keep different ones per head. Contiguous positions take the model's own call (one offset);
other rows are rotated by `rotate` with cos/sin tables read off the kernel (`rotation_table`: the
kernel applied to unit pairs over the positions' range, at one offset, and the rows at the
positions taken), each product and sum its own float32 operation (for float32 keys the CPU kernel's
own floats; float16 ones within an ulp of them).

So the kernel is only ever called as the model calls it: on a row-contiguous block, at one offset.
MLX's CUDA kernel (mlx 0.32.4 on an H200) misread a broadcast block of rows given one offset per
row (every transform-coded key decoded wrong), and failed to launch on 396 rows of one offset each
(`cudaGraphAddKernelNode ... invalid argument`), where its CPU kernel gives the same floats either
way (Metal: not measured).

The codec itself rotates with these tables (`rotate`, in MLX; where MLX computes on the CPU,
`kvmesh.codec.cpu_kernels`' compiled loops, the same floats), computed once per set of positions
for all layers: the same angles as the model's, without a kernel call per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvmesh.compat import mlx_lm as compat


class RotaryError(ValueError):
    """A model's RoPE this module cannot invert exactly, or positions of the wrong shape."""


@dataclass(frozen=True)
class Rotary:
    """The rotary settings of one attention layer: what `mx.fast.rope` is called with.

    `base` or `freqs` (periods per rotated pair, mlx-lm's `_freqs`) is set, never both.
    """

    dims: int
    traditional: bool
    base: float | None = 10000.0
    scale: float = 1.0
    freqs: tuple[float, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dims": self.dims,
            "traditional": self.traditional,
            "base": self.base,
            "scale": self.scale,
            "freqs": list(self.freqs) if self.freqs is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rotary:
        freqs = d.get("freqs")
        return cls(
            dims=int(d["dims"]),
            traditional=bool(d["traditional"]),
            base=None if d.get("base") is None else float(d["base"]),
            scale=float(d.get("scale", 1.0)),
            freqs=None if freqs is None else tuple(float(f) for f in freqs),
        )

    def inverse_frequencies(self) -> np.ndarray:
        """(dims/2,) angles per position of each rotated pair, as float64 (for references and checks)."""
        if self.freqs is not None:
            return self.scale / np.asarray(self.freqs, dtype=np.float64)
        assert self.base is not None
        return self.scale * float(self.base) ** (-np.arange(0, self.dims, 2, dtype=np.float64) / self.dims)


def rotary_of(rope: Any) -> Rotary:
    """The settings of an mlx-lm RoPE module (`layer.self_attn.rope`).

    Supported: `nn.RoPE` (default and linear scaling) and modules that rotate with `_freqs` without
    rescaling the vectors (Llama3RoPE, ProportionalRoPE). Others (YaRN's and LongRoPE's magnitude
    scaling, dynamic NTK's length-dependent base) are refused: their rotation is not a function of the
    position alone, or not a pure rotation.
    """
    kind = type(rope).__name__
    if kind in ("YarnRoPE", "SuScaledRoPE", "DynamicNTKScalingRoPE"):
        raise RotaryError(f"{kind} is not supported by the transform codec (its rotation is not position-only)")
    dims = getattr(rope, "dims", None)
    traditional = getattr(rope, "traditional", None)
    if dims is None or traditional is None:
        raise RotaryError(f"{kind}: no dims/traditional attributes, not an mlx-lm RoPE module")
    freqs = compat.rope_frequencies(rope)
    if freqs is not None:
        values = np.asarray(freqs, dtype=np.float32).astype(np.float64)
        return Rotary(int(dims), bool(traditional), None, float(getattr(rope, "scale", 1.0)), tuple(values.tolist()))
    base = getattr(rope, "base", None)
    if base is None:
        raise RotaryError(f"{kind}: neither base nor _freqs")
    return Rotary(int(dims), bool(traditional), float(base), float(getattr(rope, "scale", 1.0)))


def model_layers(model: Any) -> list:
    """An mlx-lm model's decoder layers (`layers` on the model, or on its `model`, or on that one's)."""
    for owner in (model, getattr(model, "model", None), getattr(getattr(model, "model", None), "model", None)):
        layers = getattr(owner, "layers", None)
        if layers is not None:
            return list(layers)
    raise RotaryError(f"{type(model).__name__}: no layers found")


def model_rotaries(model: Any, layers: Sequence[int] | None = None) -> list[Rotary]:
    """Per layer (or per layer of `layers`), the rotary settings of an mlx-lm model's attention
    (`layers[i].self_attn.rope`)."""
    out = []
    every = model_layers(model)
    for i in range(len(every)) if layers is None else layers:
        layer = every[i]
        attn = getattr(layer, "self_attn", None)
        rope = getattr(attn, "rope", None)
        if rope is None:
            raise RotaryError(f"layer {i}: no self_attn.rope (not a RoPE attention layer)")
        out.append(rotary_of(rope))
    return out


def _positions(positions: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Positions as one int32 per row of x (B, H, T, D), flattened in (B, H, T) order."""
    b, h, t, _ = shape
    pos = np.asarray(positions, dtype=np.int32)
    if pos.ndim == 1:
        if pos.shape[0] != t:
            raise RotaryError(f"{pos.shape[0]} positions for {t} rows")
        pos = np.broadcast_to(pos[None, None], (b, h, t))
    elif pos.ndim == 2:
        if tuple(pos.shape) != (h, t):
            raise RotaryError(f"positions of shape {tuple(pos.shape)} for {h} heads of {t} rows")
        pos = np.broadcast_to(pos[None], (b, h, t))
    elif pos.ndim != 3 or tuple(pos.shape) != (b, h, t):
        raise RotaryError(f"positions of shape {tuple(pos.shape)} for keys of shape {shape}")
    return pos.reshape(-1)


def apply_rope(x: mx.array, positions: Any, rotary: Rotary, inverse: bool = False) -> mx.array:
    """x (B, H, T, D) rotated as the model rotates a key at `positions` ((T,), (H, T) or (B, H, T));
    `inverse` takes that rotation off. Returns x's dtype and shape."""
    if x.ndim != 4:
        raise RotaryError(f"keys of shape {tuple(x.shape)}: want (batch, heads, tokens, head_dim)")
    shape = tuple(x.shape)
    if shape[2] == 0:
        return x
    x = mx.contiguous(x)
    scale = -rotary.scale if inverse else rotary.scale
    freqs = None if rotary.freqs is None else mx.array(np.asarray(rotary.freqs, dtype=np.float32))
    start = contiguous_start(positions, shape)

    def rope(a: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(
            a,
            rotary.dims,
            traditional=rotary.traditional,
            base=rotary.base if freqs is None else None,
            scale=scale,
            offset=offset,
            freqs=freqs,
        )

    if start is not None:  # the model's own call: one offset for the whole block
        return rope(x, start)
    b, h, t, _ = shape
    cos, sin = (a.reshape(b, h, t, rotary.dims) for a in rotation_table(rotary, _positions(positions, shape)))
    return rotate(x.astype(mx.float32), cos, sin, rotary, inverse=inverse).astype(x.dtype)


def contiguous_start(positions: Any, shape: tuple[int, ...]) -> int | None:
    """p0 when every head's positions are p0, p0 + 1, ..., p0 + T - 1; else None."""
    if isinstance(positions, mx.array):
        return None
    pos = np.asarray(positions)
    t = shape[2]
    if pos.ndim == 0 or pos.ndim > 3 or pos.shape != tuple(shape[3 - pos.ndim : 3]):
        return None  # (T,), (H, T) or (B, H, T) only; _positions says what is wrong
    start = int(pos.reshape(-1)[0])
    return start if bool((pos == start + np.arange(t)).all()) else None


def remove_rope(x: mx.array, positions: Any, rotary: Rotary) -> mx.array:
    """Keys (B, H, T, D) with the model's rotation at `positions` taken off."""
    return apply_rope(x, positions, rotary, inverse=True)


def rotation_table(rotary: Rotary, positions: Any) -> tuple[mx.array, mx.array]:
    """(C, S), each (P, dims) float32, of the angles `mx.fast.rope` uses at these positions (P,):
    `rotate` gives x * C + pairs_swapped(x) * S, so C holds each pair's cosine twice and S its
    sine, negated where the pair's first element takes it.

    Taken from the kernel itself (it rotates unit pairs), so a rotation applied with them matches
    the model's own to float rounding: one call, at one offset, over the positions' range (lowest
    to highest), whose rows at the positions are taken. One call per distinct set of positions
    serves every layer with the same rotary settings.
    """
    pos = np.asarray(positions, dtype=np.int32).reshape(-1)
    half = rotary.dims // 2
    unit = np.zeros((1, rotary.dims), dtype=np.float32)
    first = (slice(0, None, 2), slice(1, None, 2)) if rotary.traditional else (slice(0, half), slice(half, None))
    unit[0, first[0]] = 1.0
    if pos.size == 0:
        return mx.zeros((0, rotary.dims)), mx.zeros((0, rotary.dims))
    low, span = int(pos.min()), int(pos.max()) - int(pos.min()) + 1
    x = mx.broadcast_to(mx.array(unit), (span, rotary.dims)).reshape(1, 1, span, rotary.dims)
    out = apply_rope(x, np.arange(low, low + span), rotary).reshape(span, rotary.dims)
    if not (span == pos.size and bool((np.diff(pos) == 1).all())):
        out = out[mx.array(pos - low)]
    cos, sin = out[:, first[0]], out[:, first[1]]
    if rotary.traditional:
        return (
            mx.stack([cos, cos], axis=-1).reshape(pos.size, rotary.dims),
            mx.stack([-sin, sin], axis=-1).reshape(pos.size, rotary.dims),
        )
    return mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)


def token_major_tables(rotary: Rotary, positions: np.ndarray, memo: dict) -> tuple[mx.array, mx.array]:
    """`rotation_table` at positions (B, H, T), shaped to broadcast over token-major blocks
    (B, T, H, dims); one table per distinct (rotary, positions) in `memo` (a cache's layers mostly
    share theirs; several threads may share one: a table is put there evaluated, since an MLX graph
    cannot be evaluated on a thread other than the one that made it)."""
    b, h, t = positions.shape
    same = bool((positions == positions[:1, :1]).all())
    use = positions[0, 0] if same else positions
    key = (rotary, same, use.shape, np.ascontiguousarray(use).tobytes())
    found = memo.get(key)
    if found is None:
        tables = rotation_table(rotary, use.reshape(-1))
        if same:
            found = tuple(a.reshape(1, t, 1, rotary.dims) for a in tables)
        else:
            found = tuple(a.reshape(b, h, t, rotary.dims).transpose(0, 2, 1, 3) for a in tables)
        mx.eval(*found)
        memo[key] = found
    return found


def token_major_numpy_tables(rotary: Rotary, positions: np.ndarray, memo: dict) -> tuple[np.ndarray, np.ndarray]:
    """`token_major_tables` as C-ordered NumPy arrays (for `kvmesh.codec.cpu_kernels`), kept in
    `memo` beside them."""
    key = ("numpy", rotary, positions.shape, np.ascontiguousarray(positions).tobytes())
    found = memo.get(key)
    if found is None:
        found = memo[key] = tuple(np.array(a, order="C") for a in token_major_tables(rotary, positions, memo))
    return found


def rotate(x: mx.array, cos: mx.array, sin: mx.array, rotary: Rotary, inverse: bool = False) -> mx.array:
    """x (..., head_dim) float32 rotated by the angles of `rotation_table`'s (C, S) (broadcastable to
    x[..., :dims]); `inverse` rotates back; dims beyond `rotary.dims` pass through. Each product
    and sum is its own float32 operation (no fused multiply-add): the same floats on any device,
    and as `a * cos - b * sin`, `a * sin + b * cos` pair by pair."""
    dims, half = rotary.dims, rotary.dims // 2
    rotated = x[..., :dims] if dims < x.shape[-1] else x
    if rotary.traditional:
        pairs = rotated.reshape(*rotated.shape[:-1], half, 2)
        swapped = pairs[..., ::-1].reshape(rotated.shape)
    else:
        swapped = mx.concatenate([rotated[..., half:], rotated[..., :half]], axis=-1)
    out = rotated * cos + swapped * (-sin if inverse else sin)
    return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], axis=-1)
