"""Reductions over one or more axes, with ``keepdim`` as in torch."""

from __future__ import annotations

from ..graph import Tensor, reduce
from ..graph.symbolic import prod


def _axes(x: Tensor, axis) -> list[int]:
    if axis is None:
        return list(range(x.ndim))
    axes = [axis] if isinstance(axis, int) else list(axis)
    return sorted({x._axis(a, "reduce") for a in axes})


def _reduce(op: str, x: Tensor, axis, keepdim: bool) -> Tensor:
    axes = _axes(x, axis)
    out = x
    for a in reversed(axes):
        out = reduce(op, out, a)
    if keepdim:
        for a in axes:
            out = out.unsqueeze(a)
    return out


def sum(x: Tensor, axis=None, keepdim: bool = False) -> Tensor:  # noqa: A001
    return _reduce("SumReduce", x, axis, keepdim)


def max(x: Tensor, axis=None, keepdim: bool = False) -> Tensor:  # noqa: A001
    return _reduce("MaxReduce", x, axis, keepdim)


def min(x: Tensor, axis=None, keepdim: bool = False) -> Tensor:  # noqa: A001
    return -_reduce("MaxReduce", -x, axis, keepdim)


def mean(x: Tensor, axis=None, keepdim: bool = False) -> Tensor:
    n = prod(x.shape[a] for a in _axes(x, axis))
    total = sum(x, axis, keepdim)
    if isinstance(n, int):
        return total * (1.0 / n)
    count = x.graph.constant(1.0, x.dtype).broadcast_to(x.shape)
    return total / sum(count, axis, keepdim)


def var(x: Tensor, axis=None, keepdim: bool = False, correction: int = 0) -> Tensor:
    """Variance; ``correction=1`` is the unbiased estimator (torch's default), 0 the population variance."""
    mu = mean(x, axis, keepdim=True).broadcast_to(x.shape)
    d = x - mu
    n = prod(x.shape[a] for a in _axes(x, axis))
    if isinstance(n, int):
        return sum(d * d, axis, keepdim) * (1.0 / (n - correction))
    count = sum(x.graph.constant(1.0, x.dtype).broadcast_to(x.shape), axis, keepdim)
    return sum(d * d, axis, keepdim) / (count - float(correction))
