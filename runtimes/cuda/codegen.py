"""CUDA C generation from small templates: storage types, view index arithmetic, Elementwise expressions.

Everything a kernel reads goes through a view (``graph.view.BoundView``: shape, strides, offset, per-axis
validity mask) with concrete dims, so the generated index arithmetic divides by constants - except by symbolic
dims, which arrive as ``symdims.SymInt``s and print as expressions over the kernel's dim arguments. Axes are
addressed in *groups*: a group of adjacent axes shares one linear index (an Elementwise kernel has one group, a
row kernel two: the rows and the last axis); inside a group, axes that every view lays out contiguously are merged
first, so a contiguous operand costs one multiply-add, not a division per axis. A read outside a view's mask, or
outside the producer's buffer, yields 0 without touching memory (the reference interpreter's semantics).

The Elementwise language (``runtimes/kernels/expression.py``) types as the numpy runtime does: floats compute in
f32, integers in their own type, ``LessThan`` gives bool, a constant takes its partner's type; the result converts
to the output dtype. Constants are emitted as exact hexadecimal float literals.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from luminal_recipes.graph.dtypes import DType, to_dtype
from luminal_recipes.graph.view import BoundView
from luminal_recipes.runtimes.kernels import expression as _expr
from luminal_recipes.runtimes.kernels.expression import Expr, parse

from . import symdims

# storage dtype -> C type of a buffer element (common.cuh's typedefs)
STORAGE = {
    DType.F32: "float", DType.F16: "f16", DType.BF16: "bf16", DType.F8E4M3: "f8e4m3", DType.F8E5M2: "f8e5m2",
    DType.I32: "int", DType.U8: "u8", DType.BOOL: "bool", DType.F4E2M1: "f4e2m1",
}
INT32_MAX = 2**31 - 1


class CodegenError(ValueError):
    """A node the CUDA code generator cannot express (named by the caller)."""


def ctype(dtype) -> str:
    d = to_dtype(np.dtype(dtype)) if not isinstance(dtype, DType) else dtype
    if d not in STORAGE:
        raise CodegenError(f"dtype {d} has no CUDA storage type (supported: {', '.join(str(k) for k in STORAGE)})")
    return STORAGE[d]


def compute_type(dtype) -> str:
    """The C type values of this storage dtype compute in: float for every float, integers as themselves."""
    c = ctype(dtype)
    return c if c in ("int", "u8", "bool") else "float"


def float_literal(value: float) -> str:
    v = float(np.float32(value))
    if math.isnan(v):
        return "f32_bits(0x7fc00000u)"
    if math.isinf(v):
        return "f32_bits(0x7f800000u)" if v > 0 else "f32_bits(0xff800000u)"
    return f"{v.hex()}f" if v != 0 or math.copysign(1, v) > 0 else "-0.0f"


def index_type(*extents: int) -> str:
    return "int" if max((abs(int(e)) for e in extents), default=0) <= INT32_MAX else "long long"


def kernel_name(prefix: str, text: str) -> str:
    """A name unique to the kernel's text (identical kernels of repeated blocks are compiled once)."""
    return f"{prefix}_{hashlib.sha1(text.encode()).hexdigest()[:12]}"


# ---- views ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """One view read by a kernel: the view, the producer buffer's element count and storage dtype."""

    view: BoundView
    size: int
    dtype: np.dtype


def _mask(bv: BoundView, axis: int) -> tuple[int, int]:
    return (0, bv.shape[axis]) if bv.mask is None else bv.mask[axis]


def _trivial(bv: BoundView, axis: int) -> bool:
    lo, hi = _mask(bv, axis)
    return lo <= 0 and hi >= bv.shape[axis]


def statically_in_bounds(bv: BoundView, size: int) -> bool:
    if 0 in bv.shape:
        return True
    lo = bv.offset + sum((d - 1) * s for d, s in zip(bv.shape, bv.strides) if s < 0)
    hi = bv.offset + sum((d - 1) * s for d, s in zip(bv.shape, bv.strides) if s > 0)
    return lo >= 0 and hi < size


@dataclass
class Indexing:
    """Generated index arithmetic: ``stmts`` compute, from one linear index per group, each view's ``flats`` (an
    element index into its buffer) and ``valids`` (a C condition, or None when always valid; "false" when never)."""

    stmts: list[str]
    flats: list[str]
    valids: list[str | None]


