"""What a kernel is, in one place: ``KernelSpec`` (its egglog constructors and how their arguments become
attributes, its operands, its cost, its aliasing) and the cost vocabulary (``Work``, ``Machine``).

A kernel's *cost* is the ``Work`` it does (flops on BLAS-like units, elementwise operations, bytes moved, launches)
as a function of its shapes, dtypes and attributes; a backend's ``Machine`` turns work into estimated seconds. The
same numbers rank e-nodes during extraction and whole candidate programs; measurement has the last word.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from luminal_recipes.graph.dtypes import DType
from luminal_recipes.graph.symbolic import Dim, evaluate, free_symbols
from luminal_recipes.graph.view import View

# size assumed for a symbolic dimension that has no binding (cost only; never used to run anything)
PROBE_DIM = 128
SORTS = ("Ld", "EX", "i64", "f64", "String", "Dim", "Dims")  # an operand load, an expression, literals, dimensions


# ---- cost ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """Cost-model constants of one device (a backend supplies its own)."""

    launch_s: float = 4e-6          # per kernel call
    bytes_per_s: float = 8e9        # sustained memory bandwidth
    ew_flops_per_s: float = 1.5e9   # elementwise arithmetic
    mm_flops_per_s: float = 4e10    # matrix products
    # elementwise operations that cost more (or less) than one plain operation, e.g. a libm call
    op_weights: tuple[tuple[str, float], ...] = ()

    def op_weight(self, op: str) -> float:
        for name, w in self.op_weights:
            if name == op:
                return w
        return 1.0


@dataclass
class Work:
    """What one kernel call does: flops on matrix units, elementwise operations (plain ones, and named ones a
    machine may weigh differently), bytes read and written, launches."""

    mm_flops: float = 0.0
    ew_flops: float = 0.0
    bytes: float = 0.0
    launches: int = 1
    ew_ops: dict[str, float] = field(default_factory=dict)  # op name -> element count

    def seconds(self, machine: Machine) -> float:
        ew = self.ew_flops + sum(n * machine.op_weight(op) for op, n in self.ew_ops.items())
        return (self.launches * machine.launch_s + self.bytes / machine.bytes_per_s
                + ew / machine.ew_flops_per_s + self.mm_flops / machine.mm_flops_per_s)


def bind(d: Dim, dims: Mapping[str, int]) -> int:
    if isinstance(d, int):
        return d
    return evaluate(d, {s: dims.get(s, PROBE_DIM) for s in free_symbols((d,))})


def numel(shape, dims: Mapping[str, int]) -> int:
    return math.prod(bind(d, dims) for d in shape)


def touched(view: View, dims: Mapping[str, int]) -> int:
    """Distinct elements a view reads (broadcast axes read the same memory again)."""
    return math.prod(bind(d, dims) for d, s in zip(view.shape, view.strides)
                     if not (isinstance(s, int) and s == 0))


def data_elements(view: View, dims: Mapping[str, int]) -> int:
    """Elements of a (possibly zero-padded) view that hold data: its mask's box, broadcast axes counted once."""
    n = 1
    for axis, (d, s) in enumerate(zip(view.shape, view.strides)):
        size = bind(d, dims)
        if view.mask is not None:
            lo, hi = (bind(x, dims) for x in view.mask[axis])
            size = max(0, min(hi, size) - max(lo, 0))
        if not (isinstance(s, int) and s == 0) or size == 0:
            n *= size
    return n


@dataclass(frozen=True)
class KernelCall:
    """One call of a kernel as the cost model sees it: output shape and dtype, each operand's view and dtype,
    attributes, and the dims symbols are bound to (missing ones count as ``PROBE_DIM``)."""

    out_shape: tuple[Dim, ...]
    out_dtype: DType
    inputs: list[tuple[View, DType]]
    attrs: Mapping[str, Any]
    dims: Mapping[str, int]

    def dim(self, d: Dim) -> int:
        return bind(d, self.dims)

    def numel(self, shape) -> int:
        return numel(shape, self.dims)

    @property
    def out_numel(self) -> int:
        return numel(self.out_shape, self.dims)

    @property
    def written(self) -> float:
        return self.out_numel * self.out_dtype.bits / 8

    def read(self, i: int) -> float:
        view, dtype = self.inputs[i]
        return touched(view, self.dims) * dtype.bits / 8

    def base(self, **kw) -> Work:
        """Every operand read once, the output written once, one launch."""
        return Work(bytes=sum(self.read(i) for i in range(len(self.inputs))) + self.written, **kw)


