"""numpy attention kernels: softmax(q k^T * scale + bias) v, one block of query rows of one (batch, head) at a time.

``Attention`` computes the scores of a block of query rows against all keys (a ``(rows, T)`` scratch; never
``(S, T, D)``), as PyTorch's CPU flash-attention kernel does per (head, query block), except that a block sees
every key at once, so no running rescale is needed. ``AttentionBlocked`` walks the keys in blocks with an online
softmax (running max and sum, rescaled accumulator), so neither ``(S, T)`` nor ``(S, T, D)`` ever exists. Both
use BLAS for the two products and compute in f32. Running maxima start at the most negative finite f32 rather
than -inf, so a block of fully masked keys never produces ``-inf - -inf``.

The (head, query block) tasks are independent: one part per core, each with its own scratch, takes the next
task no part has taken yet (``cpu_threads.claimed``: a core the OS gives less time runs fewer tasks), and BLAS
runs single-threaded inside (one BLAS call per core in parallel beats two-threaded calls one after another:
fewer joins, each core's scores stay in its cache, and no call waits for a descheduled BLAS thread on a loaded
machine). Query blocks are a few hundred rows (OpenBLAS is slower on fewer; larger blocks than the L2 cache
measured faster, not slower) and at least ``MIN_TASKS`` per call where heads are few.
Besides the two products, what costs is the passes over the scores, so each block of ``q`` is scaled once
(``(q * scale) k^T`` instead of scaling every score) and, with numba, max, exp and the row sums are one compiled
pass per row (``numba_kernels``, vectorised with 512-bit registers), else numpy passes. ``p @ v`` reads ``v`` in
place (nothing of size ``T`` is copied, which matters for decoding: one query row against a growing cache) and
the output rows are divided by the sums at the end.

**Masked keys are skipped** (a causal mask's upper triangle, a sliding window's far keys, a KV cache's unfilled
rows): with an f32 bias, each run first finds per query row the span of keys its bias does not mask
(``_mask_spans``: masked = ``bias <= MASKED``, the -inf or most-negative-f32 bias every mask here and in
PyTorch/transformers becomes), and a block of query rows computes only the keys inside its rows' spans; where
that saves enough, ``Attention`` cuts a block into ``SKIP_ROWS``-row pieces, each with its own keys (a causal
mask's staircase: 62% of the scores at 512 tokens, measured 14% less time at head dim 64). A skipped key's
weight is ``exp(score + bias - max)``, which is exactly 0 in f32 whenever the row has a key with a bias above
``KEEP`` (then ``bias - max < -9e36``): rows without one (a fully masked row: its softmax is over the masked
scores) and non-f32 biases skip nothing. The
kept keys are computed as before, so only the sums' rounding differs from the unskipped kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ...kernels.context import Bind, KernelContext
from ...views import alias
from .. import amx, jit
from .. import threads as cpu_threads
from . import attention_small
from .common import F32, F32_MIN, bind_all, view_reshape, with_refresh
from .operands import operand

ATTENTION_TILE = 1 << 21  # score elements per query block of the unblocked kernel (8 MiB in f32, per core)
BLOCKED_ROWS = 256  # query rows per block of the key-blocked kernel
MIN_TASKS = 12  # (head, query block) tasks a kernel call is cut into at least, where blocks keep >= MIN_ROWS rows
MIN_ROWS = 256
FUSED_ROWS = 256  # query rows per block at most where both products run on AMX (amx_attention)
ROWS_KERNEL_KEYS = 4096  # decoding attends to at most this many keys in one compiled call (``attention_rows``)
MASKED = np.float32(-1e37)  # a bias at or below this masks its key (-inf, or f32's most negative: -3.4e38)
KEEP = np.float32(-1e36)  # keys of a row are skipped only where some bias of the row is at least this
SKIP_ROWS = 128  # query rows per piece of a block whose rows see different keys (a causal staircase; 64 and 256
# measured slower at 512 tokens, head dim 64: BLAS is slower on fewer rows, and each piece costs ~15 us of calls)
SKIP_GAIN = 0.85  # a block is cut into pieces where they compute at most this share of the block's scores


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


def _shared_kv_rows(arrays: list, out: np.ndarray, batch: tuple[int, ...], flat: bool = False) -> list | None:
    """One query row per head (decoding): the heads that read the same k, v and bias (grouped-query attention's
    stride-0 views) stacked into one block of rows, as (q rows, k, v, bias rows, out rows) per group; ``None``
    when no head shares them, or the rows do not stack without a copy. With ``flat``, every group at once:
    ``[q [G, rows, D], k [G, T, D], v [G, T, Dv], bias [G, rows, T] or None, out [G, rows, Dv]]``."""
    q, k, v, bias = (None if a is None else np.broadcast_to(a, batch + a.shape[-2:]) for a in arrays)
    reads = [a for a in (k, v, bias) if a is not None]
    shared = [i for i, n in enumerate(batch) if n > 1 and all(a.strides[i] == 0 for a in reads)]
    if not shared and not flat:  # (flat: the compiled call takes every head at once, a row each, shared or not)
        return None
    own = [i for i in range(len(batch)) if i not in shared]
    groups, rows = tuple(batch[i] for i in own), math.prod(batch[i] for i in shared)
    order = own + shared
    out = out.reshape(batch + out.shape[-1:])

    def stacked(a):  # [own..., shared..., 1, n] -> [own..., rows, n], a view or None
        a = a.transpose(order + [len(batch), len(batch) + 1])[..., 0, :]
        return view_reshape(a, groups + (rows, a.shape[-1]))

    def first(a):  # the shared axes at their first entry: [own..., t, n]
        return a[tuple(slice(None) if i in own else 0 for i in range(len(batch)))]

    qs, dst = stacked(q), view_reshape(out.transpose(order + [len(batch)]), groups + (rows, out.shape[-1]))
    bs = None if bias is None else stacked(bias)
    if qs is None or dst is None or (bias is not None and bs is None):
        return None
    ks, vs = first(k), first(v)
    if flat:  # every group along one axis: [G, rows or t, n] views, or None
        g = math.prod(groups)
        blocks = [view_reshape(a, (g,) + a.shape[len(groups):]) for a in (qs, ks, vs, bs, dst) if a is not None]
        if any(b is None for b in blocks):
            return None
        return blocks if bs is not None else blocks[:3] + [None] + blocks[3:]
    return [(qs[g], ks[g], vs[g], None if bs is None else bs[g], dst[g]) for g in np.ndindex(*groups)]


class _Plan:
    """The query blocks of every head (near-equal, at most ``rows`` each) as tasks, and the parts (one per core,
    each with its own scratch, registered with the kernel: ``(rows, width)`` scores, ``q * scale``, row vectors
    and ``(rows, Dv)`` accumulators as the kernel asks) that take the tasks in turn (``cpu_threads.claimed``).
    Blocks are cut smaller than ``rows`` where that makes ``MIN_TASKS`` tasks (or one per core, if more), down
    to ``MIN_ROWS`` rows (BLAS loses speed on fewer): whole heads of a few hundred tokens would be a task or two
    per core, and a core the OS gives less time would hold the other up. The blocks do not depend on the
    thread count up to ``MIN_TASKS`` threads, so neither do the results (BLAS's bits depend on a product's
    rows)."""

    def __init__(self, ctx: KernelContext, heads: int, s: int, rows: int, scores_per_row: int):
        rows = max(1, rows)
        want = -(-max(MIN_TASKS, cpu_threads.THREADS) // max(1, heads))  # blocks per head
        rows = min(rows, max(-(-s // want), MIN_ROWS))
        blocks = max(1, min(s, -(-s // rows)))
        bounds = [s * i // blocks for i in range(blocks + 1)]
        self.slices = [slice(bounds[i], bounds[i + 1]) for i in range(blocks) if bounds[i + 1] > bounds[i]]
        self.rows = max((sl.stop - sl.start for sl in self.slices), default=1)
        self.count = heads * len(self.slices)
        self.slots = len(cpu_threads.split(self.count, self.rows * scores_per_row))
        self.ctx = ctx

    def scratch(self, shape) -> list[int]:
        """One scratch array of ``shape`` per part."""
        return [self.ctx.scratch.add(shape, F32) for _ in range(self.slots)]

    def tasks(self, per_head: list) -> list[tuple]:
        """(head entry, query rows) per task, in order."""
        return [(head, sl) for head in per_head for sl in self.slices]

    def run(self, count: int, task: Callable[[int, int], None], blas: bool = True) -> Callable[[], None]:
        """The step running ``task(slot, j)`` for ``j`` < ``count``; with several parts and ``blas`` (the tasks
        call BLAS), BLAS single-threaded inside (one part means little work: the ~20 us of switching BLAS's
        threads would show)."""
        step = cpu_threads.claimed(count, self.slots, task)
        if self.slots == 1 or not blas:
            return step

        def body():
            with cpu_threads.blas_single_threaded():
                step()

        return body


def _store(acc: np.ndarray, sums: np.ndarray, dst: np.ndarray) -> None:
    """``dst = acc / sums`` per row (``acc`` may be ``dst`` itself when the output is f32)."""
    if dst.dtype == F32:
        np.divide(acc, sums[:, None], out=dst)
    else:
        np.divide(acc, sums[:, None], out=acc)
        np.copyto(dst, acc, casting="unsafe")


def prepare_attention(ctx: KernelContext) -> Bind:
    batch, s, t, d, dv = _check(ctx)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    ops = _operands(ctx)
    heads = math.prod(batch)
    plan = _Plan(ctx, heads, s, ATTENTION_TILE // max(t, 1), t)
    # decoding on one core: the heads sharing k and v may become one block of rows (fewer, larger calls)
    stackable = s == 1 and plan.slots == 1
    direct = ctx.dtype == F32  # p @ v straight into the output rows
    fused = _fused(ctx, plan, s, d, t, dv)
    if not fused and attention_small.applies(ctx, s, d, dv):  # 16-dim heads: a compiled kernel, not BLAS
        return attention_small.prepare(ctx, plan.rows)
    if fused:  # smaller query blocks: the keys are taken in blocks, and k and v are packed once per head and part
        plan = _Plan(ctx, heads, s, min(plan.rows, FUSED_ROWS), t)
    rows = max(plan.rows, heads) if stackable else plan.rows
    scores = plan.scratch((rows, t))  # the BLAS path's (the fused one's where an operand is not finite)
    qscaled = plan.scratch((rows, d))
    sums = plan.scratch((rows,))
    accs = None if direct else plan.scratch((rows, dv))
    on_amx = not fused and ctx.inputs[0].dtype == F32 and ctx.inputs[1].dtype == F32 and amx.worth_it(rows, d, t)
    amx_buffers = [[ctx.scratch.add(shape, dtype) for shape, dtype in amx.part_buffers(rows, d, t)]
                   for _ in range(plan.slots)] if on_amx else None
    fused_buffers = [[ctx.scratch.add(shape, dtype) for shape, dtype in
                      amx_attention().head_buffers(t, d, dv) + amx_attention().task_buffers(rows, t, d, dv)]
                     for _ in range(plan.slots)] if fused else None

    def bind(out, flats, scratch):
        q, k, v, bias = bind_all(ops, flats, scratch)
        tiles = None if amx_buffers is None else [[scratch[i] for i in part] for part in amx_buffers]
        compiled = jit.AVAILABLE
        rows_kernel = jit.kernels().exp_rows_sum if compiled else None
        if stackable and compiled and direct and t <= ROWS_KERNEL_KEYS:  # every head in one compiled call
            blocks = _shared_kv_rows([q, k, v, bias], out, batch, flat=True)
            step = None if blocks is None else _rows_step(blocks, scale, scratch[qscaled[0]], scratch[scores[0]])
            if step is not None:
                return with_refresh(ops, step)
        groups = _shared_kv_rows([q, k, v, bias], out, batch) if stackable else None
        if groups is not None:
            tasks = [((qg, kg.T, vg, bg, dg), slice(0, qg.shape[0])) for qg, kg, vg, bg, dg in groups]
        else:
            outs = out.reshape((heads, s, dv))
            tasks = plan.tasks([(qb, kb.T, vb, biasb, outs[b]) for b, (qb, kb, vb, biasb) in
                                enumerate(_per_batch([q, k, v, bias], batch))])
        # the masked keys each task may skip (not on AMX's product): per distinct f32 bias, its rows' key spans
        spans = _Spans() if tiles is None else None
        blocks = []  # per part, per task: the operands' rows, the part's scratch, (bias spans, first, end row)
        for i in range(plan.slots):
            mine = []
            for (qb, kt, vb, biasb, dst), sl in tasks:
                r = sl.stop - sl.start
                sc, col = scratch[scores[i]][:r], scratch[sums[i]][:r]
                acc = dst[sl] if direct else scratch[accs[i]][:r]
                span = None if spans is None or biasb is None else spans.of(biasb)
                mine.append((qb[sl], scratch[qscaled[i]][:r], kt, vb, None if biasb is None else biasb[sl], sc,
                             col, acc, dst[sl], None if span is None else (span, sl.start, sl.stop)))
            blocks.append(mine)

        def softmax_rows(sc, col):
            if compiled:  # max, exp and the row sums, one pass per row
                rows_kernel(sc, col)
            else:
                np.max(sc, axis=1, out=col)
                np.subtract(sc, col[:, None], out=sc)
                np.exp(sc, out=sc)
                np.sum(sc, axis=1, out=col)

        def blas_task(slot, j):
            qr, qs, kt, vb, br, sc, col, acc, dst, span = blocks[slot][j]
            np.multiply(qr, scale, out=qs)
            pieces = None if span is None else _pieces(*span, t)
            if pieces is not None:  # only the keys the rows' bias does not mask, in pieces of rows
                first, flat = span[1], sc.reshape(-1)
                for c, e, k0, k1 in pieces:
                    rows = slice(c - first, e - first)
                    part = flat[: (e - c) * (k1 - k0)].reshape(e - c, k1 - k0)
                    np.matmul(qs[rows], kt[:, k0:k1], out=part)
                    np.add(part, br[rows, k0:k1], out=part, dtype=F32)
                    softmax_rows(part, col[rows])
                    np.matmul(part, vb[k0:k1], out=acc[rows])
                _store(acc, col, dst)
                return
            if tiles is None:
                np.matmul(qs, kt, out=sc)
            else:
                amx.multiply(qs, kt, sc, tiles[slot])
            if br is not None:
                np.add(sc, br, out=sc, dtype=F32)
            softmax_rows(sc, col)
            np.matmul(sc, vb, out=acc)
            _store(acc, col, dst)

        if fused_buffers is None:
            step = plan.run(len(tasks), blas_task)
        else:
            step = _fused_step(plan, tasks, scale, [[scratch[n] for n in part] for part in fused_buffers], blas_task)

        def body():
            if t == 0:
                out.fill(0)
                return
            if spans is not None:
                spans.refresh()
            step()

        return with_refresh(ops, body)

    return bind


class _Spans:
    """The distinct f32 biases a kernel's tasks read (heads sharing one by broadcasting share its spans) and,
    per bias, per query row: ``lo``, ``hi`` the span of keys the bias does not mask, ``keep`` whether the keys
    outside it may be skipped; ``refresh()`` (each run, before the tasks) recomputes them from the bias's
    values."""

    def __init__(self):
        self.biases: dict[tuple, int] = {}
        self.arrays: list[tuple] = []

    def of(self, bias: np.ndarray) -> tuple | None:
        """``(lo, hi, keep)`` of the 2-D ``bias`` [S, T], or None (not f32, or no key to skip)."""
        if bias.dtype != F32 or bias.ndim != 2 or bias.shape[0] == 0 or bias.shape[1] < 2:
            return None
        key = (bias.__array_interface__["data"][0], bias.shape, bias.strides)
        if key not in self.biases:
            s = bias.shape[0]
            self.biases[key] = len(self.arrays)
            self.arrays.append((bias, np.zeros(s, np.int64), np.zeros(s, np.int64), np.zeros(s, np.bool_)))
        return self.arrays[self.biases[key]][1:]

    def refresh(self) -> None:
        for bias, lo, hi, keep in self.arrays:
            _mask_spans(bias, lo, hi, keep)


def _mask_spans(bias: np.ndarray, lo: np.ndarray, hi: np.ndarray, keep: np.ndarray) -> None:
    """Per row ``i`` of ``bias [S, T]``: ``lo[i]``, ``hi[i]`` the first and one past the last key whose bias is
    not masked (above ``MASKED``, or NaN), ``keep[i]`` whether some bias of the row is at least ``KEEP`` (then the
    row's masked keys have weight exactly 0; not for a row that is all masked). One compiled pass
    (``numba_kernels.mask_spans``, reading the bias in place) where numba is, else numpy's."""
    item = bias.itemsize
    if jit.AVAILABLE and min(bias.strides) >= 0 and not any(st % item for st in bias.strides):
        span = 1 + sum((n - 1) * st // item for n, st in zip(bias.shape, bias.strides))
        flat = alias(bias, (span,), (item,), writeable=False)
        jit.kernels().mask_spans(flat, bias.shape[0], bias.shape[1], bias.strides[0] // item,
                                 bias.strides[1] // item, lo, hi, keep, MASKED, KEEP)
        return
    unmasked = ~(bias <= MASKED)
    np.argmax(unmasked, axis=1, out=lo)
    np.subtract(bias.shape[1], np.argmax(unmasked[:, ::-1], axis=1), out=hi)
    np.any(bias >= KEEP, axis=1, out=keep)


def _pieces(spans: tuple, first: int, end: int, t: int, split: bool = True) -> list[tuple[int, int, int, int]] | None:
    """How the query rows ``first:end`` skip masked keys: ``[(row0, row1, key0, key1)]`` (the rows and the keys
    each piece computes), or None where they skip none (a row that may not skip, or every key is in a span).
    One piece over the keys of all rows' spans, or ``SKIP_ROWS``-row pieces each over its own rows' keys where
    those compute at most ``SKIP_GAIN`` of that (BLAS is slower on fewer rows). The pieces depend on the rows and
    the bias only, so the results do not depend on the thread count. ``split=False``: one piece at most."""
    lo, hi, keep = spans
    if not keep[first:end].all():
        return None
    k0, k1 = int(lo[first:end].min()), int(hi[first:end].max())
    whole = [(first, end, k0, k1)]
    if split and end - first >= 2 * SKIP_ROWS:
        pieces = []
        for c in range(first, end, SKIP_ROWS):
            e = min(c + SKIP_ROWS, end)
            pieces.append((c, e, int(lo[c:e].min()), int(hi[c:e].max())))
        if sum((e - c) * (b - a) for c, e, a, b in pieces) <= SKIP_GAIN * (end - first) * (k1 - k0):
            return pieces
    return None if (k0, k1) == (0, t) else whole


def _rows_step(blocks: list, scale: np.float32, qs: np.ndarray, sc: np.ndarray) -> Callable[[], None] | None:
    """Decoding's attention as one compiled call (``numba_kernels.attention_rows``) over every group of heads
    (``_shared_kv_rows(..., flat=True)``): a few microseconds, where the BLAS path's dozen small calls per group
    cost tens. None where an operand's rows are not contiguous or its strides are negative. ``qs`` and ``sc``:
    scratch of a row per query row at least (``[rows, D]``, ``[rows, T]``).

    In a chain run in lockstep (``chain.finer``: ``rechain``) the query rows are cut over the threads, each part
    with its own scratch rows: there the call sits between barriers (its q is the step before's output, its output
    the next product's input), so on one thread the other would wait for all of it (SmolLM2 at 64 keys: 11 of the
    ~30 us a layer spends outside its products; 8x that at 512 keys). Each row is computed as in the whole call,
    so the bits do not depend on the cut."""
    q, k, v, bias, out = blocks
    has_bias = bias is not None
    flats, strides = [], []
    for a in (q, k, v, bias if has_bias else np.zeros((1, 1, 1), F32), out):
        item = a.itemsize
        if a.dtype != F32 or a.strides[2] != item or min(a.strides) < 0 or any(st % item for st in a.strides):
            return None
        span = 1 + sum((n - 1) * st // item for n, st in zip(a.shape, a.strides))
        flats.append(alias(a, (span,), (item,), writeable=a is out))
        strides += [a.strides[0] // item, a.strides[1] // item]
    units = q.shape[0] * q.shape[1]
    head = [*q.shape[:2], k.shape[1], q.shape[2], v.shape[2], *strides]
    kernel = jit.kernels().attention_rows
    args = (*flats, np.array([*head, 0, units], np.int64), has_bias, scale, qs[0], sc[0], MASKED, KEEP)

    def step():
        kernel(*args)

    step = jit.described(step, [(kernel, args, None)])
    parts = min(cpu_threads.THREADS, units)
    if parts > 1 and hasattr(step, "chain"):
        cuts = [units * i // parts for i in range(parts + 1)]
        fine = [(kernel, (*flats, np.array([*head, cuts[i], cuts[i + 1]], np.int64), has_bias, scale, qs[i], sc[i],
                          MASKED, KEEP), i) for i in range(parts)]
        from ..jit.chain import Call

        def rechain(fine=fine):
            return [[Call(fn, a, part) for fn, a, part in fine]]

        rechain.always = True  # whatever the chain's own minimum part (chain.finer)
        step.rechain = rechain
    return step


def _fused(ctx: KernelContext, plan: _Plan, s: int, d: int, t: int, dv: int) -> bool:
    """Both products on the AMX tiles where they run (f32 operands and output, no bias, not decoding's stacked
    rows, large enough): ``amx_attention``, one compiled call per task, whose softmax pass writes p's bf16 parts,
    and per part the packed k and v of the head it last took. With a bias, only q k^T goes to AMX (p v stays on
    BLAS: splitting p in a pass of its own costs as much as the product saves, 256 x 768 x 64: 0.7x BLAS's
    speed)."""
    stackable = s == 1 and plan.slots == 1
    return (all(ctx.inputs[i].dtype == F32 for i in range(3)) and len(ctx.inputs) == 3 and ctx.dtype == F32
            and not stackable and min(d, dv) >= 16 and amx.worth_it(min(plan.rows, FUSED_ROWS), d, t)
            and amx_attention().ready())


def _fused_step(plan: _Plan, tasks: list, scale: np.float32, buffers: list, blas_task: Callable) -> Callable:
    """The step running ``tasks`` with ``amx_attention``: a part packs k and v of a task's head unless it holds
    them from its previous task (reset every run: the operands change), then runs the task in one call; a task
    whose operands hold a value that is not finite runs ``blas_task`` (without BLAS single-threaded: rare)."""
    kernels = amx_attention()
    per_head = len(plan.slices)
    heads = []  # per head: pack_kv's operands
    calls = []  # per task: task's operands, less the part's buffers
    for j, ((qb, kt, vb, _, dst), sl) in enumerate(tasks):
        if j % per_head == 0:
            kb = kt.T
            heads.append((kb.ctypes.data, *kb.strides, vb.ctypes.data, *vb.strides, kb.shape[0], kb.shape[1],
                          vb.shape[1]))
        qr, out = qb[sl], dst[sl]
        calls.append((qr.ctypes.data, *qr.strides, qr.shape[0], scale, kt.shape[1], out.ctypes.data, *out.strides,
                      out.shape[1]))
    held = [-1] * plan.slots  # the head whose k and v a part holds packed
    bad = [0] * plan.slots

    def task(slot, j):
        head = j // per_head
        kp, vp, *rest = buffers[slot]
        if held[slot] != head:
            bad[slot] = kernels.pack_kv(*heads[head], kp, vp)
            held[slot] = head
        if bad[slot] or kernels.task(*calls[j], kp, vp, *rest):
            blas_task(slot, j)

    step = plan.run(len(tasks), task, blas=False)

    def run():
        held[:] = [-1] * len(held)
        step()

    return run


def amx_attention():
    """``amx_attention`` (numba: imported only where AMX runs)."""
    from ..amx import attention as module

    return module


def prepare_attention_blocked(ctx: KernelContext) -> Bind:
    batch, s, t, d, dv = _check(ctx)
    scale = np.float32(ctx.node.attr("scale", 1.0))
    block = int(ctx.node.attr("block", 128))
    if block < 1:
        ctx.fail(f"block must be >= 1, got {block}")
    block = min(block, max(t, 1))
    ops = _operands(ctx)
    heads = math.prod(batch)
    plan = _Plan(ctx, heads, s, BLOCKED_ROWS, t)
    if _fused(ctx, plan, s, d, t, dv) or attention_small.applies(ctx, s, d, dv):
        return prepare_attention(ctx)  # these kernels take the keys in blocks of their own (the same values)
    scores = plan.scratch((plan.rows, block))
    qscaled = plan.scratch((plan.rows, d))
    vecs = [plan.scratch((plan.rows,)) for _ in range(3)]  # running max, running sum, rescale factor
    pvs = plan.scratch((plan.rows, dv))
    accs = plan.scratch((plan.rows, dv))
    starts = list(range(0, t, block))

    def bind(out, flats, scratch):
        q, k, v, bias = bind_all(ops, flats, scratch)
        outs = out.reshape((heads, s, dv))
        compiled = jit.AVAILABLE
        online = jit.kernels().exp_rows_online if compiled else None
        per_head = [(qb, kb, vb, biasb, outs[b]) for b, (qb, kb, vb, biasb) in
                    enumerate(_per_batch([q, k, v, bias], batch))]
        tasks = plan.tasks(per_head)
        spans = _Spans()  # the key blocks a task may skip: wholly outside its rows' spans of unmasked keys
        blocks = []  # per part, per task: the operands' rows, their key blocks and the part's scratch
        for i in range(plan.slots):
            mine = []
            for (qb, kb, vb, biasb, dst), sl in tasks:
                span = None if biasb is None else spans.of(biasb)
                r = sl.stop - sl.start
                m, total, rescale = (scratch[vec[i]][:r] for vec in vecs)
                keys = []
                for t0 in starts:
                    ks = slice(t0, min(t0 + block, t))
                    keys.append((kb[ks].T, vb[ks], None if biasb is None else biasb[sl, ks],
                                 scratch[scores[i]][:r, : ks.stop - ks.start]))
                mine.append((qb[sl], scratch[qscaled[i]][:r], keys, m, total, rescale,
                             scratch[pvs[i]][:r], scratch[accs[i]][:r], dst[sl],
                             None if span is None else (span, sl.start, sl.stop)))
            blocks.append(mine)

        def task(slot, j):
            qr, qs, keys, m, total, rescale, pv, acc, dst, span = blocks[slot][j]
            np.multiply(qr, scale, out=qs)
            pieces = None if span is None else _pieces(*span, t, split=False)
            k0, k1 = (0, t) if pieces is None else pieces[0][2:]
            first = True
            for t0, (kt, vs, bs, sc) in zip(starts, keys):
                if t0 + block <= k0 or t0 >= k1:  # every key of the block masked for these rows
                    continue
                np.matmul(qs, kt, out=sc)
                if bs is not None:
                    np.add(sc, bs, out=sc, dtype=F32)
                if compiled:  # the block's max, the rescale factor, exp and the sums in one pass per row
                    online(sc, m, total, rescale, first)
                else:
                    _online_numpy(sc, m, total, rescale, first)
                if first:
                    np.matmul(sc, vs, out=acc)
                    first = False
                    continue
                np.matmul(sc, vs, out=pv)
                np.multiply(acc, rescale[:, None], out=acc)
                np.add(acc, pv, out=acc)
            _store(acc, total, dst)

        step = plan.run(len(tasks), task)

        def body():
            if t == 0:
                out.fill(0)
                return
            spans.refresh()
            step()

        return with_refresh(ops, body)

    return bind


def _online_numpy(sc: np.ndarray, m: np.ndarray, total: np.ndarray, rescale: np.ndarray, first: bool) -> None:
    """``numba_kernels.exp_rows_online`` in numpy passes (the same values)."""
    block_max = np.max(sc, axis=1)
    if first:
        np.maximum(block_max, F32_MIN, out=m)
    else:
        new = np.maximum(np.maximum(block_max, F32_MIN), m)
        np.subtract(m, new, out=rescale)
        np.exp(rescale, out=rescale)
        m[:] = new
    np.subtract(sc, m[:, None], out=sc)
    np.exp(sc, out=sc)
    block_sum = np.sum(sc, axis=1)
    if first:
        total[:] = block_sum
    else:
        np.multiply(total, rescale, out=total)
        np.add(total, block_sum, out=total)