def index_code(shape: tuple[int, ...], groups: list[tuple[int, int]], operands: list[Operand],
               group_vars: list[str], itype: str, tag: str = "") -> Indexing:
    """Index arithmetic for ``operands`` (all viewed at ``shape``) from linear indices ``group_vars``, one per
    axis range in ``groups`` (row-major inside a group)."""
    stmts: list[str] = []
    flats = [f"{op.view.offset}" for op in operands]
    conds: list[list[str]] = [[] for _ in operands]
    never = [False] * len(operands)
    for g, ((a, b), var) in enumerate(zip(groups, group_vars)):
        axes = []  # merged axes of this group: (extent, [stride per operand], [mask per operand or None])
        for k in range(a, b):
            d = shape[k]
            if d == 1 and not symdims.is_sym(d):  # any stride; only a mask that excludes index 0 matters
                for i, op in enumerate(operands):
                    lo, hi = _mask(op.view, k)
                    if not (lo <= 0 < hi):
                        never[i] = True
                continue
            strides = [op.view.strides[k] for op in operands]
            masks = [None if _trivial(op.view, k) else _mask(op.view, k) for op in operands]
            if axes and all(m is None for m in masks) and all(m is None for m in axes[-1][2]) and all(
                    symdims.same(s_prev, s * d) for s_prev, s in zip(axes[-1][1], strides)):
                prev = axes[-1]
                axes[-1] = (prev[0] * d, strides, prev[2])
                continue
            axes.append((d, strides, masks))
        rem = var
        for j in range(len(axes) - 1, -1, -1):
            d, strides, masks = axes[j]
            c = f"c{tag}{g}_{j}"
            if j == 0:
                stmts.append(f"const {itype} {c} = {rem};")
            else:
                dc = f"({itype}){d}" if symdims.is_sym(d) else f"{d}"  # divide in the index type
                stmts.append(f"const {itype} {c} = {rem} % {dc};")
                q = f"q{tag}{g}_{j}"
                stmts.append(f"const {itype} {q} = {rem} / {dc};")
                rem = q
            for i, (s, m) in enumerate(zip(strides, masks)):
                if s == 1 and not symdims.is_sym(s):
                    flats[i] += f" + {c}"
                elif s != 0:
                    flats[i] += f" + {c} * ({itype}){s}"
                if m is not None:
                    lo, hi = max(m[0], 0), min(m[1], d)
                    if lo >= hi:
                        never[i] = True
                    else:
                        if lo > 0:
                            conds[i].append(f"{c} >= {lo}")
                        if hi < d:
                            conds[i].append(f"{c} < {hi}")
    valids: list[str | None] = []
    for i, op in enumerate(operands):
        flat = f"f{tag}{i}"
        stmts.append(f"const {itype} {flat} = {flats[i]};")
        flats[i] = flat
        if never[i] or 0 in op.view.shape:
            valids.append("false")
            continue
        cond = list(conds[i])
        if not statically_in_bounds(op.view, op.size):
            cond.append(f"{flat} >= 0 && {flat} < ({itype}){op.size}")
        valids.append(" && ".join(f"({c})" for c in cond) if cond else None)
    return Indexing(stmts, flats, valids)


def load_expr(ptr: str, flat: str, valid: str | None, storage: np.dtype) -> str:
    """A read of ``ptr[flat]`` in its compute type (f32 for every float), 0 where ``valid`` fails (memory
    untouched)."""
    ct = compute_type(storage)
    value = f"to_f32({ptr}[{flat}])" if ct == "float" else f"{ptr}[{flat}]"
    zero = "0.0f" if ct == "float" else ("false" if ct == "bool" else f"({ct})0")
    if valid == "false":
        return zero
    return value if valid is None else f"(({valid}) ? {value} : {zero})"


def is_contiguous_from(op: Operand, n: int) -> int | None:
    """The element offset when the operand reads ``n`` consecutive elements of its buffer in order (no mask,
    in bounds), else None."""
    bv = op.view
    if 0 in bv.shape or not all(_trivial(bv, k) for k in range(len(bv.shape))):
        return None
    expect = 1
    for d, s in zip(reversed(bv.shape), reversed(bv.strides)):
        if (d != 1 or symdims.is_sym(d)) and s != expect:  # (a symbolic dim is not taken to be 1)
            return None
        expect *= d
    return bv.offset if bv.offset >= 0 and bv.offset + n <= op.size else None


def is_uniform(op: Operand) -> bool:
    """Every element reads the same buffer element (all strides 0, nothing masked, in bounds)."""
    bv = op.view
    return (all(s == 0 or (d == 1 and not symdims.is_sym(d)) for d, s in zip(bv.shape, bv.strides))
            and all(_trivial(bv, k) for k in range(len(bv.shape))) and 0 <= bv.offset < op.size)


# ---- Elementwise expressions ---------------------------------------------------------------------------------
_FLOAT_UNARY = {"Log2": "log2f({})", "Exp2": "exp2f({})", "Exp": "expf({})", "Sin": "sinf({})",
                "Sqrt": "sqrtf({})", "Recip": "(1.0f / {})"}
# constant folding: runtimes/kernels/expression.py does it today; once the compiler's rules fold constants (issue 9) the
# expression arrives folded and this is the identity
_fold = getattr(_expr, "_fold", lambda e: e)


