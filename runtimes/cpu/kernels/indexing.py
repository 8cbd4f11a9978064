"""``Gather`` (rows of a table by index) and ``Scatter`` / ``ScatterInPlace``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luminal_recipes.errors import InputError

from ...kernels.context import Bind, KernelContext
from ...views import strided
from .. import jit
from .common import bind_all, view_reshape, with_refresh
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

        call = _gather_call(out, idx, table, rows)
        if call is not None:  # the same rows as one compiled call, for the chains (RoPE's and a mask's lookups
            from ..jit import chain  # would otherwise cut a decoding step's chain at every layer)

            body = chain.tag(body, [call])
        return with_refresh([table_op, idx_op], body)

    return bind


def _gather_call(out: np.ndarray, idx: np.ndarray, table: np.ndarray, rows: int):
    """``chain.gather_rows`` over 2-D views of ``out`` and ``table`` and a 1-D view of ``idx`` (None where one
    is not a view, the dtypes differ or numba is missing: the step then runs from Python)."""
    if not jit.AVAILABLE or idx.dtype.kind != "i" or table.dtype != out.dtype or rows == 0 or idx.size == 0:
        return None
    width = out.size // idx.size
    flat_idx = view_reshape(idx, (idx.size,))
    out2, table2 = view_reshape(out, (idx.size, width)), view_reshape(table, (rows, width))
    if flat_idx is None or out2 is None or table2 is None:
        return None
    from ..jit import chain

    return chain.Call(chain.gather_rows, (out2, flat_idx, table2, rows), checked=True,
                      access=((flat_idx, table2), (out2,)))


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
        if idx.ndim == 1 and idx.size <= FEW_ROWS:
            return _few_rows(out, idx, src, flats[2], ops, rows, node, None if in_place else dest)

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
              node, dest: np.ndarray | None = None) -> Callable[[], None]:
    """A scatter of a few rows: each index read as a Python int and its row copied on its own (a decoding step
    writes one row of keys and one of values per layer: a few microseconds, where the vectorised path's index
    checks, conversion and fancy assignment cost ~20). The rows are read straight from the producer's view where
    strides express it (no refresh into scratch). ``dest``: the destination when it is not written in place
    (``out`` is then ``dest`` with the rows replaced: a static KV cache updated by ``index_copy`` in a graph
    torch hands over, which returns the new cache), copied into ``out`` first; both as compiled calls in the
    chains, so the update does not cut a decoding step's chain in two."""
    view = strided(src_flat, ops[2].source)
    refresh = ops[:2]
    if view is not None and view.shape == src.shape:
        src = view
    else:
        refresh = ops
    count = idx.size

    def body():
        if dest is not None:
            np.copyto(out, dest, casting="unsafe")
        for j in range(count):
            i = int(idx[j])
            if i < 0 or i >= rows:
                raise InputError(f"{node.op} #{node.id}: row index out of range [0, {rows}) in {i}..{i}")
            out[i] = src[j]

    copies = dest is None or (dest.dtype == out.dtype and dest.shape == out.shape)
    if jit.AVAILABLE and idx.dtype.kind == "i" and src.dtype == out.dtype and src.shape[1:] == out.shape[1:] and copies:
        from ..jit import chain  # the same copies as compiled calls, for the chains

        phases = [] if dest is None else [[chain.Call(chain.copy_region, (out, out, dest, False),
                                                      access=((dest,), (out,)))]]
        phases.append([chain.Call(chain.scatter_rows, (out, idx, src, rows), checked=True,
                                  access=((idx, src), (out,)))])
        body = chain.tag(body, *phases)
    return with_refresh(refresh, body)
