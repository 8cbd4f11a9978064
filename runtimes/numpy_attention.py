"""numpy attention kernels: softmax(q k^T * scale + bias) v one (batch, head) at a time.

``Attention`` computes the scores of a block of query rows against all keys (a ``(rows, T)`` scratch; never
``(S, T, D)``). ``AttentionBlocked`` walks the keys in blocks with an online softmax (running max, rescaled
accumulator), so neither ``(S, T)`` nor ``(S, T, D)`` ever exists. Both use BLAS for the two products and
compute in f32. Running maxima start at the most negative finite f32 rather than -inf, so a block of fully
masked keys never produces ``-inf - -inf``.

Besides the two products, passes over the scores are what costs, so each head's ``q`` is scaled once
(``(q * scale) k^T`` instead of scaling every score block) and ``v`` gets a column of ones: ``p @ [v | 1]``
yields the softmax denominators with the numerators in the same BLAS call, and one rescale of the ``[acc | sum]``
accumulator updates both. Per score block that leaves max, subtract and exp besides the products: one compiled
pass per row on every core (``numpy_jit``, numba), or three single-threaded numpy passes where numba is missing.
"""

from __future__ import annotations

import math

import numpy as np

from . import jit
from .kernels.context import Bind, KernelContext
from .numpy_kernels import F32, F32_MIN, bind_all, with_refresh
from .views import operand

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
    ops = [operand(ctx, i, dtype=F32, blas=True) for i in range(3)]
    ops.append(operand(ctx, 3) if len(ctx.inputs) == 4 else None)
    return ops


def _per_batch(arrays: list, batch: tuple[int, ...]) -> list:
    """Broadcast each operand to the output's batch shape (views), then list (q, k, v, bias) per batch
    entry."""
    full = [None if a is None else np.broadcast_to(a, batch + a.shape[-2:]) for a in arrays]
    return [tuple(None if a is None else a[idx] for a in full) for idx in np.ndindex(*batch)]


