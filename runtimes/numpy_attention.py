"""numpy attention kernels: softmax(q k^T * scale + bias) v one (batch, head) at a time.

``Attention`` computes the scores of a block of query rows against all keys (a ``(rows, T)`` scratch; never
``(S, T, D)``). ``AttentionBlocked`` walks the keys in blocks with an online softmax (running max and sum,
rescaled accumulator), so neither ``(S, T)`` nor ``(S, T, D)`` ever exists. Both use BLAS for the two products
and compute in f32. Running maxima start at the most negative finite f32 rather than -inf, so a block of fully
masked keys never produces ``-inf - -inf``.
"""

from __future__ import annotations

import math

import numpy as np

from .numpy_kernels import F32, F32_MIN, Bind, KernelContext, bind_all, with_refresh

ATTENTION_TILE = 1 << 20  # score elements per query block of the unblocked kernel (4 MiB in f32)


def _check(ctx: KernelContext) -> tuple[tuple[int, ...], int, int, int, int]:
    if len(ctx.inputs) not in (3, 4) or len(ctx.shape) < 2:
        ctx.fail("expects inputs (q [..., S, D], k [..., T, D], v [..., T, Dv][, bias [..., S, T]])")
    q, k, v = (ctx.inputs[i].view.shape for i in range(3))
    s, d = q[-2:]
    t, dv = v[-2:]
    if k[-2:] != (t, d) or ctx.shape[-2:] != (s, dv):
        ctx.fail(f"q {q}, k {k}, v {v} do not give out {ctx.shape}")
    if len(ctx.inputs) == 4 and ctx.inputs[3].view.shape[-2:] != (s, t):
        ctx.fail(f"bias {ctx.inputs[3].view.shape} is not [..., {s}, {t}]")
    return ctx.shape[:-2], s, t, d, dv


def _operands(ctx: KernelContext) -> list:
    ops = [ctx.operand(i, dtype=F32, blas=True) for i in range(3)]
    ops.append(ctx.operand(3) if len(ctx.inputs) == 4 else None)
    return ops


def _per_batch(arrays: list, batch: tuple[int, ...]) -> list:
    """Broadcast each operand to the output's batch shape (views), then list (q, k, v, bias) per batch
    entry."""
    full = [None if a is None else np.broadcast_to(a, batch + a.shape[-2:]) for a in arrays]
    return [tuple(None if a is None else a[idx] for a in full) for idx in np.ndindex(*batch)]


def prepare_attention(ctx: KernelContext) -> Bind:
    batch, s, t, _, dv = _check(ctx)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    ops = _operands(ctx)
    rows = max(1, min(s, ATTENTION_TILE // max(t, 1)))
    scores = ctx.scratch.add((rows, t), F32)
    vec = ctx.scratch.add((rows,), F32)
    acc = None if ctx.dtype == F32 else ctx.scratch.add((rows, dv), F32)

    def bind(out, flats, scratch):
        q, k, v, bias = bind_all(ops, flats, scratch)
        per_batch = _per_batch([q, k, v, bias], batch)
        outs = out.reshape((math.prod(batch), s, dv))
        blocks = []
        for b, (qb, kb, vb, biasb) in enumerate(per_batch):
            for r0 in range(0, s, rows):
                r = min(rows, s - r0)
                sl = slice(r0, r0 + r)
                dst = outs[b, sl]
                o = dst if acc is None else scratch[acc][:r]
                blocks.append((qb[sl], kb.T, vb, None if biasb is None else biasb[sl], scratch[scores][:r],
                               scratch[vec][:r], scratch[vec][:r, None], o, dst))

        def body():
            if t == 0:
                out.fill(0)
                return
            for qs, kt, vb, bs, sc, m, col, o, dst in blocks:
                np.matmul(qs, kt, out=sc)
                np.multiply(sc, scale, out=sc)
                if bs is not None:
                    np.add(sc, bs, out=sc, dtype=F32)
                np.max(sc, axis=1, out=m)
                np.subtract(sc, col, out=sc)
                np.exp(sc, out=sc)
                np.sum(sc, axis=1, out=m)
                np.matmul(sc, vb, out=o)
                np.divide(o, col, out=o)
                if o is not dst:
                    np.copyto(dst, o, casting="unsafe")

        return with_refresh(ops, body)

    return bind


def prepare_attention_blocked(ctx: KernelContext) -> Bind:
    batch, s, t, _, dv = _check(ctx)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    block = int(ctx.node.attr("block", 128))
    if block < 1:
        ctx.fail(f"block must be >= 1, got {block}")
    block = min(block, max(t, 1))
    ops = _operands(ctx)
    scores = ctx.scratch.add((s, block), F32)
    vecs = [ctx.scratch.add((s,), F32) for _ in range(4)]  # running max, new max, running sum, block sum
    pv = ctx.scratch.add((s, dv), F32)
    acc = None if ctx.dtype == F32 else ctx.scratch.add((s, dv), F32)

    def bind(out, flats, scratch):
        q, k, v, bias = bind_all(ops, flats, scratch)
        per_batch = _per_batch([q, k, v, bias], batch)
        outs = out.reshape((math.prod(batch), s, dv))
        m, m_new, total, part = (scratch[i] for i in vecs)
        m_new_col, total_col, part_col = m_new[:, None], total[:, None], part[:, None]
        heads = []
        for b, (qb, kb, vb, biasb) in enumerate(per_batch):
            keys = []
            for t0 in range(0, t, block):
                bt = min(block, t - t0)
                ks = slice(t0, t0 + bt)
                bias_block = None if biasb is None else biasb[:, ks]
                keys.append((kb[ks].T, vb[ks], bias_block, scratch[scores][:, :bt]))
            dst = outs[b]
            heads.append((qb, keys, dst if acc is None else scratch[acc], dst))
        pvb = scratch[pv]

        def body():
            for qb, keys, a, dst in heads:
                m.fill(F32_MIN)
                total.fill(0)
                a.fill(0)
                for kt, vs, bs, sc in keys:
                    np.matmul(qb, kt, out=sc)
                    np.multiply(sc, scale, out=sc)
                    if bs is not None:
                        np.add(sc, bs, out=sc, dtype=F32)
                    np.max(sc, axis=1, out=m_new)
                    np.maximum(m_new, m, out=m_new)
                    np.subtract(m, m_new, out=part)  # rescale factor for what was accumulated so far
                    np.exp(part, out=part)
                    np.multiply(total, part, out=total)
                    np.multiply(a, part_col, out=a)
                    np.subtract(sc, m_new_col, out=sc)
                    np.exp(sc, out=sc)
                    np.sum(sc, axis=1, out=part)
                    np.add(total, part, out=total)
                    np.matmul(sc, vs, out=pvb)
                    np.add(a, pvb, out=a)
                    np.copyto(m, m_new)
                np.divide(a, total_col, out=a)
                if a is not dst:
                    np.copyto(dst, a, casting="unsafe")

        return with_refresh(ops, body)

    return bind
