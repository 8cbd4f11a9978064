"""``Gather`` (rows of a table by index) and ``Scatter`` / ``ScatterInPlace``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luminal_recipes.errors import InputError

from ...kernels.context import Bind, KernelContext
from ...views import strided
from .. import jit
from .common import bind_all, with_refresh
from .operands import operand

FEW_ROWS = 8  # a scatter of at most this many rows (a decoded token's keys into the KV cache) copies row by row


def prepare_gather(ctx: KernelContext) -> Bind:
    table_op, idx_op = operand(ctx, 0), operand(ctx, 1)
    rows = ctx.inputs[0].view.shape[0]
    idx_shape = ctx.inputs[1].view.shape
    index = ctx.scratch.add(idx_shape, np.intp)  # np.take wants intp indices: convert in planned memory
    node_id = ctx.node.id

    def bind(out, flats, scratch):
        table, idx = bind_all([table_op, idx_op], flats, scratch)
        pos = scratch[index]

        def body():
            if idx.size == 0:
                return
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= rows:
                raise InputError(f"Gather #{node_id}: index out of range [0, {rows}) in {lo}..{hi}; check "
                                 f"token ids against the vocabulary size")
            np.copyto(pos, idx, casting="unsafe")
            np.take(table, pos, axis=0, out=out, mode="clip")

        return with_refresh([table_op, idx_op], body)

    return bind


def prepare_scatter(ctx: KernelContext) -> Bind:
    ops = [operand(ctx, 0), operand(ctx, 1), operand(ctx, 2)]
    rows = ctx.inputs[0].view.shape[0] if ctx.inputs[0].view.shape else 0
    index = ctx.scratch.add(ctx.inputs[1].view.shape, np.intp)
    node = ctx.node

    def bind(out, flats, scratch):
        dest, idx, src = bind_all(ops, flats, scratch)
        pos = scratch[index]
        # ScatterInPlace whose destination the planner aliased onto the output: rows are written in place
        in_place = node.op == "ScatterInPlace" and np.may_share_memory(out, dest)
        if in_place and idx.ndim == 1 and idx.size <= FEW_ROWS:
            return _few_rows(out, idx, src, flats[2], ops, rows, node)

        def body():
            if not in_place:
                np.copyto(out, dest, casting="unsafe")
            if idx.size == 0:
                return
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= rows:
                raise InputError(f"{node.op} #{node.id}: row index out of range [0, {rows}) in {lo}..{hi}")
            np.copyto(pos, idx, casting="unsafe")
            out[pos] = src

        return with_refresh(ops, body)

    return bind



def _few_rows(out: np.ndarray, idx: np.ndarray, src: np.ndarray, src_flat: np.ndarray, ops: list, rows: int,
              node) -> Callable[[], None]:
    """A scatter of a few rows in place: each index read as a Python int and its row copied on its own (a
    decoding step writes one row of keys and one of values per layer: a few microseconds, where the vectorised
    path's index checks, conversion and fancy assignment cost ~20). The rows are read straight from the
    producer's view where strides express it (no refresh into scratch)."""
    view = strided(src_flat, ops[2].source)
    refresh = ops[:2]
    if view is not None and view.shape == src.shape:
        src = view
    else:
        refresh = ops
    count = idx.size

    def body():
        for j in range(count):
            i = int(idx[j])
            if i < 0 or i >= rows:
                raise InputError(f"{node.op} #{node.id}: row index out of range [0, {rows}) in {i}..{i}")
            out[i] = src[j]

    if jit.AVAILABLE and idx.dtype.kind == "i" and src.dtype == out.dtype and src.shape[1:] == out.shape[1:]:
        from ..jit import chain  # the same copies as one compiled call, for the chains

        body = chain.tag(body, [chain.Call(chain.scatter_rows, (out, idx, src, rows), checked=True,
                                           access=((idx, src), (out,)))])
    return with_refresh(refresh, body)