class ExprCompiler:
    """Compiles an Elementwise expression to C statements over per-element values ``v0, v1...`` (the inputs in
    their compute types), typed as ``runtimes/kernels/expression.py`` types it."""

    def __init__(self, text: str, in_dtypes: list[np.dtype], out_dtype: np.dtype):
        self.tree = _fold(parse(text))
        self.in_types = [compute_type(d) for d in in_dtypes]
        self.out_dtype = np.dtype(out_dtype)
        self.lines: list[str] = []
        self.count = 0
        for leaf in _leaves(self.tree):
            if not 0 <= leaf.index < len(in_dtypes):
                raise CodegenError(f"Elementwise expression reads in{leaf.index}, but the kernel has "
                                   f"{len(in_dtypes)} input(s)")
        self.used = sorted({leaf.index for leaf in _leaves(self.tree)})
        value, vtype = self._emit(self.tree, None)
        self.result = convert(value, vtype or "float", out_dtype)

    def _tmp(self, ctype_: str, text: str) -> str:
        name = f"t{self.count}"
        self.count += 1
        self.lines.append(f"const {ctype_} {name} = {text};")
        return name

    def _type_of(self, e: Expr) -> str | None:
        if e.op == "in":
            return self.in_types[e.index]
        if e.op == "const":
            return None
        if e.op == "Cast":
            d = e.dtype
            return "bool" if d == DType.BOOL else ("int" if d == DType.I32 else "u8" if d == DType.U8 else "float")
        if e.op in _FLOAT_UNARY:
            return "float"
        if e.op == "LessThan":
            return "bool"
        known = [t for t in (self._type_of(a) for a in e.args) if t is not None]
        return known[0] if known else "float"

    def _const(self, value: float, t: str) -> str:
        if t == "float":
            return float_literal(value)
        if t == "bool":
            return "true" if value != 0 else "false"
        return f"({t}){int(value)}"

    def _emit(self, e: Expr, want: str | None) -> tuple[str, str | None]:
        """C text of ``e`` and its type; a constant takes ``want`` (its partner's type)."""
        if e.op == "in":
            return f"v{e.index}", self.in_types[e.index]
        if e.op == "const":
            t = want or "float"
            return self._const(e.value, t), t
        if e.op == "Cast":
            src, st = self._emit(e.args[0], None)
            st = st or "float"
            d = e.dtype
            if d == DType.BOOL:
                return self._tmp("bool", f"{src} != ({st})0"), "bool"
            if d.is_int:
                t = "int" if d == DType.I32 else "u8"
                return self._tmp(t, f"({t})({src})"), t
            value = src if st == "float" else f"(float)({src})"
            if ctype(d) != "float":
                value = f"round_to<{ctype(d)}>({value})"
            return self._tmp("float", value), "float"
        if e.op in _FLOAT_UNARY:
            x, t = self._emit(e.args[0], "float")
            if t not in ("float", None):
                raise CodegenError(f"Elementwise: {e.op} needs a float operand, got {t}")
            return self._tmp("float", _FLOAT_UNARY[e.op].format(x)), "float"
        types = [self._type_of(a) for a in e.args]
        known = {t for t in types if t is not None}
        if len(known) > 1:
            raise CodegenError(f"Elementwise: {e.op} mixes operand types {sorted(known)}; the program must Cast "
                               "explicitly")
        t = known.pop() if known else "float"
        (a, _), (b, _) = (self._emit(x, t) for x in e.args)
        if e.op == "LessThan":
            return self._tmp("bool", f"{a} < {b}"), "bool"
        return self._tmp(t, _binary(e.op, t, a, b)), t


def _binary(op: str, t: str, a: str, b: str) -> str:
    if t == "float":
        return {"Add": f"{a} + {b}", "Mul": f"{a} * {b}", "Mod": f"fmodf({a}, {b})"}[op]
    if t == "bool":  # numpy: bool + bool is or, bool * bool is and
        return {"Add": f"{a} || {b}", "Mul": f"{a} && {b}", "Mod": "false"}[op]
    if t == "int":  # wrap on overflow as numpy does (unsigned arithmetic is defined in C)
        return {"Add": f"(int)((unsigned)({a}) + (unsigned)({b}))", "Mul": f"(int)((unsigned)({a}) * (unsigned)({b}))",
                "Mod": f"(({b}) == 0 ? 0 : ({a}) % ({b}))"}[op]
    return {"Add": f"(u8)({a} + {b})", "Mul": f"(u8)({a} * {b})", "Mod": f"(u8)(({b}) == 0 ? 0 : ({a}) % ({b}))"}[op]


def convert(value: str, vtype: str, out_dtype: np.dtype) -> str:
    """``value`` (of compute type ``vtype``) converted to the storage type of ``out_dtype``, as numpy's
    ``copyto(casting='unsafe')`` does."""
    out = ctype(out_dtype)
    if out == "bool":
        return value if vtype == "bool" else f"({value} != ({vtype})0)"
    if out in ("int", "u8"):
        if vtype == "float":
            return f"from_f32<{out}>({value})"
        return value if vtype == out else f"({out})({value})"
    f = value if vtype == "float" else f"to_f32({value})"
    return f if out == "float" else f"from_f32<{out}>({f})"


def _leaves(e: Expr):
    if e.op == "in":
        yield e
    for a in e.args:
        yield from _leaves(a)
