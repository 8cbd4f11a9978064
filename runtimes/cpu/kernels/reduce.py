"""``SumReduce`` and ``MaxReduce`` over one axis."""

from __future__ import annotations

import numpy as np

from ...kernels.context import Bind, KernelContext
from .common import F32, bind_all, is_float, with_refresh
from .operands import operand


def prepare_reduce(ctx: KernelContext) -> Bind:
    op = operand(ctx, 0)
    axis = ctx.node.attr("axis")
    is_sum = ctx.node.op == "SumReduce"
    # sub-16-bit floats accumulate in f32 (the reference's compute dtype), then round once
    acc = ctx.scratch.add(ctx.shape, F32) if is_float(ctx.dtype) and ctx.dtype.itemsize < 2 else None
    empty = ctx.inputs[0].view.shape[axis] == 0

    def bind(out, flats, scratch):
        (x,) = bind_all([op], flats, scratch)
        target = out if acc is None else scratch[acc]
        if is_sum:
            def body():
                np.sum(x, axis=axis, out=target, dtype=target.dtype)
        elif empty:
            low = -np.inf if is_float(target.dtype) else np.iinfo(target.dtype).min

            def body():
                target.fill(low)
        else:
            def body():
                np.max(x, axis=axis, out=target)
        if acc is None:
            return with_refresh([op], body)

        def rounded():
            body()
            np.copyto(out, target, casting="unsafe")

        return with_refresh([op], rounded)

    return bind