# ---- egglog constructors ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    name: str
    sort: str  # one of SORTS


AttrsFn = Callable[[dict[str, Any], list[View]], dict[str, Any]]


@dataclass(frozen=True)
class Ctor:
    """An egglog constructor whose e-nodes extract to the kernel. ``signature`` names its arguments in order,
    ``name:sort`` each (sorts: ``SORTS``); ``Ld`` arguments are the kernel's operands, in order; literal
    arguments (``i64 f64 String``) become the attributes of the same name, plus ``fixed`` ones, unless
    ``attrs`` computes them (from the literal arguments by name and the operands' views)."""

    signature: str
    fixed: Mapping[str, Any] = field(default_factory=dict)
    attrs: AttrsFn | None = None

    @property
    def params(self) -> tuple[Param, ...]:
        out = []
        for token in self.signature.split():
            name, _, sort = token.partition(":")
            if sort not in SORTS:
                raise ValueError(f"constructor argument {token!r}: sort must be one of {', '.join(SORTS)}")
            out.append(Param(name, sort))
        return tuple(out)

    def declaration(self, name: str) -> str:
        """The egglog declaration, e.g. ``(constructor MatMul (Ld Ld) IR)``."""
        return f"(constructor {name} ({' '.join(p.sort for p in self.params)}) IR)"

    def to_attrs(self, args: tuple, views: list[View]) -> dict[str, Any]:
        """The kernel's attributes from an e-node's arguments (decoded literals) and its operands' views."""
        literals = {p.name: a for p, a in zip(self.params, args) if p.sort in ("i64", "f64", "String")}
        if self.attrs is not None:
            return {**self.fixed, **self.attrs(literals, views)}
        return {**self.fixed, **literals}


# ---- the kernel ------------------------------------------------------------------------------------------------
CostFn = Callable[[KernelCall], Work]


def default_cost(k: KernelCall) -> Work:
    """One elementwise operation per output element on top of the bytes."""
    return k.base(ew_flops=k.out_numel)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of the Program vocabulary.

    ``name``: the op name in Programs; ``constructors``: the egglog constructors that extract to it;
    ``operands``/``attrs``: the documented schema of its inputs and attributes; ``doc``: its semantics (for
    primitives, ``graph.reference``'s); ``cost``: its work; ``writes_into``: the input whose buffer it updates
    (the memory planner aliases the two when that input dies here); ``elementwise_inplace``: output element i
    depends only on input elements i, so it may write into an input that dies here; ``version``: bump it when the
    kernel's meaning changes (plan caches are keyed on it).
    """

    name: str
    doc: str
    constructors: Mapping[str, Ctor]
    operands: str = ""
    attrs: Mapping[str, str] = field(default_factory=dict)
    cost: CostFn = default_cost
    writes_into: int | None = None
    elementwise_inplace: bool = False
    primitive: bool = False
    version: str = "1"

    def work(self, call: KernelCall) -> Work:
        return self.cost(call)

    def describe(self) -> str:
        """The contract text: semantics, operands, attributes."""
        parts = [self.doc]
        if self.operands:
            parts.append(f"operands: {self.operands}")
        if self.attrs:
            parts.append("attrs: " + "; ".join(f"{k}: {v}" for k, v in self.attrs.items()))
        return " ".join(parts)

    def fingerprint(self) -> str:
        """What identifies this kernel's contract (plan caches are keyed on it)."""
        ctors = ";".join(f"{k}({c.signature}){sorted(c.fixed.items())}" for k, c in self.constructors.items())
        return f"{self.name}|{self.version}|{ctors}|{self.operands}|{sorted(self.attrs)}|{self.writes_into}|" \
               f"{self.elementwise_inplace}"


_OP = re.compile(r"\((\w+)")


def expression_ops(expr: str) -> dict[str, int]:
    """Operations of an ``Elementwise`` expression by name (constants are not operations)."""
    counts: dict[str, int] = {}
    for op in _OP.findall(expr):
        if op != "Const":
            counts[op] = counts.get(op, 0) + 1
    return counts
