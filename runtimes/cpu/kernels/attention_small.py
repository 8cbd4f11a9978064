"""Attention over heads of 16 dims, without BLAS: ``jit/attention_small.py``'s compiled kernel, a (head, block of
query rows) per call, the blocks taken by the cores in turn.

``Attention`` and ``AttentionBlocked`` (``kernels/attention.py``) come here where their BLAS products would be
inefficient and the compiled kernel applies: numba in use, q, k and v f32 with 16 dims per head, no bias, several
query rows (decoding's single row keeps the stacked-rows kernel), every input over the output's heads (no
broadcast batch axis), and not on AMX (``attention._fused``: both products on the tiles). Neither kernel ever
holds a ``(S, T)`` block: scratch is the head's transposed keys, its values as rows and four rows of scores per core.
"""

from __future__ import annotations

import math

import numpy as np

from ...kernels.context import Bind, KernelContext
from .. import jit
from .. import threads as cpu_threads
from .common import F32, bind_all, with_refresh
from .operands import operand

HEAD_DIM = 16  # jit/attention_small.py's kernel is written out for these head dims (q, k and v alike)
MIN_QUERY_ROWS = 4  # fewer query rows: decoding, whose kernel stacks heads (attention._shared_kv_rows)


def _kernels():
    """``jit/attention_small.py``, imported once numba has started (``jit.kernels``: its start-up's checks)."""
    jit.kernels()
    from ..jit import attention_small

    return attention_small


def applies(ctx: KernelContext, s: int, d: int, dv: int) -> bool:
    """Whether ``prepare(ctx)`` runs this attention node (``s`` query rows, head dims ``d``, ``dv``)."""
    batch = tuple(ctx.shape[:-2])
    return (jit.AVAILABLE and len(ctx.inputs) == 3 and d == dv == HEAD_DIM and s >= MIN_QUERY_ROWS
            and ctx.dtype == F32 and all(ctx.inputs[i].dtype == F32 for i in range(3))
            and all(tuple(ctx.inputs[i].view.shape[:-2]) == batch for i in range(3)))


def prepare(ctx: KernelContext, rows: int) -> Bind:
    """The kernel over query blocks of at most ``rows`` rows (``attention._Plan``'s blocks: a dozen tasks or
    more where heads are few, so that each core gets several)."""
    batch, (s, dv) = tuple(ctx.shape[:-2]), ctx.shape[-2:]
    t = ctx.inputs[1].view.shape[-2]
    heads = math.prod(batch)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    ops = [operand(ctx, i, dtype=F32, shape=(heads, n, HEAD_DIM)) for i, n in enumerate((s, t, t))]
    blocks = max(1, -(-s // max(1, rows)))
    bounds = [s * i // blocks for i in range(blocks + 1)]
    tasks = [(h, bounds[b], bounds[b + 1]) for h in range(heads) for b in range(blocks) if bounds[b + 1] > bounds[b]]
    slots = max(1, min(cpu_threads.THREADS, len(tasks)))
    per_slot = [[ctx.scratch.add(shape, F32) for shape in ((HEAD_DIM, t), (t, HEAD_DIM), (4, t), (4, HEAD_DIM))]
                for _ in range(slots)]

    def bind(out, flats, scratch):
        q, k, v = bind_all(ops, flats, scratch)
        o = out.reshape((heads, s, dv))
        kernel = _kernels().attention16
        buffers = [[scratch[i] for i in part] for part in per_slot]
        held = [-1] * slots  # the head whose keys and values a part's scratch holds transposed

        def task(slot, j):
            head, first, end = tasks[j]
            kernel(q, k, v, o, head, first, end, held[slot] != head, scale, *buffers[slot])
            held[slot] = head

        step = cpu_threads.claimed(len(tasks), slots, task)

        def body():
            if t == 0:
                out.fill(0)
                return
            held[:] = [-1] * slots  # new operands every run
            step()

        return with_refresh(ops, body)

    return bind
