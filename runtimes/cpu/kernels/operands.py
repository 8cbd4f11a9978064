"""How a CPU kernel reads one input edge (``Operand``): the producer's memory in place where its view allows,
otherwise a scratch copy refreshed at the start of every step (registered with ``Scratch``, so the memory planner
accounts for it). The view arithmetic is ``runtimes/views.py``'s, shared with the executable and the planner."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luminal_recipes.graph.view import BoundView

from ...kernels.context import KernelContext, Scratch
from ...views import blas_compatible, gatherer, in_bounds, is_unmasked, normalize_unit_axes, reshape_view, strided
from .. import jit


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
        if jit.AVAILABLE:  # the same copy as a compiled call, for the chains (``jit/chain.py``)
            from ..jit import chain

            call = chain.region_copy(shaped, flat, self.source)
            if call is not None:
                self.refresh = chain.tag(self.refresh, [call])
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
