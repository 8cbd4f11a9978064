"""``MatMul``: BLAS (one thread per call, large products cut into chunks over the cores) or the AMX tiles."""

from __future__ import annotations

import functools
import math

import numpy as np

from luminal_recipes.graph.view import BoundView

from ...kernels.context import Bind, KernelContext, Step
from .. import amx
from .. import threads as cpu_threads
from .common import F32, bind_all, is_float, with_refresh
from .operands import Operand, operand


def _batch_free(bv: BoundView) -> bool:
    """The view repeats one matrix over all its batch axes (stride 0 or size 1, no padding there)."""
    batch = len(bv.shape) - 2
    ok = all(d == 1 or s == 0 for d, s in zip(bv.shape[:batch], bv.strides[:batch]))
    if bv.mask is not None:
        ok = ok and all(lo <= 0 and hi >= d for (lo, hi), d in zip(bv.mask[:batch], bv.shape[:batch]))
    return ok


def _matrix(bv: BoundView) -> BoundView:
    mask = None if bv.mask is None else bv.mask[-2:]
    return BoundView(bv.shape[-2:], bv.strides[-2:], bv.offset, mask)


def prepare_matmul(ctx: KernelContext) -> Bind:
    if len(ctx.inputs) not in (2, 3) or len(ctx.shape) < 2:
        ctx.fail("expects inputs (a [..., M, K], b [..., K, N][, bias [..., M, N]])")
    a_in, b_in = ctx.inputs[0], ctx.inputs[1]
    m, n = ctx.shape[-2:]
    k = a_in.view.shape[-1]
    if b_in.view.shape[-2] != k or a_in.view.shape[-2] != m or b_in.view.shape[-1] != n:
        ctx.fail(f"shapes {a_in.view.shape} @ {b_in.view.shape} do not give {ctx.shape}")
    compute = F32 if is_float(ctx.dtype) else ctx.dtype
    batch = ctx.shape[:-2]
    rows = math.prod(batch) * m
    # one large GEMM when b is the same matrix for every batch entry (a linear layer): (B*M, K) @ (K, N)
    merged = bool(batch) and len(a_in.view.shape) == len(ctx.shape) and (
        len(b_in.view.shape) == 2 or _batch_free(b_in.view))
    if merged:
        a_op = Operand(a_in.view, a_in.dtype, a_in.size, ctx.scratch, dtype=compute, shape=(rows, k),
                       blas=True)
        b_op = Operand(_matrix(b_in.view), b_in.dtype, b_in.size, ctx.scratch, dtype=compute, blas=True)
    else:
        a_op = operand(ctx, 0, dtype=compute, blas=True)
        b_op = operand(ctx, 1, dtype=compute, blas=True)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None
    acc = None if compute == ctx.dtype else ctx.scratch.add(ctx.shape, compute)
    ops = [a_op, b_op, bias_op]
    on_amx = _amx_products(ctx, rows if merged or not batch else m, k, n)

    def bind(out, flats, scratch):
        a, b, bias = bind_all(ops, flats, scratch)
        target = out if acc is None else scratch[acc]
        if merged or not batch:
            products = [(a, b, target.reshape(rows, n))]
        else:  # numpy's stacked matmul is far slower than one BLAS call per matrix: loop over the batch
            a_full, b_full = np.broadcast_to(a, batch + (m, k)), np.broadcast_to(b, batch + (k, n))
            products = [(a_full[i], b_full[i], target[i]) for i in np.ndindex(*batch)]
        kw = {"dtype": F32} if compute == F32 else {}
        if on_amx is not None:  # the same products, each cut into one part per core (see _amx_products)
            plan, ids = on_amx
            buffers = [[scratch[i] for i in part] for part in ids]
            steps = [amx.product(plan, left, right, dst, buffers) for left, right, dst in products]
        else:
            steps = [_blas_product(left, right, dst) for left, right, dst in products]

        def body():
            for product in steps:
                product()
            if bias is not None:
                np.add(target, bias, out=target, **kw)
            if acc is not None:
                np.copyto(out, target, casting="unsafe")

        return with_refresh(ops, body)

    return bind


BLAS_PART_MACS = 1 << 21  # multiply-adds per core at least, for a BLAS product to be cut into chunks
BLAS_CHUNKS_PER_PART = 4


def _blas_product(left: np.ndarray, right: np.ndarray, dst: np.ndarray) -> Step:
    """``dst = left @ right`` by BLAS, one thread per call: a large product cut into chunks of rows (or of
    columns, when it has more columns) that the cores take in turn (``cpu_threads.claimed``), each chunk one
    single-threaded call; a small one in one call on this thread. OpenBLAS's own threads cost more than they
    give here: a call waits for its helper thread when the OS has descheduled it (16 x 32 x 65536, the VAE's
    1x1 convolution: 5.1 ms on two OpenBLAS threads, 1.9 on one, load 4), and a small call pays their wake-up.
    Chunk bounds are fixed at bind time: results never depend on which core runs a chunk."""
    m, n = dst.shape
    k = left.shape[1]
    if dst.dtype.kind != "f" or cpu_threads.THREADS <= 1:  # LUMINAL_RECIPES_THREADS=1: BLAS keeps its threads
        return functools.partial(np.matmul, left, right, out=dst)
    parts = min(cpu_threads.THREADS, m * k * n // BLAS_PART_MACS)
    if parts <= 1:
        def single():
            with cpu_threads.blas_single_threaded():
                np.matmul(left, right, out=dst)

        return single
    along = m if m >= n else n
    count = min(parts * BLAS_CHUNKS_PER_PART, -(-along // 16))
    bounds = [min(along, -(-along * i // count) // 16 * 16) if i < count else along for i in range(count + 1)]
    cuts = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    if m >= n:
        chunks = [(left[lo:hi], right, dst[lo:hi]) for lo, hi in cuts]
    else:
        chunks = [(left, right[:, lo:hi], dst[:, lo:hi]) for lo, hi in cuts]

    def task(slot: int, j: int) -> None:
        a, b, out = chunks[j]
        np.matmul(a, b, out=out)

    run = cpu_threads.claimed(len(chunks), parts, task)

    def step():
        with cpu_threads.blas_single_threaded():
            run()

    return step


def _amx_products(ctx: KernelContext, m: int, k: int, n: int):
    """An f32 MatMul's products on the CPU's AMX tiles (``runtimes/cpu/amx/``: f32 accuracy from three bf16 parts
    of each operand) when both operands are f32, the CPU has AMX and the products are large enough: the plan
    (one part per core) and each part's scratch (packed bf16 parts of A and B, L2-sized). None: BLAS."""
    if any(i.dtype != F32 for i in ctx.inputs[:2]) or not amx.worth_it(m, k, n, min_side=amx.MIN_SIDE):
        return None
    plan = amx.plan(m, k, n, cpu_threads.THREADS)
    return plan, [[ctx.scratch.add(shape, dtype) for shape, dtype in plan.scratch_shapes] for _ in plan.parts]

