"""Row kernels: ``Softmax``, ``LayerNorm``, ``RMSNorm``, ``RMSNormRoPE`` and ``GroupNorm`` (compiled passes per row
where numba is installed, numpy passes per row tile otherwise)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from luminal_recipes.graph.view import BoundView

from ...kernels.context import Bind, KernelContext, Step
from ...views import in_bounds, is_unmasked, reshape_view
from .. import jit
from .. import threads as cpu_threads
from .common import F32, bind_all, with_refresh
from .operands import operand, row_tiles

ROW_TILE = 1 << 16  # elements per row tile of the norm/softmax kernels (cache-sized)


def _rows_prepare(ctx: KernelContext, temps: int) -> tuple:
    """Row-tiled view of a [..., N] kernel: operand as (R, N), work arrays per tile, row vectors."""
    if not ctx.inputs or tuple(ctx.inputs[0].view.shape) != ctx.shape or not ctx.shape:
        ctx.fail("expects one input viewed at the output shape [..., N]")
    n = ctx.shape[-1]
    rows = math.prod(ctx.shape[:-1])
    op = operand(ctx, 0, shape=(rows, n))
    tiles = row_tiles(rows, n, ROW_TILE)
    tile_rows = max((t.stop - t.start for t in tiles), default=0)
    work = None if ctx.dtype == F32 else ctx.scratch.add((tile_rows, n), F32)
    extra = [ctx.scratch.add((tile_rows, n), F32) for _ in range(temps)]
    vec = ctx.scratch.add((tile_rows,), F32)
    return op, n, rows, tiles, work, extra, vec


def _tile_views(out, x, scratch, n, rows, tiles, work, extra, vec):
    out2 = out.reshape(rows, n)
    views = []
    for t in tiles:
        r = t.stop - t.start
        o = out2[t]
        w = o if work is None else scratch[work][:r]
        views.append((x[t], w, o, [scratch[e][:r] for e in extra], scratch[vec][:r], scratch[vec][:r, None]))
    return views


def _prepare_compiled_rows(ctx: KernelContext, kernel: str, scalars=()) -> Bind | None:
    """A [..., N] row kernel as one compiled pass per row (``jit``), the rows split over the cores; None where
    numba is missing or the operand or output is not f32 (the numpy passes then). ``scalars``: the kernel's
    arguments after its arrays, or a function of the input buffers giving them (vectors read in place)."""
    if not ctx.inputs or tuple(ctx.inputs[0].view.shape) != ctx.shape or not ctx.shape:
        ctx.fail("expects one input viewed at the output shape [..., N]")
    n = ctx.shape[-1]
    rows = math.prod(ctx.shape[:-1])
    if not jit.AVAILABLE or ctx.dtype != F32 or ctx.inputs[0].dtype != F32 or n == 0 or rows == 0:
        return None
    k = ctx.inputs[0]
    if reshape_view(k.view, (rows, n)) is None and is_unmasked(k.view) and in_bounds(k.view, k.size):
        return _prepare_compiled_blocks(ctx, kernel, scalars)
    op = operand(ctx, 0, shape=(rows, n))

    def bind(out, flats, scratch):
        x = op.bind(flats[0], scratch)
        args = scalars(flats) if callable(scalars) else scalars
        return with_refresh([op], jit.by_rows(getattr(jit.kernels(), kernel), [x, out.reshape(rows, n)], *args))

    return bind


def _prepare_compiled_blocks(ctx: KernelContext, kernel: str, scalars) -> Bind:
    """A row kernel on an operand whose rows no single stride reaches (e.g. per-head rows of a fused q/k/v
    projection, [H, S, D] with the heads D apart and the tokens 3HD apart): read in place as one [rows, N] block
    per index of the leading axes, instead of gathered into scratch first; the blocks' rows dealt out over the
    cores."""
    op = operand(ctx, 0)  # direct: the caller checked the view is unmasked and in bounds
    bv = ctx.inputs[0].view
    # rows contiguous inside (the usual case): read as slices of the flat buffer, which numba vectorises
    flat_kernel = _STRIDED_ROWS.get(kernel) if bv.strides[-1] == 1 or bv.shape[-1] == 1 else None
    # the longest row axis gives each block its rows, the others index the blocks: [1, S, H, D] with the heads
    # D apart is H blocks of S rows, not S blocks of H rows (a kernel call per block: FLUX.2's per-head q/k
    # norms at S = 1088, H = 4 took 2.8 ms a call as 1088 blocks, ~0.1 ms as 4)
    lead = len(ctx.shape) - 1
    big = max(range(lead), key=lambda a: (ctx.shape[a], a))
    order = [a for a in range(lead) if a != big] + [big, lead]
    strides = [bv.strides[a] for a in order]

    def bind(out, flats, scratch):
        x = op.bind(flats[0], scratch).transpose(order)  # at least 3 axes: two always merge into [rows, N]
        o = out.transpose(order)
        args = scalars(flats) if callable(scalars) else scalars
        fn = getattr(jit.kernels(), flat_kernel or kernel)

        def chunks_in_parts():  # (each row computed on its own: any cut gives the same bits)
            chunks = []
            for index in np.ndindex(*x.shape[:-2]):
                xb, ob = x[index], o[index]
                start = bv.offset + sum(i * st for i, st in zip(index, strides))
                for sl in cpu_threads.split(xb.shape[0], xb.shape[1]):
                    if flat_kernel is None:
                        chunks.append((xb[sl], ob[sl]))
                    else:
                        chunks.append((flats[0], start + sl.start * strides[-2], strides[-2], ob[sl]))
            # the whole's size decides, not a block's
            return chunks, cpu_threads.part_count(len(chunks), math.prod(x.shape))

        # (xb, ob, ...) or (flat, start, stride, ob, ...): a norm writes its rows' out only
        return _parallel_chunks(fn, chunks_in_parts, lambda i: args,
                                lambda a: (a[1],) if flat_kernel is None else (a[3],))

    return bind


# row kernels with a variant reading rows out of the flat buffer (``numba_kernels.rms_norm_strided``)
_STRIDED_ROWS = {"rms_norm_rows": "rms_norm_strided", "layer_norm_rows": "layer_norm_strided"}


def _row_chunks(fn, chunks: list[tuple], scalars: tuple) -> Step:
    def run() -> None:
        for args in chunks:
            fn(*args, *scalars)

    return run


def _parallel_chunks(fn, chunks_in_parts: Callable[[], tuple[list[tuple], int]],
                     scalars: Callable[[int], tuple], written: Callable[[tuple], tuple] | None = None) -> Step:
    """The chunks in parts (``chunks_in_parts()``: the chunks and how many parts; part i's scalars
    ``scalars(i)``), described for the chains (and described again for a chain's finer parts). ``written``: of a
    call's arguments, the arrays it writes (every other array is read: ``chain.Call.access``); None: not said."""
    def groups():
        chunks, count = chunks_in_parts()
        return [chunks[len(chunks) * i // count : len(chunks) * (i + 1) // count] for i in range(count)]

    def call(i, args):
        args = (*args, *scalars(i))
        if written is None:
            return fn, args, i
        writes = written(args)
        reads = tuple(a for a in args if isinstance(a, np.ndarray) and not any(a is w for w in writes))
        return fn, args, i, (reads, writes)

    def describe():
        return [call(i, args) for i, g in enumerate(groups()) for args in g]

    step = cpu_threads.parallel(_row_chunks(fn, g, scalars(i)) for i, g in enumerate(groups()))
    return jit.described(step, describe(), redescribe=describe)


def prepare_softmax(ctx: KernelContext) -> Bind:
    if len(ctx.inputs) != 1:
        ctx.fail("expects one input viewed at the output shape [..., N]")
    compiled = _prepare_compiled_rows(ctx, "softmax_rows")
    if compiled is not None:
        return compiled
    op, n, rows, tiles, work, extra, vec = _rows_prepare(ctx, 0)

    def bind(out, flats, scratch):
        (x,) = bind_all([op], flats, scratch)
        views = _tile_views(out, x, scratch, n, rows, tiles, work, extra, vec)

        def body():
            if n == 0:
                return
            for xt, w, o, _, v, col in views:
                np.max(xt, axis=1, out=v)
                np.subtract(xt, col, out=w, dtype=F32)
                np.exp(w, out=w)
                np.sum(w, axis=1, out=v)
                np.divide(w, col, out=w)
                if w is not o:
                    np.copyto(o, w, casting="unsafe")

        return with_refresh([op], body)

    return bind


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


# the compiled norms' scale and shift where they have none. Every vector is passed read-only (a weight is a
# read-only memory map, an activation is not): numba compiles one version per argument type, so one type here
# means the version ``jit.warm_up`` loads is the one every call uses, never one compiled in the middle of a run
_NO_VECTOR = _read_only(np.zeros(1, F32))


def _norm_vectors(affine: list) -> list[int] | None:
    """Where an affine norm's scale (and shift) (``affine``: those inputs) is one f32 vector [N] for every row,
    read in place: the offset of each in its buffer; None when one varies over the rows, is padded or strided, or
    is not f32 (then applied by numpy after the norm)."""
    offsets = []
    for k in affine:
        bv = k.view
        if k.dtype != F32 or not is_unmasked(bv) or not in_bounds(bv, k.size):
            return None
        if any(s != 0 and d != 1 for d, s in zip(bv.shape[:-1], bv.strides[:-1])):
            return None
        if bv.shape[-1] > 1 and bv.strides[-1] != 1:
            return None
        offsets.append(bv.offset)
    return offsets


def _prepare_norm(ctx: KernelContext, kernel: str, numpy_passes, eps: np.float32) -> Bind:
    """LayerNorm / RMSNorm, plain or affine (``out = norm(x) * scale [+ shift]``, the RMSNorm weight or the
    adaptive LayerNorm's modulation): one compiled pass per row, the affine part included while the row is in
    cache; else the compiled norm or numpy's passes, then the affine part as numpy passes."""
    affine = len(ctx.inputs) - 1
    if not ctx.shape or affine > 2 or any(tuple(k.view.shape) != ctx.shape for k in ctx.inputs):
        ctx.fail("expects x [..., N] and up to two affine operands (scale, shift), all viewed at the output shape")
    n = ctx.shape[-1]
    inv_n = np.float32(1.0 / n) if n else np.float32(0)
    offsets = _norm_vectors(ctx.inputs[1:]) if affine else []
    if offsets is not None:
        def vectors(flats):
            vecs = [_read_only(flats[1 + i][at : at + n]) for i, at in enumerate(offsets)]
            return (*vecs, *[_NO_VECTOR] * (2 - len(vecs)), affine, inv_n, eps)

        compiled = _prepare_compiled_rows(ctx, kernel, vectors if affine else (_NO_VECTOR, _NO_VECTOR, 0, inv_n, eps))
        if compiled is not None:
            return compiled
    plain = _prepare_compiled_rows(ctx, kernel, (_NO_VECTOR, _NO_VECTOR, 0, inv_n, eps)) or \
        numpy_passes(ctx, inv_n, eps)
    if not affine:
        return plain
    extra = [operand(ctx, i) for i in range(1, len(ctx.inputs))]

    def bind(out, flats, scratch):
        body = plain(out, flats, scratch)
        scale, *shift = [op.bind(flats[i + 1], scratch) for i, op in enumerate(extra)]

        def step():
            body()
            np.multiply(out, scale, out=out)
            for s in shift:
                np.add(out, s, out=out)

        return with_refresh(extra, step)

    return bind


def prepare_layernorm(ctx: KernelContext) -> Bind:
    return _prepare_norm(ctx, "layer_norm_rows", _layernorm_passes, np.float32(ctx.node.attr("eps", 1e-5)))


def _layernorm_passes(ctx: KernelContext, inv_n: np.float32, eps: np.float32) -> Bind:
    op, n, rows, tiles, work, extra, vec = _rows_prepare(ctx, 1)

    def bind(out, flats, scratch):
        x = op.bind(flats[0], scratch)
        views = _tile_views(out, x, scratch, n, rows, tiles, work, extra, vec)

        def body():
            for xt, w, o, (sq,), v, col in views:
                np.sum(xt, axis=1, out=v, dtype=F32)
                np.multiply(v, inv_n, out=v)
                np.subtract(xt, col, out=w, dtype=F32)  # d = x - mean
                np.multiply(w, w, out=sq)
                np.sum(sq, axis=1, out=v)
                np.multiply(v, inv_n, out=v)
                np.add(v, eps, out=v)
                np.sqrt(v, out=v)
                np.divide(np.float32(1), v, out=v)
                np.multiply(w, col, out=w)
                if w is not o:
                    np.copyto(o, w, casting="unsafe")

        return with_refresh([op], body)

    return bind


def prepare_rmsnorm(ctx: KernelContext) -> Bind:
    return _prepare_norm(ctx, "rms_norm_rows", _rmsnorm_passes, np.float32(ctx.node.attr("eps", 1e-6)))


def _rmsnorm_passes(ctx: KernelContext, inv_n: np.float32, eps: np.float32) -> Bind:
    op, n, rows, tiles, work, extra, vec = _rows_prepare(ctx, 0)

    def bind(out, flats, scratch):
        x = op.bind(flats[0], scratch)
        views = _tile_views(out, x, scratch, n, rows, tiles, work, extra, vec)

        def body():
            for xt, w, o, _, v, col in views:
                np.multiply(xt, xt, out=w, dtype=F32)
                np.sum(w, axis=1, out=v)
                np.multiply(v, inv_n, out=v)
                np.add(v, eps, out=v)
                np.sqrt(v, out=v)
                np.divide(np.float32(1), v, out=v)
                np.multiply(xt, col, out=w, dtype=F32)
                if w is not o:
                    np.copyto(o, w, casting="unsafe")

        return with_refresh([op], body)

    return bind


# ---- RMSNorm + RoPE ------------------------------------------------------------------------------------------
def _rope_layout(ctx: KernelContext) -> tuple[tuple[int, ...], int]:
    """(x's shape [..., S, D], D) after checking the operands against the output [..., S, D/2, 2]."""
    if len(ctx.inputs) != 4 or len(ctx.shape) < 3 or ctx.shape[-1] != 2:
        ctx.fail("expects x [..., S, D], scale at x's shape, cos and sin at the output shape [..., S, D/2, 2]")
    xs = tuple(ctx.inputs[0].view.shape)
    d = xs[-1] if xs else -1
    if (xs[:-1] != ctx.shape[:-2] or d != 2 * ctx.shape[-2] or tuple(ctx.inputs[1].view.shape) != xs
            or any(tuple(k.view.shape) != ctx.shape for k in ctx.inputs[2:])):
        ctx.fail(f"x {xs}, scale {tuple(ctx.inputs[1].view.shape)}, tables "
                 f"{[tuple(k.view.shape) for k in ctx.inputs[2:]]} do not fit an output {ctx.shape}")
    return xs, d


def _table_rows(ctx: KernelContext, i: int) -> BoundView | None:
    """Input ``i`` (a cos or sin table viewed at [..., S, D/2, 2]) as [..., S, D] with contiguous f32 rows read
    in place, or None."""
    k = ctx.inputs[i]
    if k.dtype != F32 or not is_unmasked(k.view) or not in_bounds(k.view, k.size):
        return None
    rv = reshape_view(k.view, ctx.shape[:-2] + (ctx.shape[-2] * 2,))
    return rv if rv is not None and (rv.strides[-1] == 1 or rv.shape[-1] == 1) else None


def prepare_rmsnorm_rope(ctx: KernelContext) -> Bind:
    """RMSNorm times its weight, then the rotary embedding of adjacent pairs, in one pass per row
    (``numba_kernels.rms_norm_rope_rows``: x, cos and sin read in place, the rows split over the cores) where
    everything is f32, the weight one vector and the rows contiguous; else numpy passes (same operations)."""
    xs, d = _rope_layout(ctx)
    eps = np.float32(ctx.node.attr("eps", 1e-6))
    inv_n = np.float32(1.0 / d) if d else np.float32(0)
    x_in = ctx.inputs[0]
    vec = _norm_vectors(ctx.inputs[1:2])
    tables = [_table_rows(ctx, i) for i in (2, 3)]
    x_direct = (x_in.dtype == F32 and is_unmasked(x_in.view) and in_bounds(x_in.view, x_in.size)
                and (x_in.view.strides[-1] == 1 or d == 1))
    if (jit.AVAILABLE and ctx.dtype == F32 and x_direct and vec is not None and None not in tables
            and math.prod(xs) > 0):
        return _prepare_compiled_rope(ctx, xs, d, vec[0], tables, inv_n, eps)
    return _rope_passes(ctx, xs, d, inv_n, eps)


def _prepare_compiled_rope(ctx: KernelContext, xs, d: int, w_at: int, tables, inv_n, eps) -> Bind:
    bv, (cv, sv) = ctx.inputs[0].view, tables
    lead = xs[:-2]
    work = ctx.scratch.add((cpu_threads.THREADS, 2 * d), F32)  # per part (core): a normed row, its pairs swapped

    def bind(out, flats, scratch):
        x, cos, sin = (_read_only(flats[i]) for i in (0, 2, 3))
        scale = _read_only(flats[1][w_at : w_at + d])
        out3 = out.reshape(-1, xs[-2], d)
        def chunks_in_parts():  # (each row computed on its own: any cut gives the same bits)
            chunks = []
            for b, index in enumerate(np.ndindex(*lead)):
                for sl in cpu_threads.split(xs[-2], d):
                    x0, c0, s0 = (v.offset + sum(i * st for i, st in zip(index, v.strides))
                                  + sl.start * v.strides[-2] for v in (bv, cv, sv))
                    chunks.append((x, x0, bv.strides[-2], out3[b, sl], scale, cos, c0, cv.strides[-2],
                                   sin, s0, sv.strides[-2]))
            # the whole's size decides, not a head's
            return chunks, cpu_threads.part_count(len(chunks), math.prod(xs))

        fn = jit.kernels().rms_norm_rope_rows
        # (x, x0, stride, out rows, ..., inv_n, eps, work): the rows and the part's scratch written
        return _parallel_chunks(fn, chunks_in_parts, lambda i: (inv_n, eps, scratch[work][i]),
                                lambda a: (a[3], a[-1]))

    return bind


def _rope_passes(ctx: KernelContext, xs, d: int, inv_n, eps) -> Bind:
    x_op = operand(ctx, 0, dtype=F32)
    ops = [x_op, operand(ctx, 1), operand(ctx, 2), operand(ctx, 3)]  # weight and tables read in place
    y_slot, v_slot = ctx.scratch.add(xs, F32), ctx.scratch.add(xs[:-1] + (1,), F32)
    t_slot = ctx.scratch.add(ctx.shape[:-1], F32)
    acc = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)

    def bind(out, flats, scratch):
        x, w, cos, sin = bind_all(ops, flats, scratch)
        y, v, t = scratch[y_slot], scratch[v_slot], scratch[t_slot]
        target = out if acc is None else scratch[acc]
        y5 = y.reshape(ctx.shape)
        y0, y1, o0, o1 = y5[..., 0], y5[..., 1], target[..., 0], target[..., 1]

        def body():
            np.multiply(x, x, out=y)
            np.sum(y, axis=-1, out=v[..., 0])
            np.multiply(v, inv_n, out=v)
            np.add(v, eps, out=v)
            np.sqrt(v, out=v)
            np.divide(np.float32(1), v, out=v)
            np.multiply(x, v, out=y)
            np.multiply(y, w, out=y, dtype=F32)  # y = (x * inv) * scale, as RMSNormScale
            np.multiply(y0, cos[..., 0], out=o0, dtype=F32)  # y0 * cos0 + y1 * (sin0 * -1)
            np.multiply(sin[..., 0], np.float32(-1), out=t, dtype=F32)
            np.multiply(y1, t, out=t)
            np.add(o0, t, out=o0)
            np.multiply(y1, cos[..., 1], out=o1, dtype=F32)  # y1 * cos1 + y0 * sin1
            np.multiply(y0, sin[..., 1], out=t, dtype=F32)
            np.add(o1, t, out=o1)
            if target is not out:
                np.copyto(out, target, casting="unsafe")

        return with_refresh(ops, body)

    return bind


# ---- GroupNorm -----------------------------------------------------------------------------------------------
def _group_norm_layout(ctx: KernelContext) -> tuple[int, int, int, int]:
    """(rows N*G, row length n, groups G, elements per channel hw) after checking x [N, G, n] against out [N, C,
    *spatial] (the rule matched the reshape structurally; the sizes are checked here, where they are concrete)."""
    if len(ctx.inputs) != 3 or len(ctx.inputs[0].view.shape) != 3 or len(ctx.shape) < 2 or \
            any(tuple(k.view.shape) != ctx.shape for k in ctx.inputs[1:]):
        ctx.fail("expects x [N, G, n], scale and shift viewed at the output shape [N, C, *spatial]")
    nb, groups, n = ctx.inputs[0].view.shape
    c, hw = ctx.shape[1], math.prod(ctx.shape[2:])
    if nb != ctx.shape[0] or groups == 0 or c % groups or n != (c // groups) * hw:
        ctx.fail(f"x {tuple(ctx.inputs[0].view.shape)} is not the {groups} groups of an output {ctx.shape}")
    return nb * groups, n, groups, hw


def _channel_vector(ctx: KernelContext, i: int) -> int | None:
    """Where input ``i`` (viewed at [N, C, *spatial]) is one contiguous f32 value per channel: its offset."""
    k = ctx.inputs[i]
    bv = k.view
    if k.dtype != F32 or not is_unmasked(bv) or not in_bounds(bv, k.size):
        return None
    if any(s != 0 and d != 1 for axis, (d, s) in enumerate(zip(bv.shape, bv.strides)) if axis != 1):
        return None
    return bv.offset if bv.shape[1] == 1 or bv.strides[1] == 1 else None


def prepare_groupnorm(ctx: KernelContext) -> Bind:
    """GroupNorm, its affine transform and (act 'silu') SiLU in one pass per group (``numba_kernels.group_norm_rows``,
    the rows split over the cores) where the output and x are f32 and the scale and shift one f32 value per
    channel; else numpy passes: the norm over x's [N*G, n] rows, then the affine transform and SiLU."""
    rows, n, groups, hw = _group_norm_layout(ctx)
    silu = ctx.node.attr("act", "") == "silu"
    eps = np.float32(ctx.node.attr("eps", 1e-5))
    inv_n = np.float32(1.0 / n) if n else np.float32(0)
    x_in, c = ctx.inputs[0], ctx.shape[1]
    vectors = [_channel_vector(ctx, i) for i in (1, 2)]
    if jit.AVAILABLE and ctx.dtype == F32 and x_in.dtype == F32 and None not in vectors and rows * n > 0:
        rv = reshape_view(x_in.view, (rows, n))
        in_place = (rv is not None and is_unmasked(rv) and in_bounds(rv, x_in.size)
                    and (rv.strides[1] == 1 or n == 1))
        x_op = None if in_place else operand(ctx, 0, dtype=F32, shape=(rows, n))  # gathered into scratch

        def bind(out, flats, scratch):
            if in_place:
                flat, start, stride = _read_only(flats[0]), rv.offset, rv.strides[0]
            else:
                flat, start, stride = _read_only(x_op.bind(flats[0], scratch).reshape(-1)), 0, n
            scale, shift = (_read_only(flats[1 + i][at : at + c]) for i, at in enumerate(vectors))
            out2, kernel = out.reshape(rows, n), jit.kernels("image").group_norm_rows
            parts = [lambda part=part: kernel(flat, start, stride, out2, part.start, part.stop, scale, shift,
                                               groups, hw, inv_n, eps, silu)
                     for part in cpu_threads.split(rows, n)]
            return with_refresh([] if x_op is None else [x_op], cpu_threads.parallel(parts))

        return bind
    x_op = operand(ctx, 0, dtype=F32, shape=(rows, n))
    ops = [x_op, operand(ctx, 1), operand(ctx, 2)]  # read in place (a broadcast weight is not copied out whole)
    acc = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    stats, work = ctx.scratch.add((rows, 1), F32), ctx.scratch.add(ctx.shape, F32)

    def bind(out, flats, scratch):
        x, scale, shift = bind_all(ops, flats, scratch)
        target = out if acc is None else scratch[acc]
        t2, v, w = target.reshape(rows, n), scratch[stats], scratch[work]

        def body():
            np.sum(x, axis=1, out=v[:, 0], dtype=F32)
            np.multiply(v, inv_n, out=v)
            np.subtract(x, v, out=t2, dtype=F32)  # d = x - mean
            np.square(t2, out=w.reshape(rows, n))
            np.sum(w.reshape(rows, n), axis=1, out=v[:, 0])
            np.multiply(v, inv_n, out=v)
            np.add(v, eps, out=v)
            np.sqrt(v, out=v)
            np.divide(np.float32(1), v, out=v)
            np.multiply(t2, v, out=t2)
            np.multiply(target, scale, out=target, dtype=F32)
            np.add(target, shift, out=target, dtype=F32)
            if silu:  # t * sigmoid(t), as ops.silu composes it: t * 1 / (e^-t + 1)
                np.negative(target, out=w)
                with np.errstate(over="ignore"):
                    np.exp(w, out=w)
                np.add(w, np.float32(1), out=w)
                np.divide(target, w, out=target)
            if target is not out:
                np.copyto(out, target, casting="unsafe")

        return with_refresh(ops, body)

    return bind

