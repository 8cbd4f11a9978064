"""The element-wise kernels: the HLIR primitives (unary, binary), Cast, and the fused ``Elementwise``
expression (numpy passes tile by tile, or one compiled pass over every core where all operands are f32)."""

from __future__ import annotations

import math

import numpy as np

from ...kernels.context import Bind, KernelContext
from ...kernels.expression import ElementwiseCode, ElementwisePlan
from .. import jit
from .. import threads as cpu_threads
from .common import F32, bind_all, with_refresh
from .operands import Operand, operand

JIT_TILE = 1024  # f32 elements per register of the compiled Elementwise kernel (a few registers fit L1)
# elements per part at least: a compiled pass does ~0.1 ns per element, so a smaller part costs less than handing
# it to another thread (20-50 us, far more when the machine is loaded and the worker waits for a core)
JIT_PART_ELEMS = 1 << 18


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
    """An all-f32 expression as one compiled pass (``numba_kernels.elementwise_tiles``): every tile of inputs is read
    once, evaluated in registers that stay in the L1 cache and written once, the output cut into one part per
    core."""
    regs = ctx.scratch.add((cpu_threads.THREADS, code.registers, JIT_TILE), F32)

    def bind(out, flats, scratch):
        arrays = bind_all(ops, flats, scratch)
        kernel = jit.kernels().elementwise_tiles

        def describe():  # per part its calls, and those calls described for the chains
            runs, described = [], []
            for part, boxes in enumerate(_compiled_boxes(out, arrays, len(scratch[regs]))):
                calls = [(code.code, code.consts, table, shape, scratch[regs][part]) for table, shape in boxes]
                runs.append(lambda calls=calls, refs=(out, arrays): [kernel(*call) for call in calls])
                # what its table's addresses reach: the inputs (read), the output and this part's registers
                described += [(kernel, call, part, ((*arrays,), (out, scratch[regs][part]))) for call in calls]
            return runs, described

        runs, described = describe()
        step = jit.described(cpu_threads.parallel(runs), described, redescribe=lambda: describe()[1])
        return with_refresh(ops, step)

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
    if dims[-1] < JIT_TILE and dims[-2] * dims[-1] < JIT_TILE and dims[-3] > dims[-2]:
        # a tile is rows of the middle axis: put the longer outer axis there (1088 tokens x 4 heads x 16: tiles
        # of 64 x 16 elements, not of 4 x 16 - a tile's fixed cost is ~0.3 us). Any order computes the same
        # values: every element is computed once, from the elements at its own index
        dims[-3], dims[-2] = dims[-2], dims[-3]
        for m in merged:
            m[-3], m[-2] = m[-2], m[-3]
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
    count = max(1, min(most, n, n * elements_per_item // cpu_threads.min_part(JIT_PART_ELEMS)))
    return [slice(n * i // count, n * (i + 1) // count) for i in range(count)]


