"""Joining and splitting tensors. Concatenation is zero-padding each piece into place and adding (exact: padded
reads are 0), so it stays inside the primitive set."""

from __future__ import annotations

from ..errors import DTypeError, ShapeError
from ..graph import Tensor
from ..graph.symbolic import add, dims_equal, mul, shape_str


def concat(tensors: list[Tensor], axis: int = 0) -> Tensor:
    if not tensors:
        raise ShapeError("concat: needs at least one tensor")
    first = tensors[0]
    axis = first._axis(axis, "concat")
    for t in tensors[1:]:
        same_rank = t.ndim == first.ndim
        if not same_rank or not all(
            dims_equal(a, b) for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis
        ):
            raise ShapeError(
                f"concat: shapes {shape_str(first.shape)} and {shape_str(t.shape)} must agree except on axis {axis}"
            )
        if t.dtype != first.dtype:
            raise DTypeError(
                f"concat: dtypes {first.dtype} and {t.dtype} differ (shapes "
                f"{shape_str(first.shape)}, {shape_str(t.shape)}); cast them to one dtype first, "
                f"e.g. t.cast('{first.dtype}')"
            )
    if len(tensors) == 1:
        return first
    total = 0
    for t in tensors:
        total = add(total, t.shape[axis])
    out = None
    before = 0
    for t in tensors:
        after = add(total, mul(add(before, t.shape[axis]), -1))
        piece = t.pad(axis, before, after)
        out = piece if out is None else out + piece
        before = add(before, t.shape[axis])
    return out


def stack(tensors: list[Tensor], axis: int = 0) -> Tensor:
    if axis < 0:
        axis += tensors[0].ndim + 1
    return concat([t.unsqueeze(axis) for t in tensors], axis)


def split(x: Tensor, sizes, axis: int = 0) -> list[Tensor]:
    """Split ``axis`` into pieces of the given sizes (views)."""
    axis = x._axis(axis, "split")
    total = 0
    for s in sizes:
        total = add(total, s)
    if not dims_equal(total, x.shape[axis]):
        raise ShapeError(
            f"split: sizes {list(sizes)} add up to {total}, axis {axis} of {shape_str(x.shape)} has {x.shape[axis]}"
        )
    out, start = [], 0
    for s in sizes:
        out.append(x.slice(axis, start, add(start, s)))
        start = add(start, s)
    return out


def chunk(x: Tensor, n: int, axis: int = 0) -> list[Tensor]:
    """``n`` equal views along ``axis`` (the size must divide evenly, as FLUX/Llama use it)."""
    axis = x._axis(axis, "chunk")
    size = x.shape[axis]
    if isinstance(size, int) and size % n:
        raise ShapeError(f"chunk: axis {axis} of {shape_str(x.shape)} ({size}) does not divide into {n} chunks")
    return split(x, [size // n] * n, axis)
