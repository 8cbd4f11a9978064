"""Softmax and normalisation layers, in the forms torch and diffusers compute them."""

from __future__ import annotations

from ..errors import ShapeError
from ..graph import Tensor
from ..graph.symbolic import shape_str
from . import reduce as R
from .elementwise import exp, rsqrt


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Numerically stable softmax: subtract the row max before exponentiating."""
    axis = x._axis(axis, "softmax")
    shifted = x - R.max(x, axis, keepdim=True).broadcast_to(x.shape)
    e = exp(shifted)
    return e / R.sum(e, axis, keepdim=True).broadcast_to(x.shape)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    from .elementwise import log

    axis = x._axis(axis, "log_softmax")
    shifted = x - R.max(x, axis, keepdim=True).broadcast_to(x.shape)
    return shifted - log(R.sum(exp(shifted), axis, keepdim=True)).broadcast_to(x.shape)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, axes: int) -> Tensor:
    feature = y.shape[-axes:]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(map(str, p.shape)) != tuple(map(str, feature)):
            raise ShapeError(f"norm: {name} has shape {shape_str(p.shape)}, expected {shape_str(feature)}")
    if weight is not None:
        y = y * (weight if weight.dtype == y.dtype else weight.cast(y.dtype)).broadcast_to(y.shape)
    if bias is not None:
        y = y + (bias if bias.dtype == y.dtype else bias.cast(y.dtype)).broadcast_to(y.shape)
    return y


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (Llama/Mistral/FLUX.2 RMSNorm)."""
    ms = R.mean(x * x, -1, keepdim=True)
    y = x * rsqrt(ms + eps).broadcast_to(x.shape)
    return _affine(y, weight, None, 1)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
               axes: int = 1) -> Tensor:
    """LayerNorm over the last ``axes`` axes, with or without the affine transform."""
    red = list(range(x.ndim - axes, x.ndim))
    mu = R.mean(x, red, keepdim=True).broadcast_to(x.shape)
    d = x - mu
    v = R.mean(d * d, red, keepdim=True)
    y = d * rsqrt(v + eps).broadcast_to(x.shape)
    return _affine(y, weight, bias, axes)


def group_norm(x: Tensor, groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """GroupNorm over ``x [N, C, *spatial]``: statistics per (sample, group of C/groups channels)."""
    if x.ndim < 2:
        raise ShapeError(f"group_norm: expects [N, C, ...], got {shape_str(x.shape)}")
    n, c = x.shape[0], x.shape[1]
    if isinstance(c, int) and c % groups:
        raise ShapeError(f"group_norm: {c} channels do not divide into {groups} groups")
    spatial = x.shape[2:]
    g = x.reshape((n, groups, -1) if all(isinstance(d, int) for d in x.shape) else
                  (n, groups, (c // groups) * _prod(spatial)))
    mu = R.mean(g, -1, keepdim=True).broadcast_to(g.shape)
    d = g - mu
    v = R.mean(d * d, -1, keepdim=True)
    y = (d * rsqrt(v + eps).broadcast_to(g.shape)).reshape(x.shape)
    per_channel = (1, c) + (1,) * len(spatial)
    if weight is not None:
        y = y * _cast(weight, y).reshape(per_channel).broadcast_to(x.shape)
    if bias is not None:
        y = y + _cast(bias, y).reshape(per_channel).broadcast_to(x.shape)
    return y


def _cast(p: Tensor, like: Tensor) -> Tensor:
    return p if p.dtype == like.dtype else p.cast(like.dtype)


def _prod(dims):
    from ..graph.symbolic import prod

    return prod(dims)
