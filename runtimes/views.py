"""View arithmetic on ``BoundView``s and reading one out of a flat host buffer without allocating: a strided
alias when the view allows it, otherwise a gather into a preallocated array. Backend-neutral: the executable
reads outputs with it, the memory planner tests identity views, the CUDA backend reshapes views; the CPU kernels'
operands (``cpu/kernels/operands.py``) are built on it.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from luminal_recipes.graph.view import BoundView, View


def in_bounds(bv: BoundView, size: int) -> bool:
    """Whether every index the view can produce lies inside a flat buffer of ``size`` elements."""
    if 0 in bv.shape:
        return True
    lo = bv.offset + sum((d - 1) * s for d, s in zip(bv.shape, bv.strides) if s < 0)
    hi = bv.offset + sum((d - 1) * s for d, s in zip(bv.shape, bv.strides) if s > 0)
    return lo >= 0 and hi < size


def is_unmasked(bv: BoundView) -> bool:
    return bv.mask is None or all(lo <= 0 and hi >= d for (lo, hi), d in zip(bv.mask, bv.shape))


def is_identity(bv: BoundView, shape: tuple[int, ...], size: int) -> bool:
    """The view reads a contiguous buffer of ``size`` elements exactly as laid out, at ``shape``."""
    if tuple(bv.shape) != tuple(shape) or math.prod(shape) != size or bv.offset != 0 or not is_unmasked(bv):
        return False
    expect = 1
    for d, s in zip(reversed(bv.shape), reversed(bv.strides)):
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


def alias(a: np.ndarray, shape, byte_strides, writeable: bool = False) -> np.ndarray:
    """``np.lib.stride_tricks.as_strided(a, shape, byte_strides, writeable=writeable)`` (a view from ``a``'s first
    element) made by ``np.ndarray`` over the contiguous array ``a`` views: as_strided leaves a holder object as
    the view's base (a ``DummyArray`` and its ``__array_interface__`` dict, list and tuples: ~6 objects the
    garbage collector tracks, per view), and a bound step keeps its views as long as its binding is kept (a decode
    loop re-binding every token made ~1800 of them a token: docs/torch.md, "garbage collector"). numpy arrays
    are not tracked. Falls back on as_strided where ``a`` views no contiguous array or the view leaves it."""
    root, base = None, a
    while isinstance(base, np.ndarray):  # the outermost contiguous array: a view may reach before ``a`` (reversed)
        if base.flags.c_contiguous:
            root = base
        base = base.base
    if root is not None:
        if root.dtype.isbuiltin != 1 or root.ndim != 1:  # (ml_dtypes' types export no buffer; bytes do)
            root = root.reshape(-1).view(np.uint8)
        start = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        try:
            out = np.ndarray(shape, a.dtype, buffer=root, offset=start, strides=byte_strides)
        except (ValueError, TypeError):
            out = None
        if out is not None:
            if not (writeable and a.flags.writeable) and out.flags.writeable:  # (as as_strided: ``a``'s own flag)
                out.flags.writeable = False
            return out
    return np.lib.stride_tricks.as_strided(a, shape, byte_strides, writeable=writeable)


def strided(flat: np.ndarray, bv: BoundView, writeable: bool = False) -> np.ndarray | None:
    """``flat`` seen through ``bv`` as a numpy view (no copy), or ``None`` when the view is masked or reads
    outside the buffer (then it must be gathered)."""
    if not is_unmasked(bv) or not in_bounds(bv, flat.size):
        return None
    if 0 in bv.shape:
        return np.zeros(bv.shape, flat.dtype)
    item = flat.itemsize
    base = flat[bv.offset :] if bv.offset else flat
    return alias(base, bv.shape, tuple(s * item for s in bv.strides), writeable)


def gather_into(dst: np.ndarray, flat: np.ndarray, bv: BoundView) -> None:
    """``dst[...] = bv.gather(flat)`` (zeros outside the mask), without allocating for ordinary padded
    views."""
    gatherer(dst, flat, bv)()


def gatherer(dst: np.ndarray, flat: np.ndarray, bv: BoundView) -> Callable[[], None]:
    """The step doing ``gather_into(dst, flat, bv)`` with the view's box, the strided source and the region of
    ``dst`` it fills worked out once (a scratch operand is refreshed so at every run): zeros written only where
    the mask leaves some."""
    box = []
    for axis, d in enumerate(bv.shape):
        lo, hi = (0, d) if bv.mask is None else bv.mask[axis]
        lo, hi = max(lo, 0), min(hi, d)
        if lo >= hi:
            return lambda: dst.fill(0)
        box.append((lo, hi))
    offset = bv.offset + sum(lo * s for (lo, _), s in zip(box, bv.strides))
    inner = BoundView(tuple(hi - lo for lo, hi in box), bv.strides, offset, None)
    src = strided(flat, inner)
    if src is None:  # reads past its buffer: the reference semantics (zeros there) via a full gather
        return lambda: np.copyto(dst, bv.gather(flat), casting="unsafe")
    region = dst[tuple(slice(lo, hi) for lo, hi in box)]
    if region.shape == dst.shape:  # no padding: every element is copied
        return lambda: np.copyto(region, src, casting="unsafe")

    def step() -> None:
        dst.fill(0)
        np.copyto(region, src, casting="unsafe")

    return step


def zero_padded(bv: BoundView, size: int, axes: tuple[int, ...]) -> tuple[BoundView, tuple[int, ...]] | None:
    """A view that is in-bounds strided data zero-padded on ``axes`` only, as (the data's view, the data's first
    index on each of ``axes``); ``None`` for any other view (masked elsewhere, reading outside the buffer). An
    unmasked in-bounds view is its own data, at 0."""
    box = []
    for axis, d in enumerate(bv.shape):
        lo, hi = (0, d) if bv.mask is None else bv.mask[axis]
        lo, hi = max(lo, 0), min(hi, d)
        if axis not in axes and (lo, hi) != (0, d) or lo >= hi:
            return None
        box.append((lo, hi))
    offset = bv.offset + sum(lo * s for (lo, _), s in zip(box, bv.strides))
    data = BoundView(tuple(hi - lo for lo, hi in box), bv.strides, offset, None)
    return (data, tuple(box[axis][0] for axis in axes)) if in_bounds(data, size) else None


def reshape_view(bv: BoundView, shape: tuple[int, ...]) -> BoundView | None:
    """The same elements at another shape, if strides can express it (no copy)."""
    if tuple(bv.shape) == tuple(shape):
        return bv
    mask = None if is_unmasked(bv) else bv.mask
    view = View(tuple(bv.shape), tuple(bv.strides), bv.offset, mask).reshape(tuple(shape))
    return None if view is None else view.bind({})


def normalize_unit_axes(bv: BoundView) -> BoundView:
    """Give size-1 axes the stride a row-major array would have (their stride never matters), so layout tests
    such as "BLAS-compatible" do not fail on them."""
    strides = list(bv.strides)
    for axis in range(len(bv.shape) - 1, -1, -1):
        if bv.shape[axis] == 1:
            strides[axis] = strides[axis + 1] * bv.shape[axis + 1] if axis + 1 < len(bv.shape) else 1
    return BoundView(bv.shape, tuple(strides), bv.offset, bv.mask)


def blas_compatible(bv: BoundView) -> bool:
    """The last two axes form a matrix BLAS can read in place: row-major or column-major with a leading stride
    at least the matrix width (numpy's own test before it calls gemm)."""
    if len(bv.shape) < 2:
        return False
    r, c = bv.shape[-2:]
    sr, sc = normalize_unit_axes(bv).strides[-2:]
    return (sc == 1 and sr >= max(c, 1)) or (sr == 1 and sc >= max(r, 1))
