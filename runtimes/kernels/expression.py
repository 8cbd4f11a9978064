"""The ``Elementwise`` kernel's expression language: parsing, typing, and a numpy evaluation plan.

Grammar (s-expressions, as in ``program.KERNELS``)::

    expr := inK | number | (Const <number>) | (<Unary> expr) | (<Binary> expr expr) | (Cast <dtype> expr)

``Unary`` is one of ``Log2 Exp2 Exp Sin Sqrt Recip`` (``Exp`` is e^x), ``Binary`` one of ``Add Mul Mod
LessThan``. Floats compute
in f32 (whatever the inputs' storage dtype; f64 in f64), integers in their own dtype, ``LessThan`` yields bool; ``Cast``
has the reference interpreter's semantics (to bool: ``x != 0``; float to int: truncation; to a narrower float:
rounded to it, then held in f32). A constant takes the type of the operand it meets. The result is converted
to the output dtype.

The plan evaluates the expression as written: constant folding, reassociation and the choice of ``Exp`` over
``Exp2`` (numpy's ``exp`` is vectorised, its ``exp2`` calls libm once per element: 1.75 vs 5.6 ns per f32
element on this project's 2-core machine) are egglog rewrites (``compiler/rules/elementwise.egg``), chosen by
the numpy machine's op weights. A constant subexpression left in a text is evaluated like any other.

Evaluation runs tile by tile (a few hundred KiB per temporary), so a long chain reads each input once and
keeps its temporaries in cache. Temporaries are registers allocated by liveness in the expression tree; their
scratch arrays come from the memory plan.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from luminal_recipes.graph.dtypes import DType, is_float_storage, to_dtype

UNARY = {"Log2": np.log2, "Exp2": np.exp2, "Exp": np.exp, "Sin": np.sin, "Sqrt": np.sqrt, "Recip": None}
BINARY = {"Add": np.add, "Mul": np.multiply, "Mod": np.fmod, "LessThan": np.less}
F32, F64, BOOL = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.bool_)
TILE_ELEMS = 1 << 16  # elements per temporary: 256 KiB in f32, cache-sized


@dataclass(frozen=True)
class Expr:
    op: str  # "in", "const", a unary/binary op name, or "Cast"
    args: tuple = ()
    index: int = -1  # for "in"
    value: float = 0.0  # for "const"
    dtype: DType | None = None  # for "Cast"


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def parse(text: str) -> Expr:
    tokens = _TOKEN.findall(text)
    pos = 0

    def fail(why: str):
        raise ValueError(f"Elementwise expression {text!r}: {why}")

    def walk() -> Expr:
        nonlocal pos
        if pos >= len(tokens):
            fail("ends early")
        tok = tokens[pos]
        pos += 1
        if tok == ")":
            fail("unexpected ')'")
        if tok != "(":
            return _atom(tok, fail)
        if pos >= len(tokens):
            fail("ends early")
        head = tokens[pos]
        pos += 1
        if head == "Const":
            node = _number(tokens[pos] if pos < len(tokens) else "", fail)
            pos += 1
        elif head == "Cast":
            dtype = to_dtype(tokens[pos] if pos < len(tokens) else "?")
            pos += 1
            node = Expr("Cast", (walk(),), dtype=dtype)
        elif head in UNARY:
            node = Expr(head, (walk(),))
        elif head in BINARY:
            node = Expr(head, (walk(), walk()))
        else:
            fail(f"unknown operator {head!r}; expected Const, Cast, {', '.join(UNARY)}, {', '.join(BINARY)}")
        if pos >= len(tokens) or tokens[pos] != ")":
            fail(f"expected ')' after ({head} ...)")
        pos += 1
        return node

    tree = walk()
    if pos != len(tokens):
        fail("has trailing tokens")
    return tree


def _atom(tok: str, fail) -> Expr:
    m = re.fullmatch(r"in(\d+)", tok)
    if m:
        return Expr("in", index=int(m.group(1)))
    return _number(tok, fail)


def _number(tok: str, fail) -> Expr:
    try:
        return Expr("const", value=float(tok))
    except ValueError:
        fail(f"{tok!r} is neither an input (in0, in1...) nor a number")


# ---- typing ---------------------------------------------------------------------------
def _compute_dtype(storage: np.dtype) -> np.dtype:
    if storage == F64:
        return F64  # float64 (PyTorch's, through the torch backend) computes in f64
    return F32 if is_float_storage(storage) else storage


def _scalar(value: float, dtype: np.dtype):
    if dtype == BOOL:
        return np.bool_(value != 0)
    if dtype.kind in "iu":
        return dtype.type(int(value))
    return dtype.type(value)


# ---- evaluation plan ---------------------------------------------------------------------------------------
@dataclass
class _Instr:
    fn: Callable
    args: tuple  # ("in", k) | ("reg", r) | ("const", scalar)
    dest: tuple  # ("reg", r) | ("out",)
    kwargs: dict


class ElementwisePlan:
    """An expression compiled against its input dtypes and output dtype; ``registers`` are the scratch arrays
    it needs (dtype each, at tile size) and ``bind`` returns the step that evaluates it."""

    def __init__(self, text: str, in_dtypes: list[np.dtype], out_dtype: np.dtype):
        self.tree = parse(text)
        self.in_dtypes = [np.dtype(d) for d in in_dtypes]
        self.out_dtype = np.dtype(out_dtype)
        self.registers: list[np.dtype] = []
        self._free: list[int] = []
        self.instrs: list[_Instr] = []
        # a subexpression written several times (cos as 1 - 2 sin(x/2) sin(x/2)) is computed once: its register is
        # kept until its last reader (``_pins``: register -> readers left)
        self._uses = _repeated(self.tree)
        self._memo: dict[Expr, tuple] = {}
        self._pins: dict[int, int] = {}
        self._compile()

    # register allocation: a register is freed as soon as its value is consumed (expressions are trees)
    def _reg(self, dtype: np.dtype) -> int:
        for r in self._free:
            if self.registers[r] == dtype:
                self._free.remove(r)
                return r
        self.registers.append(np.dtype(dtype))
        return len(self.registers) - 1

    def _release(self, operand: tuple) -> None:
        if operand[0] == "reg":
            left = self._pins.get(operand[1], 1) - 1
            if left > 0:
                self._pins[operand[1]] = left
                return
            self._pins.pop(operand[1], None)
            self._free.append(operand[1])

    def _type(self, operand: tuple) -> np.dtype | None:
        kind = operand[0]
        if kind == "in":
            return _compute_dtype(self.in_dtypes[operand[1]])
        if kind == "reg":
            return self.registers[operand[1]]
        return None  # a constant adopts its partner's type

    def _compile(self) -> None:
        root = self.tree
        for leaf in _leaves(root):
            if not 0 <= leaf.index < len(self.in_dtypes):
                raise ValueError(f"Elementwise expression reads in{leaf.index}, but the kernel has "
                                 f"{len(self.in_dtypes)} input(s)")
        if root.op in ("in", "const"):
            self.root = self._operand(root)
            return
        result = self._emit(root, final=True)
        self.root = result

    def _operand(self, e: Expr) -> tuple:
        if e.op == "in":
            return ("in", e.index)
        if e.op == "const":
            return ("const", e.value)
        if e in self._memo:
            return self._memo[e]
        result = self._emit(e, final=False)
        if self._uses.get(e, 1) > 1 and result[0] == "reg":
            self._memo[e] = result
            self._pins[result[1]] = self._uses[e]
        return result

    def _emit(self, e: Expr, final: bool) -> tuple:
        ops = [self._operand(a) for a in e.args]
        types = [self._type(o) for o in ops]
        known = [t for t in types if t is not None]
        if e.op == "Cast":
            return self._emit_cast(e.dtype, ops[0], types[0] or F32, final)
        if e.op in UNARY:
            if known and known[0] not in (F32, F64):
                raise ValueError(f"Elementwise: {e.op} needs a float operand, got {known[0]}")
            ctype = rtype = known[0] if known else F32
        else:
            if len(set(known)) > 1:
                raise ValueError(f"Elementwise: {e.op} mixes operand types {sorted(map(str, set(known)))}; "
                                 "the program must Cast explicitly")
            ctype = known[0] if known else F32
            rtype = BOOL if e.op == "LessThan" else ctype
        ops = [("const", _scalar(o[1], ctype)) if o[0] == "const" else o for o in ops]
        for o in ops:
            self._release(o)
        dest = ("out",) if final and rtype == self.out_dtype else ("reg", self._reg(rtype))
        if e.op == "Recip":
            fn, args = np.divide, (("const", ctype.type(1)), ops[0])
        else:
            fn, args = (UNARY[e.op] if e.op in UNARY else BINARY[e.op]), tuple(ops)
        kwargs = {}
        if ctype in (F32, F64):  # compute in f32 whatever the inputs' storage dtype (f64 in f64)
            kwargs = {"signature": (ctype, ctype, BOOL)} if e.op == "LessThan" else {"dtype": ctype}
        self.instrs.append(_Instr(fn, args, dest, kwargs))
        return dest

    def _emit_cast(self, dtype: DType, op: tuple, src: np.dtype, final: bool) -> tuple:
        self._release(op)
        if dtype == DType.BOOL:
            target = BOOL
            dest = ("out",) if final and self.out_dtype == BOOL else ("reg", self._reg(BOOL))
            zero = ("const", _scalar(0, src))
            self.instrs.append(_Instr(np.not_equal, (op, zero), dest, {}))
            return dest
        target = dtype.np if dtype.is_int or dtype.np == F64 else F32
        if dtype.is_float and dtype.np not in (F32, F64):
            # round to the narrow float, then hold it in f32 (as the reference interpreter does)
            narrow = self._reg(dtype.np)
            self.instrs.append(_Instr(_copy, (op,), ("reg", narrow), {}))
            self._release(("reg", narrow))
            op = ("reg", narrow)
        dest = ("out",) if final and self.out_dtype == target else ("reg", self._reg(target))
        self.instrs.append(_Instr(_copy, (op,), dest, {}))
        return dest

    # ---- binding -------------------------------------------------------------------------------------------
    def bind(self, out: np.ndarray, inputs: list[np.ndarray], registers: list[np.ndarray],
             part: tuple[int, int] = (0, 1)) -> Callable[[], None]:
        """``inputs``: arrays of the output's shape (strided views are fine); ``registers``: flat scratch
        arrays of at least ``tile_elems(out.shape)`` elements each, one per ``self.registers``. ``part``
        ``(i, k)``: evaluate only the i-th of k contiguous runs of tiles (disjoint parts of the output, which
        may run in parallel, each with its own registers)."""
        calls = []
        tiles = _tiles(out.shape, TILE_ELEMS)[0]
        i, k = part
        for index in tiles[len(tiles) * i // k : len(tiles) * (i + 1) // k]:
            o = out[index]
            regs = [r[: o.size].reshape(o.shape) for r in registers]
            ins = [a[index] for a in inputs]

            def resolve(operand, ins=ins, regs=regs, o=o):
                kind = operand[0]
                return ins[operand[1]] if kind == "in" else regs[operand[1]] if kind == "reg" else \
                    o if kind == "out" else operand[1]

            for ins_ in self.instrs:
                calls.append((ins_.fn, tuple(resolve(a) for a in ins_.args), resolve(ins_.dest), ins_.kwargs))
            if self.root[0] != "out":
                calls.append((_copy, (resolve(self.root),), o, {}))
        return _runner(calls)

    @staticmethod
    def tile_count(shape: tuple[int, ...]) -> int:
        """How many tiles ``bind`` cuts the output into."""
        cut = _tile_rows(shape, TILE_ELEMS)
        if cut is None:
            return 1
        k, rows, _ = cut
        return math.prod(shape[: k - 1]) * -(-shape[k - 1] // rows)

    @staticmethod
    def tile_elems(shape: tuple[int, ...]) -> int:
        """Elements in the largest tile: the size of every register (computed without listing the tiles)."""
        cut = _tile_rows(shape, TILE_ELEMS)
        return math.prod(shape) if cut is None else cut[1] * cut[2]


def _copy(src, out=None):
    np.copyto(out, src, casting="unsafe")


def _runner(calls):
    def run() -> None:
        for fn, args, out, kwargs in calls:
            fn(*args, out=out, **kwargs)

    return run


def _leaves(e: Expr):
    if e.op == "in":
        yield e
    for a in e.args:
        yield from _leaves(a)


def _tile_rows(shape: tuple[int, ...], budget: int) -> tuple[int, int, int] | None:
    """How ``_tiles`` cuts ``shape``: ``(k, rows, inner)`` = ranges of ``rows`` along axis ``k - 1`` of
    ``inner`` elements each; None when the whole array is one tile."""
    if not shape or math.prod(shape) <= budget:
        return None
    k = next(k for k in range(1, len(shape) + 1) if math.prod(shape[k:]) <= budget)
    inner = math.prod(shape[k:])
    return k, min(max(1, budget // inner), shape[k - 1]), inner


def _tiles(shape: tuple[int, ...], budget: int) -> tuple[list[tuple], int]:
    """Index tuples that cut ``shape`` into pieces of at most ``budget`` elements (whole trailing axes, a
    range of one axis, single indices before it), and the element count of the largest piece."""
    cut = _tile_rows(shape, budget)
    if cut is None:
        return [(Ellipsis,)], math.prod(shape)
    k, rows, inner = cut
    out = []
    for lead in np.ndindex(*shape[: k - 1]):
        for r in range(0, shape[k - 1], rows):
            out.append(tuple(lead) + (slice(r, min(r + rows, shape[k - 1])),))
    return out, rows * inner


# ---- register code for a compiled evaluator (numba_kernels.elementwise_tiles) ---------------------------------
# opcodes of one instruction row (op, dest, a, b, c); registers hold one tile of f32 values. "Logistic" is
# ``Recip(Add(Exp(Mul(a, b)), c))`` (b, c constants: the sigmoid 1 / (e^-x + 1) of SiLU, SwiGLU, GELU's tanh)
# in one pass over the tile instead of four, each operation still rounded on its own, in the same order
CODE_OPS = ("Const", "Load", "Store", "Add", "Mul", "Mod", "Recip", "Sqrt", "Exp", "Exp2", "Log2", "Sin", "Logistic")
OPCODE = {name: i for i, name in enumerate(CODE_OPS)}


def _logistic(e: Expr) -> tuple[Expr, Expr, Expr] | None:
    """``(x, b, c)`` when ``e`` is ``Recip(Add(Exp(Mul(x, b)), c))`` with constants b and c, else None."""
    if e.op != "Recip" or e.args[0].op != "Add":
        return None
    total = e.args[0]
    exp, c = total.args
    if exp.op != "Exp" or c.op != "const" or exp.args[0].op != "Mul":
        return None
    x, b = exp.args[0].args
    return (x, b, c) if b.op == "const" else None


@dataclass
class ElementwiseCode:
    """An all-f32 expression as register code: ``code`` rows ``(op, dest, a, b)`` (``Const``: fill register
    ``dest`` with ``consts[a]``, first and once per call; ``Load``: register ``dest`` = operand ``a``; ``Store``:
    operand 0 (the output) = register ``a``; the others ``dest = op(a[, b])`` on registers), ``registers`` f32
    registers in all. Operand ``k + 1`` is input ``k``. The operations and their order are the expression's, so
    a compiled evaluator gives numpy's bits for everything but the transcendental functions."""

    code: np.ndarray  # int32 [n, 5]
    consts: np.ndarray  # f32
    registers: int

    @staticmethod
    def of(text: str, in_dtypes: list[np.dtype], out_dtype: np.dtype) -> ElementwiseCode | None:
        """The code of ``text``, or None unless every input and the output are f32 and the expression uses only
        float arithmetic (no Cast, LessThan). Made once per expression and dtypes (shared, never written): a kernel
        re-bound at every length (a decode loop through a compiled PyTorch model) parsed its expression again each
        time, and the parser's recursive closures are reference cycles, garbage only the collector frees (~5200
        objects a 32-token ``generate``: docs/torch.md, "garbage collector")."""
        return _code_of(text, tuple(np.dtype(d) for d in in_dtypes), np.dtype(out_dtype))


