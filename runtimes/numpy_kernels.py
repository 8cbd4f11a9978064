"""numpy kernels: the HLIR primitives, fused elementwise, Concat and Copy, MatMul (BLAS), Softmax and norms,
Gather/Scatter, Conv2d.

A kernel is prepared once per program node (``prepare(ctx) -> bind``): it decides how to read each operand
(``views.Operand``) and which scratch arrays it needs (``ctx.scratch``, placed in the arena by the memory
planner). ``bind(out, flats, scratch)`` then receives the node's output array, every input's flat buffer and
the scratch arrays, precomputes every view it will touch, and returns the step the hot loop calls: ufuncs with
``out=`` into preallocated memory, nothing allocated beyond numpy's small internal buffers.

Semantics are graph.reference's (the oracle); float kernels other than the primitives compute in f32.
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

from luminal_recipes.errors import InputError
from luminal_recipes.graph.dtypes import DType
from luminal_recipes.graph.view import BoundView

from . import amx, cblas, cpu_threads, jit
from .expr import ElementwiseCode, ElementwisePlan
from .kernels.context import Bind, KernelContext, Step
from .kernels.fused import conv_windows
from .views import Operand, in_bounds, is_unmasked, operand, reshape_view, row_tiles, strided, zero_padded

F32 = np.dtype(np.float32)
FLOAT_STORAGE = {d.np for d in DType if d.is_float}  # ml_dtypes' floats have numpy kind "V"
F32_MIN = np.float32(np.finfo(np.float32).min)
ROW_TILE = 1 << 16  # elements per row tile of the norm/softmax kernels (cache-sized)
CONV_TILE = 1 << 20  # elements of the im2col scratch per tile
# the compiled direct convolution (numpy_jit.conv_kw3_rows) where it beats im2col + BLAS on this project's CPU:
# long rows, few output channels (measured: 16 -> 16 channels at 256x256 2.6 ms vs 12 ms; 128 -> 128 at 32x32
# 6.8 ms vs 2.8 ms)
DIRECT_CONV_MIN_WIDTH = 96
DIRECT_CONV_MAX_OUT = 64
# Winograd F(2x2, 3x3) (numpy_jit.winograd_*) for stride-1 3x3 convolutions with an even output size: 2.25x fewer
# multiplications than either path above, as 16 BLAS products per band of tiles. Measured on one core (the medium
# VAE's layers): 128 -> 128 channels at 32x32 1.7 ms (im2col + BLAS 11 ms, torch 2.0-3.0 ms), 16 -> 16 at 256x256
# 3.1 ms (direct 9.7 ms, torch 2.9-4.6 ms); with fewer than 4 input or output channels the products are too thin
# for BLAS (3 -> 16 at 256x256: 1.7 ms, direct 1.4 ms; 4 -> 8 at 128x128 0.31 ms, direct 0.35 ms). That was with
# the bands run from Python; with one compiled call per core (``numpy_jit.winograd_bands``, numpy's BLAS being
# OpenBLAS) any channel count gains (two cores, fastest of 150: 16 -> 3 at 256x256 0.86 ms, direct 1.26 ms; at
# 48x80 0.083 ms, direct 0.126, im2col 0.35; 3 -> 16 at 48x80 0.068, direct 0.084; 2 -> 8 at 64x64 0.041, direct
# 0.049).
WINOGRAD_MIN_CHANNELS = 4
WINOGRAD_MIN_CHANNELS_COMPILED = 1
# elements of one band's transformed tiles (16 x channels x tiles), so that they stay in L2 between the transform
# and the product (measured: 64 K elements 5.6-6.9 ms, 1 M elements 6.0-8.1 ms at 128 x 128 x 64 x 64)
WINOGRAD_BAND = 1 << 16
# rows of tiles left unused between the 16 planes of a band's transformed input: a full band's plane is 16 KiB,
# so without a gap the planes the input transform writes in turn fall on the same L1 sets and 4 KiB-alias its
# loads (measured on one core: the transform's time varied up to 1.5x with the buffers' addresses, 10-40% slower)
WINOGRAD_PLANE_GAP = 1
OPENBLAS_THREADED_PRODUCT = 1 << 18  # m * n * k above which OpenBLAS runs a product on its threads
JIT_TILE = 1024  # f32 elements per register of the compiled Elementwise kernel (a few registers fit L1)
# elements per part at least: a compiled pass does ~0.1 ns per element, so a smaller part costs less than handing
# it to another thread (20-50 us, far more when the machine is loaded and the worker waits for a core)
JIT_PART_ELEMS = 1 << 18


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype in FLOAT_STORAGE


def with_refresh(operands: list[Operand], body: Step) -> Step:
    """Run the operands' scratch copies (if any) before the body."""
    refreshes = [op.refresh for op in operands if op is not None and op.refresh is not None]
    if not refreshes:
        return body

    def step() -> None:
        for r in refreshes:
            r()
        body()

    return step


