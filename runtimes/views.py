"""Reading a ``BoundView`` out of a flat numpy buffer without allocating: a strided alias when the view allows
it, otherwise a copy into a preallocated scratch array.

A kernel states how it wants each operand (``Operand``): any layout, a compute dtype, a BLAS-compatible last
two axes, or a reshape (e.g. to ``(rows, N)``). When the view satisfies that, the kernel reads the producer's
memory directly (zero-copy); otherwise the operand gets a scratch array, registered with ``Scratch`` so the
memory planner accounts for it, and is refreshed at the start of every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from luminal_recipes.graph.view import BoundView, View

from .kernels.context import KernelContext, Scratch


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


def strided(flat: np.ndarray, bv: BoundView, writeable: bool = False) -> np.ndarray | None:
    """``flat`` seen through ``bv`` as a numpy view (no copy), or ``None`` when the view is masked or reads
    outside the buffer (then it must be gathered)."""
    if not is_unmasked(bv) or not in_bounds(bv, flat.size):
        return None
    if 0 in bv.shape:
        return np.zeros(bv.shape, flat.dtype)
    item = flat.itemsize
    base = flat[bv.offset :] if bv.offset else flat
    byte_strides = tuple(s * item for s in bv.strides)
    # as_strided cannot describe ml_dtypes' types (bf16, fp8...): stride an integer twin and view it back
    twin = base if flat.dtype.isbuiltin == 1 else base.view(f"u{item}")
    out = np.lib.stride_tricks.as_strided(twin, bv.shape, byte_strides, writeable=writeable)
    return out if out.dtype == flat.dtype else out.view(flat.dtype)


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


class Operand:
    """How a kernel reads one input edge.

    ``dtype``: the dtype the kernel computes in (``None`` = the buffer's own); ``shape``: read at another
    shape (a reshape strides must express, else the operand is copied); ``blas``: the last two axes must be
    BLAS-compatible. After ``bind``, ``array`` is what the kernel reads and ``refresh`` (or ``None``) fills a
    scratch copy.
    """

    def __init__(self, bv: BoundView, buffer_dtype: np.dtype, buffer_size: int, scratch: Scratch, *,
                 dtype=None, shape=None, blas: bool = False):
        self.source = bv
        self.buffer_dtype = np.dtype(buffer_dtype)
        self.dtype = self.buffer_dtype if dtype is None else np.dtype(dtype)
        self.shape = tuple(bv.shape) if shape is None else tuple(int(d) for d in shape)
        view = reshape_view(bv, self.shape)
        if view is not None:
            view = normalize_unit_axes(view)
        self.view = view
        self.direct = (
            view is not None
            and is_unmasked(view)
            and in_bounds(view, buffer_size)
            and self.dtype == self.buffer_dtype
            and (not blas or blas_compatible(view))
        )
        self.slot = None if self.direct else scratch.add(self.shape, self.dtype)
        self.array: np.ndarray | None = None
        self.refresh: Callable[[], None] | None = None

    def bind(self, flat: np.ndarray, scratch: list[np.ndarray]) -> np.ndarray:
        if self.direct:
            self.array = strided(flat, self.view)
            return self.array
        dst = scratch[self.slot]
        src = strided(flat, self.source)
        if src is not None:
            shaped = dst.reshape(self.source.shape)
            self.refresh = lambda: np.copyto(shaped, src, casting="unsafe")
        else:
            shaped = dst.reshape(self.source.shape)
            self.refresh = gatherer(shaped, flat, self.source)
        self.array = dst
        return dst


def row_tiles(rows: int, row_elems: int, budget: int) -> list[slice]:
    """Split ``rows`` rows of ``row_elems`` elements into slices of at most ``budget`` elements (>= 1 row)."""
    step = max(1, budget // max(row_elems, 1))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)] or [slice(0, 0)]


def operand(ctx: KernelContext, i: int, **kw) -> Operand:
    """How a numpy kernel reads input ``i`` of its node (``Operand``'s keywords: dtype, shape, blas)."""
    k = ctx.inputs[i]
    return Operand(k.view, k.dtype, k.size, ctx.scratch, **kw)