def _padded(n: int) -> int:
    """A row length of at least ``n`` f32 that keeps rows on 64-byte lines (BLAS reads them faster)."""
    return -(-n // 16) * 16


class _HeadScratch:
    """Per-head work arrays shared by both kernels: ``q * scale`` and ``[v | 1]`` (its last column is the ones
    that make the second product return the softmax denominators), planned as kernel scratch."""

    def __init__(self, ctx: KernelContext, s: int, t: int, d: int, dv: int):
        self.dv = dv
        self.q = ctx.scratch.add((s, d), F32)
        self.v = ctx.scratch.add((t, _padded(dv + 1)), F32)

    def arrays(self, scratch: list) -> tuple[np.ndarray, np.ndarray]:
        return scratch[self.q], scratch[self.v][:, : self.dv + 1]


def _finish(acc: np.ndarray, dst: np.ndarray, dv: int) -> None:
    """``dst = acc[:, :dv] / acc[:, dv]`` (numerators over denominators), in f32, then stored."""
    if dst.dtype == F32:
        np.divide(acc[:, :dv], acc[:, dv:], out=dst)
    else:
        np.divide(acc[:, :dv], acc[:, dv:], out=acc[:, :dv])
        np.copyto(dst, acc[:, :dv], casting="unsafe")


def prepare_attention(ctx: KernelContext) -> Bind:
    batch, s, t, d, dv = _check(ctx)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    ops = _operands(ctx)
    rows = max(1, min(s, ATTENTION_TILE // max(t, 1)))
    head = _HeadScratch(ctx, s, t, d, dv)
    scores = ctx.scratch.add((rows, t), F32)
    vec = ctx.scratch.add((rows,), F32)
    acc = ctx.scratch.add((rows, _padded(dv + 1)), F32)

    def bind(out, flats, scratch):
        q, k, v, bias = bind_all(ops, flats, scratch)
        qs, vx = head.arrays(scratch)
        outs = out.reshape((math.prod(batch), s, dv))
        compiled = jit.AVAILABLE
        heads = []
        for b, (qb, kb, vb, biasb) in enumerate(_per_batch([q, k, v, bias], batch)):
            blocks = []
            for r0 in range(0, s, rows):
                r = min(rows, s - r0)
                sl = slice(r0, r0 + r)
                sc, col = scratch[scores][:r], scratch[vec][:r, None]
                # compiled: max, exp and the row sums in one pass per row, on every core; p @ v reads v in place
                softmax = jit.by_rows(jit.kernels().exp_rows_sum, [sc, col[:, 0]]) if compiled else None
                blocks.append((qs[sl], None if biasb is None else biasb[sl], sc, col, scratch[acc][:r, : dv + 1],
                               outs[b, sl], softmax))
            heads.append((qb, kb.T, vb, blocks))

        def body():
            if t == 0:
                out.fill(0)
                return
            vx[:, dv] = 1
            for qb, kt, vb, blocks in heads:
                np.multiply(qb, scale, out=qs)
                if not compiled:
                    np.copyto(vx[:, :dv], vb)
                for qr, br, sc, col, a, dst, softmax in blocks:
                    np.matmul(qr, kt, out=sc)
                    if br is not None:
                        np.add(sc, br, out=sc, dtype=F32)
                    if softmax is not None:
                        softmax()
                        np.matmul(sc, vb, out=a[:, :dv])
                        np.copyto(a[:, dv:], col)
                    else:
                        np.max(sc, axis=1, out=col[:, 0])
                        np.subtract(sc, col, out=sc)
                        np.exp(sc, out=sc)
                        np.matmul(sc, vx, out=a)
                    _finish(a, dst, dv)

        return with_refresh(ops, body)

    return bind


def prepare_attention_blocked(ctx: KernelContext) -> Bind:
    batch, s, t, d, dv = _check(ctx)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    block = int(ctx.node.attr("block", 128))
    if block < 1:
        ctx.fail(f"block must be >= 1, got {block}")
    block = min(block, max(t, 1))
    ops = _operands(ctx)
    head = _HeadScratch(ctx, s, t, d, dv)
    scores = ctx.scratch.add((s, block), F32)
    vecs = [ctx.scratch.add((s,), F32) for _ in range(3)]  # running max (two, alternating), rescale factor
    pv = ctx.scratch.add((s, _padded(dv + 1)), F32)
    acc = ctx.scratch.add((s, _padded(dv + 1)), F32)

    def bind(out, flats, scratch):
        q, k, v, bias = bind_all(ops, flats, scratch)
        qs, vx = head.arrays(scratch)
        maxima = [scratch[vecs[0]], scratch[vecs[1]]]
        running = maxima[0]  # the compiled path keeps one running max
        compiled = jit.AVAILABLE
        rescale = scratch[vecs[2]][:, None]
        a, pvb = scratch[acc][:, : dv + 1], scratch[pv][:, : dv + 1]
        outs = out.reshape((math.prod(batch), s, dv))
        heads = []
        for b, (qb, kb, vb, biasb) in enumerate(_per_batch([q, k, v, bias], batch)):
            keys = []
            for j, t0 in enumerate(range(0, t, block)):
                ks = slice(t0, min(t0 + block, t))
                # the running max alternates between two vectors: this block's is the other one's update
                sc = scratch[scores][:, : ks.stop - ks.start]
                online = jit.by_rows(jit.kernels().exp_rows_online, [sc, running, rescale[:, 0]], j == 0) \
                    if compiled else None
                keys.append((kb[ks].T, vx[ks], None if biasb is None else biasb[:, ks], sc,
                             maxima[j % 2][:, None], maxima[(j + 1) % 2][:, None], online))
            heads.append((qb, vb, keys, outs[b]))

        def body():
            if t == 0:
                out.fill(0)
                return
            vx[:, dv] = 1
            for qb, vb, keys, dst in heads:
                np.multiply(qb, scale, out=qs)
                np.copyto(vx[:, :dv], vb)
                for j, (kt, vs, bs, sc, m_old, m_new, online) in enumerate(keys):
                    np.matmul(qs, kt, out=sc)
                    if bs is not None:
                        np.add(sc, bs, out=sc, dtype=F32)
                    if online is not None:  # the block's max, the rescale factor and exp in one pass per row
                        online()
                        if j == 0:
                            np.matmul(sc, vs, out=a)
                        else:
                            np.matmul(sc, vs, out=pvb)
                            np.multiply(a, rescale, out=a)
                            np.add(a, pvb, out=a)
                        continue
                    np.max(sc, axis=1, out=m_new[:, 0])
                    if j == 0:
                        np.maximum(m_new, F32_MIN, out=m_new)
                        np.subtract(sc, m_new, out=sc)
                        np.exp(sc, out=sc)
                        np.matmul(sc, vs, out=a)
                        continue
                    np.maximum(m_new, m_old, out=m_new)
                    np.subtract(m_old, m_new, out=rescale)  # rescales what was accumulated so far
                    np.exp(rescale, out=rescale)
                    np.subtract(sc, m_new, out=sc)
                    np.exp(sc, out=sc)
                    np.matmul(sc, vs, out=pvb)
                    np.multiply(a, rescale, out=a)
                    np.add(a, pvb, out=a)
                _finish(a, dst, dv)

        return with_refresh(ops, body)

    return bind