def view_reshape(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``arr`` at ``shape`` as a view, or ``None`` where numpy would have to copy (a copy made at bind time
    would go stale: the hot loop must read the live buffer)."""
    try:
        return np.reshape(arr, shape, copy=False)
    except ValueError:
        return None


def bind_all(operands: list[Operand | None], flats: list, scratch: list) -> list:
    return [None if op is None else op.bind(flats[i], scratch) for i, op in enumerate(operands)]


# ---- primitives --------------------------------------------------------------------------------------------
_UNARY = {"Log2": np.log2, "Exp2": np.exp2, "Sin": np.sin, "Sqrt": np.sqrt}
_BINARY = {"Add": np.add, "Mul": np.multiply, "Mod": np.fmod, "LessThan": np.less}


EXACT_OPS = ("Add", "Mul", "Mod", "Recip", "Sqrt")  # one IEEE operation: numba's bits are numpy's


def _compiled_primitive(ctx: KernelContext) -> Bind | None:
    """An f32 primitive with exactly rounded results as the compiled Elementwise pass (both cores, operands read
    in place), or None (numpy's ufunc then)."""
    if not jit.AVAILABLE or ctx.node.op not in EXACT_OPS or ctx.dtype != F32:
        return None
    if any(k.dtype != F32 or tuple(k.view.shape) != ctx.shape for k in ctx.inputs):
        return None
    args = " ".join(f"in{i}" for i in range(len(ctx.inputs)))
    return _prepare_expression(ctx, f"({ctx.node.op} {args})")


def prepare_unary(ctx: KernelContext) -> Bind:
    compiled = _compiled_primitive(ctx)
    if compiled is not None:
        return compiled
    op = operand(ctx, 0)
    name = ctx.node.op

    def bind(out, flats, scratch):
        (x,) = bind_all([op], flats, scratch)
        if name == "Recip":
            one = out.dtype.type(1)
            return with_refresh([op], lambda: np.divide(one, x, out=out))
        fn = _UNARY[name]
        return with_refresh([op], lambda: fn(x, out=out))

    return bind


def prepare_binary(ctx: KernelContext, op: str | None = None) -> Bind:
    compiled = _compiled_primitive(ctx) if op is None else None
    if compiled is not None:
        return compiled
    ops = [operand(ctx, 0), operand(ctx, 1)]
    fn = _BINARY[op or ctx.node.op]

    def bind(out, flats, scratch):
        a, b = bind_all(ops, flats, scratch)
        return with_refresh(ops, lambda: fn(a, b, out=out))

    return bind


def _box(bv: BoundView) -> tuple[tuple[slice, ...], BoundView] | None:
    """Where a (possibly padded) view holds data, one slice per axis, and the unmasked view of just that box;
    None when it holds none."""
    box = [(0, d) if bv.mask is None else (max(lo, 0), min(hi, d)) for (lo, hi), d in
           zip(bv.mask or [(0, d) for d in bv.shape], bv.shape)]
    if any(lo >= hi for lo, hi in box):
        return None
    offset = bv.offset + sum(lo * st for (lo, _), st in zip(box, bv.strides))
    return tuple(slice(lo, hi) for lo, hi in box), BoundView(tuple(hi - lo for lo, hi in box), bv.strides,
                                                            offset, None)


def _disjoint(a: tuple[slice, ...], b: tuple[slice, ...]) -> bool:
    return any(x.stop <= y.start or y.stop <= x.start for x, y in zip(a, b))


def prepare_concat(ctx: KernelContext) -> Bind:
    """``Concat``: the sum of two zero-padded views (how concat and stack are written: ``pad(a) + pad(b)``)."""
    if len(ctx.inputs) != 2 or any(tuple(k.view.shape) != ctx.shape for k in ctx.inputs):
        ctx.fail("expects two inputs viewed at the output shape")
    return prepare_padded_add(ctx) or prepare_binary(ctx, "Add")


def prepare_padded_add(ctx: KernelContext) -> Bind | None:
    """The sum of zero-padded views computed box by box into the output: each operand's data is added where it
    has data, and zeros are written only where neither has any (the generic path would first gather each
    operand, padding included, into scratch). None for the layouts and dtypes it does not handle."""
    edges = [k.view for k in ctx.inputs]
    parts = [_box(bv) for bv in edges]
    native = all(k.dtype == ctx.dtype and k.dtype.kind == "f" for k in ctx.inputs)
    if len(edges) != 2 or all(bv.mask is None for bv in edges) or not native or None in parts:
        return None
    if not all(in_bounds(inner, k.size) for (_, inner), k in zip(parts, ctx.inputs)):
        return None
    (box_a, _), (box_b, _) = parts
    count = [math.prod(sl.stop - sl.start for sl in box) for box, _ in parts]
    # the two boxes tile the output (a concatenation): no zeros to write, and no element sums two values
    tiled = _disjoint(box_a, box_b) and sum(count) == math.prod(ctx.shape)
    zero = ctx.dtype.type(0)

    # an operand with data everywhere goes first and initialises the output (the planner may have put the
    # output in that operand's buffer, never in a padded one's: so both full is left to the generic path)
    order = sorted(range(2), key=lambda i: -count[i])
    first_full = count[order[0]] == math.prod(ctx.shape)
    if count[order[1]] == math.prod(ctx.shape):
        return None

    def bind(out, flats, scratch):
        (dst0, src0), (dst1, src1) = [(out[parts[i][0]], strided(flats[i], parts[i][1])) for i in order]

        def add(d, a, b):
            return lambda: np.add(a, b, out=d)

        # each operand's box in parts per core; 0 + x, as the padded sum has it (-0.0 comes out +0.0)
        if tiled or first_full:
            first = cpu_threads.parallel([add(d, s, zero) for d, s in _split_pair(dst0, src0)])
        else:
            first = cpu_threads.parallel([add(d, d, s) for d, s in _split_pair(dst0, src0)])
        if tiled:
            second = cpu_threads.parallel([add(d, s, zero) for d, s in _split_pair(dst1, src1)])
        else:
            second = cpu_threads.parallel([add(d, d, s) for d, s in _split_pair(dst1, src1)])

        def body():
            if not (tiled or first_full):
                out.fill(0)
            first()
            second()

        return body

    return bind


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


def prepare_cast(ctx: KernelContext) -> Bind:
    op = operand(ctx, 0)
    to_bool = ctx.dtype == np.bool_

    def bind(out, flats, scratch):
        (x,) = bind_all([op], flats, scratch)
        if to_bool:
            zero = x.dtype.type(0)
            return with_refresh([op], lambda: np.not_equal(x, zero, out=out))
        # float -> int truncates toward zero (C semantics, as the reference's trunc + astype)
        return with_refresh([op], lambda: np.copyto(out, x, casting="unsafe"))

    return bind


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


# ---- fused elementwise -------------------------------------------------------------------------------------
def prepare_elementwise(ctx: KernelContext) -> Bind:
    expr = ctx.node.attr("expr")
    if not isinstance(expr, str):
        ctx.fail("needs a string attribute 'expr'")
    for i, k in enumerate(ctx.inputs):
        if tuple(k.view.shape) != ctx.shape:
            ctx.fail(f"input {i} is viewed at {k.view.shape}, not at the output shape {ctx.shape}")
    return _prepare_expression(ctx, expr)


def _prepare_expression(ctx: KernelContext, expr: str) -> Bind:
    ops = [operand(ctx, i) for i in range(len(ctx.inputs))]
    code = ElementwiseCode.of(expr, [op.dtype for op in ops], ctx.dtype) if jit.AVAILABLE else None
    if code is not None:
        return _prepare_compiled_expression(ctx, ops, code)
    plan = ElementwisePlan(expr, [op.dtype for op in ops], ctx.dtype)
    n = plan.tile_elems(ctx.shape)
    # the tiles split over the cores (numpy's ufuncs release the GIL), each part with its own registers
    parts = min(cpu_threads.THREADS, plan.tile_count(ctx.shape))
    regs = [[ctx.scratch.add((n,), d) for d in plan.registers] for _ in range(parts)]

    def bind(out, flats, scratch):
        arrays = bind_all(ops, flats, scratch)
        runs = [plan.bind(out, arrays, [scratch[r] for r in part_regs], (i, parts))
                for i, part_regs in enumerate(regs)]
        return with_refresh(ops, cpu_threads.parallel(runs))

    return bind


def _prepare_compiled_expression(ctx: KernelContext, ops: list[Operand], code: ElementwiseCode) -> Bind:
    """An all-f32 expression as one compiled pass (``numpy_jit.elementwise_tiles``): every tile of inputs is read
    once, evaluated in registers that stay in the L1 cache and written once, the output cut into one part per
    core."""
    regs = ctx.scratch.add((cpu_threads.THREADS, code.registers, JIT_TILE), F32)

    def bind(out, flats, scratch):
        arrays = bind_all(ops, flats, scratch)
        kernel = jit.kernels().elementwise_tiles
        runs = []
        for part, boxes in enumerate(_compiled_boxes(out, arrays, len(scratch[regs]))):
            calls = [(code.code, code.consts, table, shape, scratch[regs][part]) for table, shape in boxes]
            runs.append(lambda calls=calls, refs=(out, arrays): [kernel(*call) for call in calls])
        return with_refresh(ops, cpu_threads.parallel(runs))

    return bind


def _compiled_boxes(out: np.ndarray, inputs: list[np.ndarray],
                    max_parts: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The output and its inputs (views of its shape) as 3-axis boxes for ``elementwise_tiles``: per part (at
    most ``max_parts``, disjoint parts of the output), a list of ``(table, shape)``, ``table[k]`` the address and
    element strides of operand k (0 the output) at the box's origin. Unit axes are dropped and adjacent axes
    merged where every operand allows it; axes beyond three become one box per index."""
    arrays = [out, *inputs]
    shape = [d for d in out.shape if d != 1]
    strides = [[s // a.itemsize for d, s in zip(a.shape, a.strides) if d != 1] for a in arrays]
    dims: list[int] = []
    merged: list[list[int]] = [[] for _ in arrays]
    for axis, d in enumerate(shape):
        if dims and all(m[-1] == st[axis] * d for m, st in zip(merged, strides)):
            dims[-1] *= d
            for m, st in zip(merged, strides):
                m[-1] = st[axis]
        else:
            dims.append(d)
            for m, st in zip(merged, strides):
                m.append(st[axis])
    while len(dims) < 3:
        dims.insert(0, 1)
        for m in merged:
            m.insert(0, 0)
    lead, box = dims[:-3], dims[-3:]
    base = [a.__array_interface__["data"][0] for a in arrays]
    item = out.itemsize

    def table(origin: list[int]) -> np.ndarray:
        return np.array([[b + item * sum(i * s for i, s in zip(origin, m)), *m[-3:]]
                         for b, m in zip(base, merged)], np.int64)

    if math.prod(dims) == 0:
        return [[]]
    if lead:  # one box per leading index, the boxes dealt out over the cores
        boxes = [(table(list(index) + [0, 0, 0]), np.array(box, np.int64)) for index in np.ndindex(*lead)]
        return [boxes[sl] for sl in _parts(len(boxes), math.prod(box), max_parts)]
    axis = 0 if box[0] >= max_parts else 1 if box[1] >= 2 else 2
    parts = _parts(box[axis], math.prod(box) // box[axis], max_parts)
    out_parts = []
    for sl in parts:
        origin = [0, 0, 0]
        origin[axis] = sl.start
        shape_part = list(box)
        shape_part[axis] = sl.stop - sl.start
        out_parts.append([(table(origin), np.array(shape_part, np.int64))])
    return out_parts


def _parts(n: int, elements_per_item: int, most: int) -> list[slice]:
    """``range(n)`` in at most ``most`` near-equal parts of at least ``JIT_PART_ELEMS`` elements each."""
    count = max(1, min(most, n, n * elements_per_item // JIT_PART_ELEMS))
    return [slice(n * i // count, n * (i + 1) // count) for i in range(count)]


def _complement(box: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Disjoint boxes covering ``shape`` outside ``box``: per axis, the parts before and after the box's range
    (within the box on earlier axes, whole on later ones)."""
    out = []
    for axis, (sl, d) in enumerate(zip(box, shape)):
        for part in (slice(0, sl.start), slice(sl.stop, d)):
            if part.start < part.stop:
                out.append(box[:axis] + (part,) + tuple(slice(0, e) for e in shape[axis + 1 :]))
    return out


def prepare_copy(ctx: KernelContext) -> Bind:
    """``Copy``: one strided copy of the data into the output (no tiling: there are no temporaries to keep in
    cache) and zeros written where the view is padding, instead of gathering the padded operand into scratch
    and copying that; a view that reads past its buffer is gathered (the reference reads zeros there)."""
    if len(ctx.inputs) != 1 or tuple(ctx.inputs[0].view.shape) != ctx.shape:
        ctx.fail("expects one input viewed at the output shape")
    k = ctx.inputs[0]
    part = _box(k.view)
    if k.dtype != ctx.dtype or (part is not None and not in_bounds(part[1], k.size)):
        return _prepare_expression(ctx, "in0")

    def bind(out, flats, scratch):
        if part is None:  # all padding
            return lambda: out.fill(0)
        box, inner = part
        src, dst = strided(flats[0], inner), out[box]
        zeros = [out[b] for b in _complement(box, ctx.shape)]

        def copy(d, s):
            steps = _repeat_steps(d, s)
            if len(steps) == 1:
                return lambda: np.copyto(d, s)

            def run():
                for d_step, s_step in steps:
                    np.copyto(d_step, s_step)
            return run

        rows = _upsampled_rows(dst, src) if jit.AVAILABLE and not zeros else None
        if rows is not None:  # a 2x nearest-neighbour upsampling: one compiled pass, its rows split over the cores
            kernel, (src_rows, dst_rows) = jit.kernels().upsample2_rows, rows
            copies = cpu_threads.parallel([
                lambda part=part: kernel(src_rows, dst_rows, part.start, part.stop)
                for part in cpu_threads.split(src_rows.shape[0], 4 * src_rows.shape[1])])
        else:
            copies = cpu_threads.parallel([copy(d, s) for d, s in _split_pair(dst, src)])

        def body():
            for z in zeros:
                z.fill(0)
            copies()

        return body

    return bind


def _upsampled_rows(dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(src as [R, W], dst as [2R, 2W])`` where ``src`` is an f32 ``[..., H, 2, W, 2]`` view repeating each
    value along both 2-axes (stride 0; W with unit stride, H and the axes before it one run of rows) and ``dst``
    is contiguous: a 2x nearest-neighbour upsampling, ``numpy_jit.upsample2_rows``'s layout; else None."""
    if src.dtype != F32 or src.ndim < 4 or not dst.flags.c_contiguous:
        return None
    (h, two_h, w, two_w), (sh, zh, sw, zw) = src.shape[-4:], src.strides[-4:]
    if (two_h, two_w, zh, zw, sw) != (2, 2, 0, 0, 4) and not (w == 1 and (two_h, two_w, zh, zw) == (2, 2, 0, 0)):
        return None
    expected, rows = sh * h, h
    for d, stride in zip(reversed(src.shape[:-4]), reversed(src.strides[:-4])):
        if d != 1 and stride != expected:
            return None
        expected, rows = expected * d, rows * d
    src_rows = np.lib.stride_tricks.as_strided(src, (rows, w), (sh, 4), writeable=False)
    return src_rows, dst.reshape(2 * rows, 2 * w)


def _repeat_steps(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``np.copyto(dst, src)`` as copies to make in order, for a source that repeats its values along its innermost
    axis (stride 0, as a nearest-neighbour upsampling reads its input): numpy would run its inner loop over the
    repeats (two elements for a 2x upsampling, 2.5x slower than the steps here). Instead the first entry of
    every repeated axis is copied from ``src``, then repeated within ``dst``, innermost axis first (each copy's
    inner loop runs along a whole row). Any other pair is one copy."""
    axes = [a for a in range(src.ndim) if src.shape[a] > 1]
    repeated = [a for a in axes if src.strides[a] == 0]
    if not axes or axes[-1] not in repeated:
        return [(dst, src)]
    first = [slice(None)] * src.ndim
    for a in repeated:
        first[a] = slice(0, 1)
    steps = [(dst[tuple(first)], src[tuple(first)])]
    for a in reversed(repeated):  # fill axis a from its first entry, the axes inside it already whole
        rest, head = list(first), list(first)
        rest[a], head[a] = slice(1, None), slice(0, 1)
        steps.append((dst[tuple(rest)], dst[tuple(head)]))
        first[a] = slice(None)
    return steps


def _split_pair(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(dst, src)`` of the same shape cut along their first axis that has at least two entries into one pair of
    views per core (disjoint parts of ``dst``), or the whole pair when it is small."""
    axis = next((a for a, d in enumerate(dst.shape) if d >= 2), None)
    if axis is None:
        return [(dst, src)]
    index = (slice(None),) * axis
    parts = cpu_threads.split(dst.shape[axis], dst.size // dst.shape[axis])
    return [(dst[index + (sl,)], src[index + (sl,)]) for sl in parts]


# ---- MatMul ------------------------------------------------------------------------------------------------
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
    """An f32 MatMul's products on the CPU's AMX tiles (``runtimes/amx.py``: f32 accuracy from three bf16 parts
    of each operand) when both operands are f32, the CPU has AMX and the products are large enough: the plan
    (one part per core) and each part's scratch (packed bf16 parts of A and B, L2-sized). None: BLAS."""
    if any(i.dtype != F32 for i in ctx.inputs[:2]) or not amx.worth_it(m, k, n, min_side=amx.MIN_SIDE):
        return None
    plan = amx.plan(m, k, n, cpu_threads.THREADS)
    return plan, [[ctx.scratch.add(shape, dtype) for shape, dtype in plan.scratch_shapes] for _ in plan.parts]


# ---- softmax and norms -------------------------------------------------------------------------------------
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

    def bind(out, flats, scratch):
        x = op.bind(flats[0], scratch)  # at least 3 axes: two always merge into [rows, N]
        args = scalars(flats) if callable(scalars) else scalars
        chunks = []
        for index in np.ndindex(*x.shape[:-2]):
            xb, ob = x[index], out[index]
            start = bv.offset + sum(i * st for i, st in zip(index, bv.strides))
            for sl in cpu_threads.split(xb.shape[0], xb.shape[1]):
                if flat_kernel is None:
                    chunks.append((xb[sl], ob[sl]))
                else:
                    chunks.append((flats[0], start + sl.start * bv.strides[-2], bv.strides[-2], ob[sl]))
        fn = getattr(jit.kernels(), flat_kernel or kernel)
        count = cpu_threads.part_count(len(chunks), math.prod(x.shape))  # the whole's size decides, not a block's
        return cpu_threads.parallel(
            _row_chunks(fn, chunks[len(chunks) * i // count : len(chunks) * (i + 1) // count], args)
            for i in range(count))

    return bind


# row kernels with a variant reading rows out of the flat buffer (``numpy_jit.rms_norm_strided``)
_STRIDED_ROWS = {"rms_norm_rows": "rms_norm_strided", "layer_norm_rows": "layer_norm_strided"}


def _row_chunks(fn, chunks: list[tuple], scalars: tuple) -> Step:
    def run() -> None:
        for args in chunks:
            fn(*args, *scalars)

    return run


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
    (``numpy_jit.rms_norm_rope_rows``: x, cos and sin read in place, the rows split over the cores) where
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
        chunks = []
        for b, index in enumerate(np.ndindex(*lead)):
            for sl in cpu_threads.split(xs[-2], d):
                x0, c0, s0 = (v.offset + sum(i * st for i, st in zip(index, v.strides)) + sl.start * v.strides[-2]
                              for v in (bv, cv, sv))
                chunks.append((x, x0, bv.strides[-2], out3[b, sl], scale, cos, c0, cv.strides[-2],
                               sin, s0, sv.strides[-2]))
        fn = jit.kernels().rms_norm_rope_rows
        count = cpu_threads.part_count(len(chunks), math.prod(xs))  # the whole's size decides, not a head's
        return cpu_threads.parallel(
            _row_chunks(fn, chunks[len(chunks) * i // count : len(chunks) * (i + 1) // count],
                        (inv_n, eps, scratch[work][i]))
            for i in range(count))

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
    """GroupNorm, its affine transform and (act 'silu') SiLU in one pass per group (``numpy_jit.group_norm_rows``,
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
            out2, kernel = out.reshape(rows, n), jit.kernels().group_norm_rows
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


# ---- Conv2d ------------------------------------------------------------------------------------------------
def prepare_conv2d(ctx: KernelContext) -> Bind:
    """The convolution by the fastest path for its shape: Winograd F(2x2, 3x3) (stride-1 3x3 kernels, even output
    sizes, input and output channels >= ``WINOGRAD_MIN_CHANNELS_COMPILED``, or ``WINOGRAD_MIN_CHANNELS`` where its
    bands run from Python), the direct convolution (3 wide, wide rows, few output channels), else im2col + BLAS;
    the first two are compiled (numba), im2col is their numpy fallback."""
    if len(ctx.inputs) not in (2, 3):
        ctx.fail("expects inputs (x [N, C, H, W], w [O, C, kh, kw][, bias viewed at [N, O, Ho, Wo]])")
    (nb, c, h, w_), (o, c2, kh, kw) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    try:
        sh, sw = conv_windows((nb, c, h, w_), (o, c2, kh, kw), ctx.node.attr("stride", 1), ctx.shape)
    except ValueError as exc:
        ctx.fail(str(exc))
    ho, wo = ctx.shape[2], ctx.shape[3]
    if (jit.AVAILABLE and sh == sw == 1 and kh == kw == 3 and ho % 2 == 0 and wo % 2 == 0
            and min(c, o) >= (WINOGRAD_MIN_CHANNELS if cblas.sgemm() is None else WINOGRAD_MIN_CHANNELS_COMPILED)
            and math.prod(ctx.shape) > 0):
        return _prepare_winograd_conv(ctx)
    if (jit.AVAILABLE and sh == sw == 1 and kw == 3 and wo >= DIRECT_CONV_MIN_WIDTH and o <= DIRECT_CONV_MAX_OUT
            and math.prod(ctx.shape) > 0):
        return _prepare_direct_conv(ctx)
    return _prepare_im2col_conv(ctx)


def _prepare_im2col_conv(ctx: KernelContext) -> Bind:
    """im2col of a tile of output rows into scratch, its channels split over the cores, then one BLAS product per
    tile into the output, the bias added to the tile while it is in cache (1x1 kernels: no copy)."""
    (nb, c, h, w_), (o, _, kh, kw) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    sh, sw = conv_windows((nb, c, h, w_), (o, c, kh, kw), ctx.node.attr("stride", 1), ctx.shape)
    ho, wo = ctx.shape[2], ctx.shape[3]
    x_op = operand(ctx, 0, dtype=F32)
    w_op = operand(ctx, 1, dtype=F32, shape=(o, c * kh * kw), blas=True)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None
    ckk = c * kh * kw
    pointwise = kh == kw == 1 and sh == sw == 1
    tile_rows = max(1, min(ho, CONV_TILE // max(ckk * wo, 1)))
    cols = None if pointwise else ctx.scratch.add((ckk, tile_rows * wo), F32)
    acc = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    ops = [x_op, w_op, bias_op]
    # products too small to cut in chunks run on one BLAS thread, as MatMul's do (``_blas_product``): a two-threaded
    # call waits for its helper thread whenever the OS has descheduled it (the tiny VAE's last layer, 3 x 144 x
    # 3840: 0.3-0.4 ms on one thread; on two, median 8 ms with other jobs running)
    one_thread = cpu_threads.THREADS > 1 and o * ckk * (h * w_ if pointwise else tile_rows * wo) < 2 * BLAS_PART_MACS

    def bind(out, flats, scratch):
        x, w2, bias = bind_all(ops, flats, scratch)
        target = out if acc is None else scratch[acc]
        calls = []
        for i in range(nb):
            o2 = target[i].reshape(o, ho * wo)
            b2 = None if bias is None else view_reshape(bias[i], (o, ho * wo))
            xi = x[i]
            flat_x = view_reshape(xi, (c, h * w_)) if pointwise else None
            if flat_x is not None:
                calls.append(((), w2, flat_x, o2, b2, None))
            sc, sy, sx = xi.strides
            for r0 in range(0, ho, tile_rows) if flat_x is None else ():
                r = min(tile_rows, ho - r0)
                window = np.lib.stride_tricks.as_strided(
                    xi[:, r0 * sh :, :], (c, kh, kw, r, wo), (sc, sy, sx, sy * sh, sx * sw), writeable=False)
                buf = scratch[cols][:, : r * wo]
                dst5 = buf.reshape(window.shape)
                copies = cpu_threads.parallel([
                    (lambda d=dst5[part], s=window[part]: np.copyto(d, s))
                    for part in cpu_threads.split(c, kh * kw * r * wo)])
                cols_slice = slice(r0 * wo, (r0 + r) * wo)
                tile_bias = None if b2 is None else b2[:, cols_slice]
                calls.append(((copies,), w2, buf, o2[:, cols_slice], tile_bias, None))
            if bias is not None and b2 is None:  # a bias view that is not a per-tile slice: added at the end
                calls.append(((), None, None, target[i], None, bias[i]))

        def body():
            for copies, wm, buf, dst, tile_bias, whole_bias in calls:
                for copy in copies:
                    copy()
                if wm is not None:
                    np.matmul(wm, buf, out=dst)
                if tile_bias is not None:
                    np.add(dst, tile_bias, out=dst, dtype=F32)
                if whole_bias is not None:
                    np.add(dst, whole_bias, out=dst, dtype=F32)
            if acc is not None:
                np.copyto(out, target, casting="unsafe")

        def single_threaded():
            with cpu_threads.blas_single_threaded():
                body()

        return with_refresh(ops, single_threaded if one_thread else body)

    return bind


def _prepare_direct_conv(ctx: KernelContext) -> Bind:
    """numpy_jit.conv_kw3_rows on each image, its output rows split over the cores; the weight reordered to
    [C, kh, 3, O4] and a per-channel bias gathered into scratch at every run (a few kB: weights may stream),
    zero-padded to O4, the output channels rounded up to a multiple of 4 (the kernel's block)."""
    (nb, c, _, _), (o, _, kh, kw) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    ho, wo = ctx.shape[2], ctx.shape[3]
    x_op = operand(ctx, 0, dtype=F32)
    w_op = operand(ctx, 1, dtype=F32)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None  # read in place, any float type
    o4 = -(-o // 4) * 4
    wr = ctx.scratch.add((c, kh, kw, o4), F32)
    bias_vec = ctx.scratch.add((o4,), F32)
    acc_out = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    ops = [x_op, w_op, bias_op]

    def bind(out, flats, scratch):
        x, w, bias = bind_all(ops, flats, scratch)
        target = out if acc_out is None else scratch[acc_out]
        w_r, b_v = scratch[wr], scratch[bias_vec]
        kernel = jit.kernels().conv_kw3_rows
        per_channel = _per_channel_bias(bias)  # one value per output channel: it goes into the sums' start
        steps = []
        for i in range(nb):
            parts = [lambda i=i, rows=rows: kernel(x[i], w_r, b_v, target[i], rows.start, rows.stop)
                     for rows in cpu_threads.split(ho, o * wo * c * kh * kw)]
            steps.append(cpu_threads.parallel(parts))

        def body():
            np.copyto(w_r[..., :o], w.transpose(1, 2, 3, 0))
            w_r[..., o:] = 0
            _bias_vector(b_v, bias, per_channel)
            for step in steps:
                step()
            _conv_epilogue(out, target, bias, per_channel)

        return with_refresh(ops, body)

    return bind


def _per_channel_bias(bias: np.ndarray | None) -> bool:
    """A bias viewed at [N, O, Ho, Wo] that is one value per output channel (the usual [O] broadcast)."""
    return bias is not None and all(bias.strides[axis] == 0 or bias.shape[axis] == 1 for axis in (0, 2, 3))


def _bias_vector(b_v: np.ndarray, bias: np.ndarray | None, per_channel: bool) -> None:
    """The compiled paths' per-channel start values (zero past the bias's channels, or everywhere without one)."""
    b_v.fill(0)
    if per_channel:
        np.copyto(b_v[: bias.shape[1]], bias[0, :, 0, 0], casting="unsafe")


def _conv_epilogue(out: np.ndarray, target: np.ndarray, bias: np.ndarray | None, per_channel: bool) -> None:
    """A bias that varies over the image added whole; the f32 result cast into a lower-precision output."""
    if bias is not None and not per_channel:
        np.add(target, bias, out=target, dtype=F32)
    if target is not out:
        np.copyto(out, target, casting="unsafe")


def _prepare_winograd_conv(ctx: KernelContext) -> Bind:
    """Winograd F(2x2, 3x3) (numpy_jit.winograd_*): the images' 2x2 output tiles cut into bands of tile rows
    (``WINOGRAD_BAND``), which the cores take in turn (a core the OS gives less time simply does fewer bands;
    fixed halves left the other core waiting), each core with its own scratch: the input transform into ``v [16,
    C, tiles]`` (planes ``WINOGRAD_PLANE_GAP`` rows apart), 16 BLAS products ``[O, C] @ [C, tiles]``
    (single-threaded inside) into ``m [16, O, tiles]``, the output transform into the output rows, a per-channel
    bias added there. Where numpy's BLAS is OpenBLAS (``cblas.sgemm``) each core's share is one compiled call
    (``numpy_jit.winograd_bands``: tasks from an atomic counter, the weight transform in chunks among them, the
    products as direct ``cblas_sgemm`` calls); else the bands run from Python (``cpu_threads.claimed``). An f32
    input zero-padded on its rows and columns is read in place, the padding made by the input transform; any other
    input view is first gathered into scratch. The weight transform ``u [16, O, C]`` and the bias vector are made
    in scratch at every run (weights may stream)."""
    (nb, c, _, _), (o, _, _, _) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    th, tw = ctx.shape[2] // 2, ctx.shape[3] // 2
    x_in = ctx.inputs[0]
    padded = zero_padded(x_in.view, x_in.size, (2, 3)) if np.dtype(x_in.dtype) == F32 else None
    if padded is not None and padded[0].strides[3] != 1:
        padded = None  # the input transform reads rows with unit stride in place; others are gathered first
    x_op = operand(ctx, 0, dtype=F32) if padded is None else None
    (top, left) = (0, 0) if padded is None else padded[1]
    w_op = operand(ctx, 1, dtype=F32)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None  # read in place, any float type
    band = max(1, min(th, WINOGRAD_BAND // (16 * max(c, o) * tw)))
    bands = [(i, t0, min(t0 + band, th)) for i in range(nb) for t0 in range(0, th, band)]
    slots = min(len(bands), len(cpu_threads.split(nb * th, 16 * (c + o) * tw)))
    u_slot, bias_vec = ctx.scratch.add((16, o, c), F32), ctx.scratch.add((o,), F32)
    tiles = [(ctx.scratch.add((16, c + WINOGRAD_PLANE_GAP, band * tw), F32), ctx.scratch.add((16, o, band * tw), F32))
             for _ in range(slots)]
    acc_out = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    ops = [x_op, w_op, bias_op]
    # BLAS on one thread inside the parts, and for one part whose products OpenBLAS would thread (above its
    # m * n * k threshold, 2^18 by default): a two-threaded call waits for its descheduled helper thread
    one_blas_thread = slots > 1 or o * c * band * tw > OPENBLAS_THREADED_PRODUCT

    def bind(out, flats, scratch):
        x, w, bias = bind_all(ops, flats, scratch)
        if padded is not None:
            x = strided(flats[0], padded[0])
        target = out if acc_out is None else scratch[acc_out]
        u, b_v = scratch[u_slot], scratch[bias_vec]
        k = jit.kernels()
        per_channel = _per_channel_bias(bias)
        images, outputs = [x[i] for i in range(nb)], [target[i] for i in range(nb)]
        # per slot: its transform buffers, and the products' operands for each band height (made here, once)
        work = [(scratch[vs], scratch[ms], {r: (scratch[vs][:, :c, : r * tw], scratch[ms][:, :, : r * tw])
                                            for r in {t1 - t0 for _, t0, t1 in bands}}) for vs, ms in tiles]

        blas = cblas.sgemm()
        if blas is not None:  # one compiled call per core takes the weight chunks and bands in turn
            table = np.array(bands, np.int64).reshape(-1, 3)
            counter = np.zeros(1 + -(-o // k.WEIGHT_CHUNK), np.int64)  # next task, then a flag per chunk
            w_strides = np.array([stride // 4 for stride in w.strides], np.int64)
            parts = [functools.partial(k.winograd_bands, x, w.ctypes.data, w_strides, u, b_v, target, v, m, table,
                                       counter, tw, top, left, *blas) for v, m, _ in work]

            def step():
                counter[:] = 0
                cpu_threads.run_parts(parts)
        else:
            def task(slot: int, j: int) -> None:
                i, t0, t1 = bands[j]
                v, m, products = work[slot]
                v_band, m_band = products[t1 - t0]  # the band's first tiles
                k.winograd_input(images[i], v, t0, t1, tw, top, left)
                np.matmul(u, v_band, out=m_band)
                k.winograd_output(m, b_v, outputs[i], t0, t1, tw)

            step = cpu_threads.claimed(len(bands), slots, task)

        def body():
            if blas is None:
                k.winograd_weights(w, u)
            _bias_vector(b_v, bias, per_channel)
            with cpu_threads.blas_single_threaded() if one_blas_thread else contextlib.nullcontext():
                step()
            _conv_epilogue(out, target, bias, per_channel)

        return with_refresh(ops, body)

    return bind


PREPARE = {
    **{op: prepare_unary for op in ("Log2", "Exp2", "Sin", "Sqrt", "Recip")},
    **{op: prepare_binary for op in _BINARY},
    "SumReduce": prepare_reduce,
    "MaxReduce": prepare_reduce,
    "Cast": prepare_cast,
    "Gather": prepare_gather,
    "Scatter": prepare_scatter,
    "ScatterInPlace": prepare_scatter,
    "Elementwise": prepare_elementwise,
    "Concat": prepare_concat,
    "Copy": prepare_copy,
    "MatMul": prepare_matmul,
    "Softmax": prepare_softmax,
    "LayerNorm": prepare_layernorm,
    "RMSNorm": prepare_rmsnorm,
    "GroupNorm": prepare_groupnorm,
    "RMSNormRoPE": prepare_rmsnorm_rope,
    "Conv2d": prepare_conv2d,
}
