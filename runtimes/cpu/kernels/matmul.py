"""``MatMul``: BLAS (one thread per call, large products cut into chunks over the cores) or the AMX tiles."""

from __future__ import annotations

import functools
import math

import numpy as np

from luminal_recipes.graph.view import BoundView

from ...kernels.context import Bind, KernelContext, Step
from ...views import alias
from .. import amx, cblas, jit
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
            steps = [_compiled_product(left, right, dst) or _blas_product(left, right, dst)
                     for left, right, dst in products]

        add_bias = None if bias is None or acc is not None else _compiled_add(target, bias)

        def body():
            for product in steps:
                product()
            if add_bias is not None:
                add_bias()
            elif bias is not None:
                np.add(target, bias, out=target, **kw)
            if acc is not None:
                np.copyto(out, target, casting="unsafe")

        if (bias is None or add_bias is not None) and acc is None and jit.AVAILABLE:  # described for the chains
            from ..jit.chain import combine  # where every part is

            body = combine(body, *steps, *([add_bias] if add_bias is not None else []))
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


ROWS_PRODUCT_MAX = 8  # rows of a product at most for the compiled pass over a weight stored as rows (decoding)


def _flat(a: np.ndarray, writeable: bool = False) -> tuple[np.ndarray, list[int]] | None:
    """``a`` (f32, 2-D) as the flat run of memory it spans (1-D, contiguous, from its first element) and its two
    element strides; None where a stride is negative or not a whole number of elements."""
    item = a.itemsize
    if a.dtype != F32 or a.size == 0 or any(st < 0 or st % item for st in a.strides):
        return None
    span = 1 + sum((n - 1) * st // item for n, st in zip(a.shape, a.strides))
    flat = alias(a, (span,), (item,), writeable=writeable)
    return flat, [st // item for st in a.strides]


def _compiled_product(left: np.ndarray, right: np.ndarray, dst: np.ndarray) -> Step | None:
    """``dst = left @ right`` as compiled calls the CPU chains can run (``jit/f32_kernels.py``), or None (then
    ``_blas_product``): a product of at most ``ROWS_PRODUCT_MAX`` rows against a right operand stored as rows
    (``right = w^T``, unit stride along K: a linear layer's weight) by ``rows_product``, or row by row (unit
    stride along N: attention's ``p v``) by ``cols_product``, its columns split over the cores; on several
    threads, a larger product by ``_sgemm_product`` (BLAS chunks the chains call)."""
    if not jit.AVAILABLE or dst.dtype != F32 or left.dtype != F32 or right.dtype != F32 or 0 in dst.shape:
        return None
    m, n = dst.shape
    k = left.shape[1]
    if k == 0:
        return None
    if m <= ROWS_PRODUCT_MAX and (left.strides[1] == 4 or k == 1) and (dst.strides[1] == 4 or n == 1):
        if right.strides[0] == 4 or k == 1:
            return _rows_product(left, right, dst, "rows_product")
        if right.strides[1] == 4 or n == 1:
            return _rows_product(left, right.T, dst, "cols_product")
    if cpu_threads.THREADS > 1:
        return _sgemm_product(left, right, dst)
    return None


def _rows_product(left: np.ndarray, right: np.ndarray, dst: np.ndarray, name: str) -> Step | None:
    """``f32_kernels.rows_product`` (``right`` [K, N] read as rows of ``right.T``) or ``cols_product`` (``right``
    given as ``[N, K]``: its transpose, read row by row) over the columns of ``dst``, one part per core."""
    x, w, o = _flat(left), _flat(right.T), _flat(dst, writeable=True)
    if x is None or w is None or o is None:
        return None
    from ..jit import f32_kernels

    kernel = getattr(f32_kernels, name)
    m, n = dst.shape
    k = left.shape[1]
    (xf, (xs, _)), (wf, (ws, _)), (of, (os_, _)) = x, w, o
    align = f32_kernels.ROWS if name == "rows_product" else 1  # its groups of rows: none read by two parts

    def describe():  # each output's sum in one fixed order whatever the columns' cut: again for a chain's parts
        cuts = sorted({min(n, -(-part.start // align) * align) for part in cpu_threads.split(n, k * m)} | {n})
        return [(kernel, (xf, 0, xs, wf, 0, ws, of, 0, os_, m, k, lo, hi), i)
                for i, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]

    calls = describe()
    parts = [lambda args=args: kernel(*args) for _, args, _ in calls]
    return jit.described(cpu_threads.parallel(parts), calls, redescribe=describe)


def _compiled_add(target: np.ndarray, bias: np.ndarray) -> Step | None:
    """``target += bias`` (f32, broadcast) as one ``f32_kernels.add_rows`` call, described for the chains; None
    where numba is off or the layout is not rows of unit stride."""
    if not jit.AVAILABLE or bias.dtype != F32 or target.dtype != F32:
        return None
    from ..jit import f32_kernels
    from .layout import _rows3

    rows = _rows3(target, np.broadcast_to(bias, target.shape))
    if rows is None:
        return None
    d_flat, d_geometry, s_flat, s_strides = rows
    args = (d_flat, np.array(d_geometry, np.int64), s_flat, np.array(s_strides, np.int64))
    kernel = f32_kernels.add_rows
    return jit.described(lambda: kernel(*args), [(kernel, args, None)])


def _blas_operand(a: np.ndarray, rows: int, cols: int) -> tuple[int, int] | None:
    """(CBLAS transpose code, leading dimension) reading the f32 matrix ``a`` [rows, cols] in row-major terms, or
    None where its strides are not a BLAS layout."""
    s0, s1 = (st // 4 for st in a.strides)
    if any(st % 4 or st < 0 for st in a.strides):
        return None
    if (s1 == 1 or cols == 1) and (s0 >= max(cols, 1) or rows == 1):
        return 111, s0 if rows > 1 else max(cols, 1)
    if (s0 == 1 or rows == 1) and (s1 >= max(rows, 1) or cols == 1):
        return 112, s1 if cols > 1 else max(rows, 1)
    return None


def _sgemm_product(left: np.ndarray, right: np.ndarray, dst: np.ndarray) -> Step | None:
    """``_blas_product``'s chunks (the same cut) as ``f32_kernels.sgemm_tasks`` calls: one per core, each taking
    the next chunk no core has taken, BLAS single-threaded inside (``chain.Call.blas``)."""
    blas = cblas.sgemm()
    m, n = dst.shape
    k = left.shape[1]
    a_op, b_op, c_op = _blas_operand(left, m, k), _blas_operand(right, k, n), _blas_operand(dst, m, n)
    if blas is None or a_op is None or b_op is None or c_op is None or c_op[0] != 111:
        return None
    from ..jit import f32_kernels
    from ..jit.chain import Call, tag

    parts = max(1, min(cpu_threads.THREADS, m * k * n // BLAS_PART_MACS))
    along = m if m >= n else n
    count = max(1, min(parts * BLAS_CHUNKS_PER_PART, -(-along // 16)))
    bounds = [min(along, -(-along * i // count) // 16 * 16) if i < count else along for i in range(count + 1)]
    base = [x.__array_interface__["data"][0] for x in (left, right, dst)]
    tasks = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        a, b, c = (left[lo:hi], right, dst[lo:hi]) if m >= n else (left, right[:, lo:hi], dst[:, lo:hi])
        offsets = [x.__array_interface__["data"][0] - b0 for x, b0 in zip((a, b, c), base)]
        tasks.append([*offsets, c.shape[0], c.shape[1], k])
    tasks = np.array(tasks, np.int64).reshape(-1, f32_kernels.TASK_COLUMNS)
    geometry = np.array([*base, a_op[0], b_op[0], a_op[1], b_op[1], c_op[1]], np.int64)
    counter = np.zeros(8, np.int64)  # the next chunk (one cache line)
    kernel, reset = f32_kernels.sgemm_tasks, f32_kernels.reset
    args = (geometry, tasks, counter, *blas)
    keep = (left, right, dst)  # what the addresses point into

    def step():
        counter[:] = 0
        with cpu_threads.blas_single_threaded():
            if parts == 1:
                kernel(*args)
            else:
                cpu_threads.run_parts([lambda: kernel(*args)] * parts)

    step.keep = keep
    return tag(step, [Call(reset, (counter,))], [Call(kernel, args, i, blas=True) for i in range(parts)])


def _amx_products(ctx: KernelContext, m: int, k: int, n: int):
    """An f32 MatMul's products on the CPU's AMX tiles (``runtimes/cpu/amx/``: f32 accuracy from three bf16 parts
    of each operand) when both operands are f32, the CPU has AMX and the products are large enough: the plan
    (one part per core) and each part's scratch (packed bf16 parts of A and B, L2-sized). None: BLAS."""
    if any(i.dtype != F32 for i in ctx.inputs[:2]) or not amx.worth_it(m, k, n, min_side=amx.MIN_SIDE):
        return None
    plan = amx.plan(m, k, n, cpu_threads.THREADS)
    return plan, [[ctx.scratch.add(shape, dtype) for shape, dtype in plan.scratch_shapes] for _ in plan.parts]

