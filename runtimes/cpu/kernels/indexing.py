"""``Gather`` (rows of a table by index) and ``Scatter`` / ``ScatterInPlace``."""

from __future__ import annotations

import numpy as np

from luminal_recipes.errors import InputError

from ...kernels.context import Bind, KernelContext
from .common import bind_all, with_refresh
from .operands import operand


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