@functools.lru_cache(maxsize=4096)
def _code_of(text: str, in_dtypes: tuple[np.dtype, ...], out_dtype: np.dtype) -> ElementwiseCode | None:
    """``ElementwiseCode.of``, memoized."""
    if out_dtype != F32 or any(d != F32 for d in in_dtypes):
        return None
    tree = parse(text)
    if any(e.op not in ("in", "const") and e.op not in OPCODE for e in _nodes(tree)):
        return None
    if any(not 0 <= leaf.index < len(in_dtypes) for leaf in _leaves(tree)):
        return None
    # f32 bits -> its register (filled once): keyed by bits, so a NaN constant (never equal to itself) is one
    # register too, and -0.0 stays apart from 0.0
    consts: dict[int, int] = {}
    for e in _nodes(tree):
        if e.op == "const" and _bits(e.value) not in consts:
            consts[_bits(e.value)] = len(consts)
    rows = [(OPCODE["Const"], reg, reg, 0, 0) for reg in consts.values()]
    free: list[int] = []
    count = len(consts)
    # an input or subexpression read several times is loaded or computed once (SiLU's x * sigmoid(x) loads x
    # once): its register is kept until its last reader
    uses = _repeated(tree, leaves=True)
    memo: dict[Expr, int] = {}
    pins: dict[int, int] = {}

    def take() -> int:
        nonlocal count
        if free:
            return free.pop()
        count += 1
        return count - 1

    def emit(e: Expr) -> tuple[int, bool]:  # (register, whether it is a temporary)
        if e.op == "const":
            return consts[_bits(e.value)], False
        if e in memo:
            return memo[e], True
        if e.op == "in":
            reg = take()
            rows.append((OPCODE["Load"], reg, e.index + 1, 0, 0))
        else:
            logistic = _logistic(e)
            op, operands = ("Logistic", logistic) if logistic is not None else (e.op, e.args)
            args = [emit(a) for a in operands]
            reg = take()  # never an operand's register: a loop writing what it reads does not vectorise
            for r, temporary in args:
                if temporary:
                    release(r)
            regs = [r for r, _ in args] + [0] * (3 - len(args))
            rows.append((OPCODE[op], reg, regs[0], regs[1], regs[2]))
        if uses.get(e, 1) > 1:
            memo[e] = reg
            pins[reg] = uses[e]
        return reg, True

    def release(reg: int) -> None:
        left = pins.get(reg, 1) - 1
        if left > 0:
            pins[reg] = left
            return
        pins.pop(reg, None)
        free.append(reg)

    root, _ = emit(tree)
    rows.append((OPCODE["Store"], 0, root, 0, 0))
    value = np.array(list(consts), np.uint32).view(np.float32)
    return ElementwiseCode(np.array(rows, np.int32).reshape(-1, 5), value, max(count, 1))


def _repeated(tree: Expr, leaves: bool = False) -> dict[Expr, int]:
    """How often each subexpression occurring more than once is read (operations; inputs too with ``leaves``):
    counted where first met, so a repeated subexpression's own parts count once."""
    counts: dict[Expr, int] = {}

    def walk(e: Expr) -> None:
        if e.op == "const" or (e.op == "in" and not leaves):
            return
        counts[e] = counts.get(e, 0) + 1
        if counts[e] == 1:
            for a in e.args:
                walk(a)

    walk(tree)
    return {e: n for e, n in counts.items() if n > 1}


def _bits(value: float) -> int:
    """The f32 bit pattern of a constant."""
    with np.errstate(over="ignore"):  # a constant beyond f32 becomes infinity, as np.float32 rounds it
        return int(np.float32(value).view(np.uint32))


def _nodes(e: Expr):
    yield e
    for a in e.args:
        yield from _nodes(a)
