"""Extraction: read the saturated e-graph, choose one e-node per needed e-class, and emit a ``Program``.

``Snapshot`` freezes the e-graph into plain Python tables (e-classes, their e-nodes, shapes and dtypes).
``choose`` picks, for every e-class, the e-node of least total cost (a Dijkstra-like pass over the hypergraph,
which only ever picks e-nodes whose operands are already chosen, so the result is acyclic). Candidates differ
by the local costs fed in: the analytic cost, the analytic cost with seeded random noise (diverse programs),
or a cost that forbids every fused kernel (the naive primitive program, which always exists). ``to_program``
turns a choice into kernel nodes in topological order. Which kernel an e-node is, its attributes and its cost
come from the kernel registry (``runtimes.kernels``: constructor -> spec).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import egglog.bindings as eb
import numpy as np

from luminal_recipes.graph.core import Graph, Node
from luminal_recipes.graph.dtypes import DType, to_dtype
from luminal_recipes.graph.symbolic import Dim, prod, to_dim
from luminal_recipes.graph.view import View
from luminal_recipes.runtimes.kernels import CONSTRUCTORS, PRIMITIVE_KERNELS, KernelCall, Machine, numel
from luminal_recipes.runtimes.program import Program

from .lower import canonical_view

__all__ = ["PRIMITIVE_KERNELS", "Snapshot", "choose", "local_costs", "noisy", "signature", "to_program"]

EQ_SORTS = ("IR", "Ld", "EX")
INF = math.inf

@dataclass(frozen=True)
class Ref:
    """An e-class operand of an e-node."""

    cls: int


@dataclass
class ENode:
    cls: int                 # owning e-class
    op: str                  # constructor name
    args: tuple              # Ref for e-class operands, else decoded literals / terms
    children: tuple[int, ...] = ()  # distinct operand e-classes


@dataclass
class Snapshot:
    """The e-graph as plain tables. Classes are ints; ``sort[c]`` is "IR", "Ld" or "EX"."""

    sort: list[str] = field(default_factory=list)
    nodes: list[ENode] = field(default_factory=list)
    members: list[list[int]] = field(default_factory=list)   # class -> its e-nodes
    shape: dict[int, tuple[Dim, ...]] = field(default_factory=dict)    # IR class -> shape
    dtype: dict[int, DType] = field(default_factory=dict)              # IR class -> dtype
    node_class: dict[int, int] = field(default_factory=dict)           # HLIR node id -> IR class

    @staticmethod
    def of(egraph: eb.EGraph) -> Snapshot:
        return _read(egraph)

    def load_view(self, ld: int) -> View:
        return self.nodes[self.members[ld][0]].args[1]

    def load_dtype(self, ld: int) -> DType:
        return self.dtype[self.nodes[self.members[ld][0]].args[0].cls]


def _read(egraph: eb.EGraph) -> Snapshot:
    functions = egraph.freeze().functions
    terms: dict = {}  # Value of a Dim/Dims/Mask/View term -> (constructor, raw inputs, input sorts)
    for name in ("DI", "DS", "DNil", "DCons", "NoMask", "Masked", "V"):
        f = functions[name]
        for row in f.rows:
            terms[row.output] = (name, row.inputs, f.input_sorts)
    decoded: dict = {}

    def prim(value, sort):
        if sort == "i64":
            return egraph.value_to_i64(value)
        if sort == "f64":
            return egraph.value_to_f64(value)
        if sort == "String":
            return egraph.value_to_string(value)
        return term(value)

    def term(value):
        if value in decoded:
            return decoded[value]
        name, inputs, sorts = terms[value]
        if name == "DI":
            out = egraph.value_to_i64(inputs[0])
        elif name == "DS":
            out = to_dim(egraph.value_to_string(inputs[0]))
        elif name == "DNil":
            out = ()
        elif name == "DCons":  # innermost first in the e-graph; outermost first in Python
            out = term(inputs[1]) + (term(inputs[0]),)
        elif name == "NoMask":
            out = None
        elif name == "Masked":
            out = tuple(zip(term(inputs[0]), term(inputs[1])))
        else:
            out = View(term(inputs[0]), term(inputs[1]), term(inputs[2]), term(inputs[3]))
        decoded[value] = out
        return out

    snap = Snapshot()
    class_of: dict = {}

    def cls(value, sort) -> int:
        key = (sort, value)
        c = class_of.get(key)
        if c is None:
            c = class_of[key] = len(snap.sort)
            snap.sort.append(sort)
            snap.members.append([])
        return c

    for name, f in functions.items():
        if f.output_sort not in EQ_SORTS or f.is_let_binding:
            continue
        for row in f.rows:
            owner = cls(row.output, f.output_sort)
            args = tuple(Ref(cls(v, s)) if s in EQ_SORTS else prim(v, s)
                         for v, s in zip(row.inputs, f.input_sorts))
            if name == "N":
                snap.node_class[args[0]] = owner
                continue
            children = tuple(dict.fromkeys(a.cls for a in args if isinstance(a, Ref)))
            snap.members[owner].append(len(snap.nodes))
            snap.nodes.append(ENode(owner, name, args, children))
    for row in functions["Shape"].rows:
        snap.shape[cls(row.inputs[0], "IR")] = term(row.output)
    for row in functions["DT"].rows:
        snap.dtype[cls(row.inputs[0], "IR")] = to_dtype(egraph.value_to_string(row.output))
    return snap


# ---- costs -------------------------------------------------------------------------------------------------
def local_costs(snap: Snapshot, dims: Mapping[str, int], machine: Machine,
                allowed: Callable[[str], bool]) -> list[float]:
    """Estimated seconds each e-node adds on its own (its operands' costs come on top)."""
    ex_numel = _expression_sizes(snap, dims)
    costs = []
    for node in snap.nodes:
        sort = snap.sort[node.cls]
        if sort == "Ld":
            costs.append(0.0)
        elif sort == "EX":
            n = ex_numel.get(node.cls, 0)
            if node.op == "EL":
                ld = node.args[0].cls
                view = snap.load_view(ld)
                costs.append(numel(view.shape, dims) * snap.load_dtype(ld).bits / 8 / machine.bytes_per_s)
            elif node.op in ("EC", "EK"):
                costs.append(0.0)
            else:  # one arithmetic pass over cache-resident tiles
                op = "Cast" if node.op == "ECast" else node.args[0]
                costs.append(n * machine.op_weight(op) / machine.ew_flops_per_s)
        else:
            kernel, ctor = CONSTRUCTORS[node.op]
            if not allowed(kernel.name) or node.cls not in snap.shape:
                costs.append(INF)
                continue
            loads = [a.cls for a in node.args if isinstance(a, Ref) and snap.sort[a.cls] == "Ld"]
            inputs = [(snap.load_view(ld), snap.load_dtype(ld)) for ld in loads]
            # an Elementwise's loads and arithmetic are costed by its expression's nodes
            attrs = ctor.to_attrs(node.args, [v for v, _ in inputs])
            if node.op == "Elementwise":
                inputs = []
            call = KernelCall(snap.shape[node.cls], snap.dtype[node.cls], inputs, attrs, dims)
            costs.append(kernel.work(call).seconds(machine))
    return costs


def _expression_sizes(snap: Snapshot, dims: Mapping[str, int]) -> dict[int, int]:
    """Element count of each fused-expression e-class (that of its loads)."""
    sizes: dict[int, int] = {}
    changed = True
    while changed:
        changed = False
        for node in snap.nodes:
            if snap.sort[node.cls] != "EX" or node.cls in sizes:
                continue
            if node.op == "EL":
                n = numel(snap.load_view(node.args[0].cls).shape, dims)
            else:
                known = [sizes[c] for c in node.children if c in sizes]
                if not known:
                    continue
                n = max(known)
            sizes[node.cls] = n
            changed = True
    return sizes


# ---- choosing e-nodes --------------------------------------------------------------------------------------
def choose(snap: Snapshot, costs: list[float]) -> tuple[dict[int, int], dict[int, float]]:
    """Least-cost e-node per e-class (tree cost: own cost plus each distinct operand class's cost)."""
    pending = [len(n.children) for n in snap.nodes]
    parents: list[list[int]] = [[] for _ in snap.sort]
    heap: list[tuple[float, int]] = []
    for i, node in enumerate(snap.nodes):
        for c in node.children:
            parents[c].append(i)
        if not node.children and costs[i] < INF:
            heap.append((costs[i], i))
    heapq.heapify(heap)
    choice: dict[int, int] = {}
    total: dict[int, float] = {}
    while heap:
        cost, i = heapq.heappop(heap)
        owner = snap.nodes[i].cls
        if owner in choice:
            continue
        choice[owner], total[owner] = i, cost
        for p in parents[owner]:
            pending[p] -= 1
            if pending[p] == 0 and costs[p] < INF and snap.nodes[p].cls not in choice:
                heapq.heappush(heap, (costs[p] + sum(total[c] for c in snap.nodes[p].children), p))
    return choice, total


def noisy(costs: list[float], rng: np.random.Generator, spread: float) -> list[float]:
    """Costs scaled by seeded log-uniform noise in [e^-spread, e^spread] (diverse but still cost-aware)."""
    factors = np.exp(rng.uniform(-spread, spread, size=len(costs)))
    return [c * f + 1e-12 for c, f in zip(costs, factors)]


# ---- emitting a Program ------------------------------------------------------------------------------------
class _Emitter:
    def __init__(self, snap: Snapshot, choice: dict[int, int], graph: Graph):
        self.snap, self.choice, self.graph = snap, choice, graph
        self.nodes: list[Node] = []
        self.ids: dict[int, int] = {}  # IR class -> program node id
        self._inputs_by_name = {n.name: n for n in graph.nodes if n.op == "Input"}

    def enode(self, c: int) -> ENode:
        return self.snap.nodes[self.choice[c]]

    def load(self, ld: int) -> tuple[int, View]:
        node = self.enode(ld)
        return node.args[0].cls, node.args[1]

    def deps(self, c: int) -> list[int]:
        """IR classes the chosen e-node of IR class ``c`` reads."""
        out: list[int] = []
        stack = [a.cls for a in self.enode(c).args if isinstance(a, Ref)]
        seen: set[int] = set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            sort = self.snap.sort[x]
            if sort == "IR":
                out.append(x)
            elif sort == "Ld":
                stack.append(self.load(x)[0])
            else:
                stack.extend(self.enode(x).children)
        return out

    def emit(self, root: int) -> int:
        stack = [(root, False)]
        while stack:
            c, ready = stack.pop()
            if c in self.ids:
                continue
            if ready:
                self.ids[c] = self._make(c)
                continue
            stack.append((c, True))
            stack.extend((d, False) for d in self.deps(c) if d not in self.ids)
        return self.ids[root]

    def edge(self, ld: int) -> tuple[int, View]:
        src, view = self.load(ld)
        return self.ids[src], view

    def _make(self, c: int) -> int:
        node = self.enode(c)
        op, args = node.op, node.args
        shape, dtype = self.snap.shape[c], self.snap.dtype[c]
        loads = [a.cls for a in args if isinstance(a, Ref) and self.snap.sort[a.cls] == "Ld"]
        inputs = [self.edge(ld) for ld in loads]
        data = None
        kernel, ctor = CONSTRUCTORS[op]
        if op == "Input":
            attrs = dict(self._inputs_by_name[args[0]].attrs)
        elif op == "Const":
            attrs = {"value": args[1] if dtype.is_float else int(args[1])}
        elif op == "ConstArr":
            src = self.graph.nodes[args[0]]
            attrs, data = dict(src.attrs), src.data
        elif op == "Elementwise":
            inputs, expr = self._expression(args[0].cls)
            attrs = {"expr": expr}
        else:
            attrs = ctor.to_attrs(args, [view for _, view in inputs])
        nid = len(self.nodes)
        self.nodes.append(Node(nid, kernel.name, tuple(inputs), shape, dtype, tuple(sorted(attrs.items())), data))
        return nid

    def _expression(self, ex: int) -> tuple[list[tuple[int, View]], str]:
        inputs: list[tuple[int, View]] = []
        slot: dict[tuple[int, str], int] = {}

        def walk(x: int) -> str:
            node = self.enode(x)
            if node.op == "EL":
                edge = self.edge(node.args[0].cls)
                key = (edge[0], str(edge[1]))
                if key not in slot:
                    slot[key] = len(inputs)
                    inputs.append(edge)
                return f"in{slot[key]}"
            if node.op in ("EC", "EK"):
                return f"(Const {float(node.args[0])!r})"
            if node.op == "EU":
                return f"({node.args[0]} {walk(node.args[1].cls)})"
            if node.op == "ECast":
                return f"(Cast {node.args[0]} {walk(node.args[1].cls)})"
            return f"({node.args[0]} {walk(node.args[1].cls)} {walk(node.args[2].cls)})"

        return inputs, walk(ex)


def to_program(snap: Snapshot, choice: dict[int, int], graph: Graph,
               outputs: Mapping[str, tuple[int, View]]) -> Program:
    """The Program computing ``outputs`` (HLIR node id and view, as in ``graph.outputs``) from a choice."""
    emitter = _Emitter(snap, choice, graph)
    loads = {(n.args[0].cls, str(n.args[1])): n.cls for n in snap.nodes if n.op == "L"}
    out = {}
    for name, (nid, view) in outputs.items():
        cls = snap.node_class[nid]
        ld = loads.get((cls, str(canonical_view(view))))
        if ld is not None and ld in choice:
            # the output as the load lowering stated: another e-class may hold the same bytes (SameBytes); it
            # replaces the producer only if the chosen load reads it whole, in order (then any view of the one
            # reads the same elements of the other)
            src, chosen = emitter.load(ld)
            if src != cls and _reads_whole(chosen, snap.shape[src]):
                cls = src
        out[name] = (emitter.emit(cls), view)
    return Program(emitter.nodes, out)


def _reads_whole(view: View, shape) -> bool:
    contiguous = View.contiguous(view.shape)
    return (view.mask is None and str(view.offset) == "0" and str(canonical_view(contiguous)) ==
            str(canonical_view(view)) and str(prod(view.shape)) == str(prod(shape)))


def signature(program: Program) -> tuple:
    """Identity of a program's computation (to drop duplicate candidates)."""
    return (tuple((n.op, tuple((s, _text(v)) for s, v in n.inputs), n.attrs) for n in program.nodes),
            tuple((k, i, _text(v)) for k, (i, v) in program.outputs.items()))


@functools.lru_cache(maxsize=1 << 16)
def _text(view: View) -> str:
    """A view's text (how signatures compare views), kept: the candidates of one graph share most views."""
    return str(view)
