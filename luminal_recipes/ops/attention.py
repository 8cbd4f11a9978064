"""Rotary embeddings and scaled dot-product attention, composed from primitives.

Masks are built from Iota comparisons and applied as an additive bias of the dtype's most negative finite value
(as transformers does), so no inf ever meets a multiply.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import GraphError, ShapeError
from ..graph import DType, Tensor, cast
from ..graph.symbolic import dims_equal, shape_str
from .elementwise import logical_and, logical_not
from .linalg import matmul
from .norm import softmax
from .shape import concat


# ---- rotary embeddings -----------------------------------------------------------------------------------------
def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last axis (Llama/Mistral convention)."""
    d = x.shape[-1]
    x1, x2 = x.slice(-1, 0, d // 2), x.slice(-1, d // 2, d)
    return concat([-x2, x1], -1)


def rotate_pairs(x: Tensor) -> Tensor:
    """(x0, x1), (x2, x3)... -> (-x1, x0), (-x3, x2)... (FLUX.2's ``repeat_interleave_real=True`` convention)."""
    d = x.shape[-1]
    pairs = x.split_dim(-1, (d // 2, 2))
    re, im = pairs.slice(-1, 0, 1), pairs.slice(-1, 1, 2)
    return concat([-im, re], -1).reshape(x.shape)


def swap_halves(x: Tensor) -> Tensor:
    """[x1, x2] -> [x2, x1] over the last axis (``rotate_half`` without its sign)."""
    d = x.shape[-1]
    return concat([x.slice(-1, d // 2, d), x.slice(-1, 0, d // 2)], -1)




def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str = "half") -> Tensor:
    """``x * cos + rotate(x) * sin``; ``cos``/``sin`` have x's trailing shape ``[S, D]`` (broadcast over the rest).

    ``style="half"`` rotates halves (Llama, Mistral), ``style="pairs"`` rotates adjacent pairs (FLUX.2). Tables
    wider than ``x`` (f32 with bf16 activations) rotate in their dtype and round once to ``x``'s, as diffusers
    does; narrower ones are cast to ``x``'s dtype.

    The rotation's sign goes onto the table: ``rotate(x) * sin = swap(x) * (sin * signs)``, signs +-1, the same
    values (flipping a sign is exact), but the rotation is then a pure copy of x (one Concat; for "pairs" not even
    that: a reversed view, see ``_apply_rope_pairs``) and the signs fuse into the Elementwise pass of the sum,
    instead of a kernel negating half of x before the copy.
    """
    if style not in ("half", "pairs"):
        raise GraphError(f"apply_rope: style must be 'half' (Llama, Mistral) or 'pairs' (FLUX.2), got {style!r}")
    d = x.shape[-1]
    if style == "pairs" and isinstance(d, int) and d % 2 == 0:
        return _apply_rope_pairs(x, cos, sin)
    if isinstance(d, int) and d % 2 == 0:
        rot = swap_halves(x)
        signs = np.ones(d)
        signs[: d // 2] = -1.0
    else:  # a symbolic or odd head size: the rotation with its sign, as the references write it
        rot, signs = rotate_half(x) if style == "half" else rotate_pairs(x), None
    if cos.dtype.is_float and x.dtype.is_float and cos.dtype.bits > x.dtype.bits and sin.dtype == cos.dtype:
        dtype = cos.dtype
        x_, rot_ = cast(x, dtype), cast(rot, dtype)
    else:
        dtype, x_, rot_ = x.dtype, x, rot
        cos = cos if cos.dtype == x.dtype else cast(cos, x.dtype)
        sin = sin if sin.dtype == x.dtype else cast(sin, x.dtype)
    sin = sin.broadcast_to(x.shape)
    if signs is not None:
        sin = sin * x.graph.constant(signs, dtype).broadcast_to(x.shape)
    out = x_ * cos.broadcast_to(x.shape) + rot_ * sin
    return out if out.dtype == x.dtype else cast(out, x.dtype)


def _apply_rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``apply_rope(..., style="pairs")`` for an even head size, computed on the pairs ``[..., D/2, 2]``: there the
    swap (x0, x1) -> (x1, x0) is a view of x (the pair axis reversed, a negative stride), so the whole rotation is
    one element-wise pass reading x twice, instead of a copy of the swapped x (a Concat of its two halves of each
    pair) and a pass over it. Same operations, same values, as ``x * cos + swap(x) * (sin * signs)`` on ``[..., D]``."""
    d = x.shape[-1]
    shape = x.shape
    pairs = shape[:-1] + (d // 2, 2)
    x5 = x.split_dim(-1, (d // 2, 2))
    rot = x5.flip(-1)
    if cos.dtype.is_float and x.dtype.is_float and cos.dtype.bits > x.dtype.bits and sin.dtype == cos.dtype:
        dtype = cos.dtype
        x5, rot = cast(x5, dtype), cast(rot, dtype)
    else:
        dtype = x.dtype
        cos = cos if cos.dtype == x.dtype else cast(cos, x.dtype)
        sin = sin if sin.dtype == x.dtype else cast(sin, x.dtype)
    cos5 = cos.broadcast_to(shape).split_dim(-1, (d // 2, 2))
    signs = x.graph.constant(np.array([-1.0, 1.0]), dtype)  # the rotation's sign, per element of a pair
    sin5 = sin.broadcast_to(shape).split_dim(-1, (d // 2, 2)) * signs.broadcast_to(pairs)
    out = x5 * cos5 + rot * sin5
    # rounded on the pairs, then reshaped (a view): the cast reads the sum whole, so rules see the whole rotation
    return (out if out.dtype == x.dtype else cast(out, x.dtype)).reshape(shape)


def rope_tables(positions: np.ndarray, dim: int, theta: float = 10000.0, style: str = "half"):
    """cos/sin tables ``[S, dim]`` for integer positions, computed in f64 as the references do (host-side)."""
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    if style == "half":
        ang = np.concatenate([ang, ang], axis=-1)
    else:
        ang = np.repeat(ang, 2, axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- attention ---------------------------------------------------------------------------------------------------
def _neg(dtype: DType) -> float:
    if dtype.bits < 16 or dtype.np.kind == "f":
        return float(np.finfo(np.float32 if dtype.bits < 16 else dtype.np).min)
    import ml_dtypes  # ml_dtypes.finfo, not np.finfo: numpy's finfo rejects bfloat16

    return float(ml_dtypes.finfo(dtype.np).min)


def attention_mask(
    g, s, t, causal: bool = False, window: int | None = None, key_mask: Tensor | None = None, batch=None,
    positions: Tensor | None = None,
):
    """Boolean "may attend" mask ``[B or 1, 1, S, T]``. Keys sit at positions 0..T-1; queries at the last S of
    them, or at ``positions`` (i32 ``[S]``, absolute: a KV cache attended over a bucket of T >= filled keys)."""
    allowed = None
    if causal or window is not None:
        if positions is not None:
            q_abs = (positions if positions.dtype == DType.I32 else cast(positions, DType.I32)).expand(1, t)
        else:
            # absolute query positions t-s..t-1 as a slice of iota(t): exact also when t - s is symbolic (a KV
            # cache of p + 1 keys), where adding the offset as a scalar constant is impossible
            q_abs = g.iota(t).slice(0, t - s, t).expand(1, t)
        k_pos = g.iota(t).expand(0, s)
        if causal:
            allowed = logical_not(q_abs < k_pos)  # k <= q
        if window is not None:
            near = k_pos > (q_abs - window)  # q - k < window
            allowed = near if allowed is None else logical_and(allowed, near)
        allowed = allowed.unsqueeze(0).unsqueeze(0)  # [1, 1, S, T]
    if key_mask is not None:
        if key_mask.dtype != DType.BOOL:
            key_mask = logical_not(cast(key_mask, DType.I32) < 1)
        b = key_mask.shape[0]
        km = key_mask.unsqueeze(1).unsqueeze(1).broadcast_to((b, 1, s, t))
        allowed = km if allowed is None else logical_and(allowed.broadcast_to((b, 1, s, t)), km)
    return allowed


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    key_mask: Tensor | None = None,
    scale: float | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """softmax(q k^T * scale + bias) v for ``q [B, H, S, D]``, ``k, v [B, Hkv, T, D]`` (grouped-query when
    Hkv < H: each kv head serves H/Hkv query heads, by broadcasting, never by copying).

    ``mask``: bool ``[B|1, 1|H, S, T]`` (True = attend) or an additive float bias of that shape;
    ``causal``/``window``: built-in masks (key j may be seen by query i when ``j <= pos_i`` and ``pos_i - j <
    window``; queries are the last S of T positions, or at ``positions`` (i32 ``[S]``) when given: a KV cache
    whose first T rows are attended, the ones past the filled prefix masked); ``key_mask`` ``[B, T]``: padding
    (True/1 = real token).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ShapeError(
            f"attention: expects q, k, v as [B, H, S, D]; got {shape_str(q.shape)}, "
            f"{shape_str(k.shape)}, {shape_str(v.shape)}"
        )
    b, h, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if not (dims_equal(k.shape[3], d) and dims_equal(v.shape[2], t) and dims_equal(v.shape[1], hkv)):
        raise ShapeError(
            f"attention: k {shape_str(k.shape)} / v {shape_str(v.shape)} do not match q {shape_str(q.shape)}"
        )
    if isinstance(h, int) and isinstance(hkv, int) and h % hkv:
        raise ShapeError(f"attention: {h} query heads are not a multiple of {hkv} kv heads")
    rep = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # [B, Hkv, rep, S, D] x [B, Hkv, 1->rep, D, T]
    q5 = q.split_dim(1, (hkv, rep))
    k5 = k.unsqueeze(2).broadcast_to((b, hkv, rep, t, d))
    v5 = v.unsqueeze(2).broadcast_to((b, hkv, rep, t, v.shape[3]))
    scores = matmul(q5, k5.transpose(-1, -2)) * scale  # [B, Hkv, rep, S, T]
    if positions is not None and not (positions.ndim == 1 and dims_equal(positions.shape[0], s)):
        raise ShapeError(f"attention: positions must be [S] = [{s}] (one per query), got {shape_str(positions.shape)}")
    allowed = attention_mask(q.graph, s, t, causal, window, key_mask, positions=positions)
    if mask is not None and mask.dtype == DType.BOOL:
        if allowed is None:
            allowed = mask
        else:
            shape = (b, mask.shape[1], s, t)
            allowed = logical_and(allowed.broadcast_to(shape), mask.broadcast_to(shape))
        mask = None
    if allowed is not None:  # a boolean mask becomes a large negative additive bias
        bias = cast(logical_not(allowed), scores.dtype) * _neg(scores.dtype)
        scores = scores + _heads5(bias, b, h, hkv, rep, s, t)
    if mask is not None:  # an additive float bias
        bias = mask if mask.dtype == scores.dtype else cast(mask, scores.dtype)
        scores = scores + _heads5(bias, b, h, hkv, rep, s, t)
    probs = softmax(scores, -1)
    out = matmul(probs, v5)  # [B, Hkv, rep, S, Dv]
    return out.merge_dims(1, 2)


def _heads5(bias: Tensor, b, h, hkv, rep, s, t) -> Tensor:
    """Bring a [B|1, H|1, S, T] bias to the [B, Hkv, rep, S, T] layout of the grouped scores."""
    if bias.ndim != 4:
        raise ShapeError(f"attention: mask must be 4-D [B, H, S, T], got {shape_str(bias.shape)}")
    bias = bias.broadcast_to((b, bias.shape[1], s, t))
    if dims_equal(bias.shape[1], 1):
        return bias.unsqueeze(1).broadcast_to((b, hkv, rep, s, t))
    return bias.split_dim(1, (hkv, rep))


def timestep_embedding(
    t: Tensor,
    dim: int,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    scale: float = 1.0,
    max_period: float = 10000.0,
) -> Tensor:
    """Sinusoidal embedding ``[N, dim]`` of timesteps ``t [N]``, as diffusers' ``get_timestep_embedding``.

    The frequencies are computed host-side in f32 exactly as diffusers does (``exp(-ln(max_period) * i / (half -
    shift))``); the products and sines are graph ops.
    """
    from .elementwise import cos, sin

    half = dim // 2
    exponent = (-math.log(max_period) * np.arange(half, dtype=np.float32)) / np.float32(half - downscale_freq_shift)
    freqs = np.exp(exponent.astype(np.float64)).astype(np.float32)  # correctly rounded, as torch's exp (nearly) is
    n = t.shape[0]
    f = t.graph.constant(freqs, t.dtype).expand(0, n)  # [N, half]
    ang = t.expand(1, half) * f
    if scale != 1.0:
        ang = ang * scale
    parts = [cos(ang), sin(ang)] if flip_sin_to_cos else [sin(ang), cos(ang)]
    emb = concat(parts, -1)
    if dim % 2:
        emb = emb.pad(1, 0, 1)
    return emb


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, S, heads * D] -> [B, heads, S, D]`` (a view)."""
    b, s, hd = x.shape
    return x.split_dim(2, (heads, hd // heads)).transpose(1, 2)


def merge_heads(o: Tensor) -> Tensor:
    """``[B, H, S, D] -> [B, S, H * D]``."""
    b, h, s, d = o.shape
    return o.transpose(1, 2).reshape(b, s, h * d)
