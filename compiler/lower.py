"""Lowering: an HLIR ``Graph`` becomes e-classes of an egglog e-graph, sent as ``egglog.bindings`` objects.

Each node ``i`` is one command ``(union (N i) (Op (L (N j) view) ...))`` built directly as binding objects and
sent in chunks (parsing one program string costs memory quadratic in its length, and the high-level API
recurses per nesting level). Alongside, the facts rules need about layouts: the node's shape and dtype, the
contiguous strides of every shape that occurs (``RowMajor``), and which nodes have a single reader
(``SingleUse``). Small array constants carry their values as text, so rules can recognise tables (E2M1's).

Lists (shapes, strides, masks) are written innermost axis first, and strides of concrete size-1 axes as 0; see
``rules/schema.egg``.
"""

from __future__ import annotations

from collections.abc import Iterable

import egglog.bindings as eb
import numpy as np

from luminal_recipes.graph.core import Graph, Node
from luminal_recipes.graph.symbolic import Dim, Expr, mul
from luminal_recipes.graph.view import View

SPAN = eb.RustSpan(__file__, 0, 0)
CHUNK = 2000
SMALL_CONSTANT = 64  # elements: array constants up to this size show their values to the rules


def _call(name: str, *args) -> eb.Call:
    return eb.Call(SPAN, name, list(args))


def _int(v: int) -> eb.Lit:
    return eb.Lit(SPAN, eb.Int(int(v)))


def _float(v: float) -> eb.Lit:
    return eb.Lit(SPAN, eb.Float(float(v)))


def _str(v: str) -> eb.Lit:
    return eb.Lit(SPAN, eb.String(v))


def canonical_strides(shape: tuple[Dim, ...], strides: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Strides with those of concrete size-1 axes set to 0 (an index there is always 0)."""
    return tuple(0 if isinstance(d, int) and d == 1 else s for d, s in zip(shape, strides))


def canonical_view(view: View) -> View:
    """The view as the e-graph stores it (strides of concrete size-1 axes 0)."""
    return View(view.shape, canonical_strides(view.shape, view.strides), view.offset, view.mask)


def row_major(shape: tuple[Dim, ...]) -> tuple[Dim, ...]:
    out: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        out.append(0 if isinstance(d, int) and d == 1 else acc)
        acc = mul(acc, d)
    return tuple(reversed(out))


class Terms:
    """Builds (and memoises) the binding terms of dims, shapes and views."""

    def __init__(self) -> None:
        self._dims: dict[tuple, eb.Call] = {}

    @staticmethod
    def dim(d: Dim) -> eb.Call:
        if isinstance(d, Expr):
            return _call("DS", _str(str(d)))
        return _call("DI", _int(d))

    def dims(self, values: tuple[Dim, ...]) -> eb.Call:
        """A list term, innermost (last) axis first."""
        key = tuple(str(v) for v in values)
        term = self._dims.get(key)
        if term is None:
            term = _call("DNil")
            for v in values:  # outermost first, so the last axis ends up at the head
                term = _call("DCons", self.dim(v), term)
            self._dims[key] = term
        return term

    def view(self, view: View) -> eb.Call:
        strides = canonical_strides(view.shape, view.strides)
        if view.mask is None:
            mask = _call("NoMask")
        else:
            mask = _call("Masked", self.dims(tuple(lo for lo, _ in view.mask)),
                         self.dims(tuple(hi for _, hi in view.mask)))
        return _call("V", self.dims(view.shape), self.dims(strides), self.dim(view.offset), mask)


def values_text(data: np.ndarray) -> str:
    """The values of a small array constant as text (rules may match tables such as E2M1's; -0.0 stays -0.0);
    empty for larger ones."""
    if data.size > SMALL_CONSTANT:
        return ""
    flat = np.asarray(data).reshape(-1)
    if np.issubdtype(flat.dtype, np.integer) or flat.dtype == np.bool_:
        return " ".join(str(int(v)) for v in flat)
    return " ".join(repr(float(v)) for v in flat.astype(np.float32))


MAX_SCALE = 8  # the largest factor stated between two symbolic strides of a view (a convolution's stride)


def scale_factor(a: Dim, b: Dim) -> int | None:
    """``k`` with ``b == k * a`` for two symbolic dims, ``1 <= k <= MAX_SCALE``, else None: every term of ``b``
    is ``k`` times the same term of ``a`` (both are in canonical polynomial form)."""
    if not (isinstance(a, Expr) and isinstance(b, Expr)) or len(a.terms) != len(b.terms):
        return None
    k = None
    for (ma, ca), (mb, cb) in zip(a.terms, b.terms):
        if ma != mb or cb % ca:
            return None
        if k is None:
            k = cb // ca
        elif cb // ca != k:
            return None
    return k if k is not None and 1 <= k <= MAX_SCALE else None


def _prefixes(shape: tuple[Dim, ...]) -> Iterable[tuple[Dim, ...]]:
    # the tails of an innermost-first list are the shape's prefixes (trailing axes removed)
    for i in range(len(shape) + 1):
        yield shape[:i]


class Lowering:
    """Turns graph nodes into binding commands; ``uses[i]`` counts node ``i``'s readers in the whole graph."""

    def __init__(self, graph: Graph, uses: dict[int, int] | None = None):
        self.graph = graph
        self.uses = uses or {}
        self.terms = Terms()
        self._shapes_done: set[tuple] = set()
        self._scales_done: set[tuple] = set()

    def node_id(self, i: int) -> eb.Call:
        return _call("N", _int(i))

    def load(self, src: int, view: View) -> eb.Call:
        return _call("L", self.node_id(src), self.terms.view(view))

    def op_term(self, node: Node) -> eb.Call:
        op = node.op
        loads = [self.load(src, view) for src, view in node.inputs]
        if op == "Input":
            return _call("Input", _str(node.name))
        if op == "Constant":
            if node.data is not None:
                return _call("ConstArr", _int(node.id), _str(values_text(node.data)))
            return _call("Const", _str(str(node.dtype)), _float(node.attr("value")))
        if op == "Iota":
            return _call("Iota", self.terms.dim(node.shape[0]))
        if op in ("SumReduce", "MaxReduce"):
            ndim_in = len(node.inputs[0][1].shape)
            return _call(op, loads[0], _int(ndim_in - 1 - node.attr("axis")))
        if op == "Cast":
            return _call("Cast", _str(str(node.dtype)), loads[0])
        if op == "Dequant":
            return _call("Dequant", _str(node.attr("qtype")), _str(str(node.dtype)), loads[0])
        return _call(op, *loads)

    def _shape_facts(self, shape: tuple[Dim, ...]) -> list:
        out = []
        for sub in _prefixes(shape):
            key = tuple(str(d) for d in sub)
            if key in self._shapes_done:
                continue
            self._shapes_done.add(key)
            dims = self.terms.dims(sub)
            out.append(eb.Set(SPAN, "RowMajor", [dims], self.terms.dims(row_major(sub))))
            out.append(eb.Set(SPAN, "ZeroStrides", [dims], self.terms.dims(tuple(0 for _ in sub))))
        return out

    def _scale_facts(self, view: View) -> list:
        """``Scaled`` facts between the symbolic strides of a convolution's window view [N, C, kh, kw, Ho, Wo]
        (rules cannot multiply symbolic dims: its sliding stride is the row stride times the convolution's
        stride). Only views of that rank get them: no other rule reads them, and a fact is one more term in
        every e-graph."""
        if len(view.shape) != 6:
            return []
        strides = [s for s in canonical_strides(view.shape, view.strides) if isinstance(s, Expr)]
        if len(strides) < 2:
            return []
        out = []
        for a in strides:
            for b in strides:
                key = (a, b)
                if key in self._scales_done:
                    continue
                self._scales_done.add(key)
                k = scale_factor(a, b)
                if k is not None:
                    out.append(eb.Expr_(SPAN, _call("Scaled", self.terms.dim(a), _int(k), self.terms.dim(b))))
        return out

    def node_commands(self, node: Node) -> list:
        nid = self.node_id(node.id)
        actions = [eb.Union(SPAN, nid, self.op_term(node)),
                   eb.Set(SPAN, "Shape", [nid], self.terms.dims(node.shape)),
                   eb.Set(SPAN, "DT", [nid], _str(str(node.dtype)))]
        actions += self._shape_facts(node.shape)
        for _, view in node.inputs:
            actions += self._shape_facts(view.shape)
            actions += self._scale_facts(view)
        if self.uses.get(node.id, 0) == 1:
            actions.append(eb.Expr_(SPAN, _call("SingleUse", nid)))
        return [eb.ActionCommand(a) for a in actions]


def lower(graph: Graph, egraph: eb.EGraph, node_ids: Iterable[int] | None = None,
          uses: dict[int, int] | None = None, chunk: int = CHUNK) -> int:
    """Insert the nodes (all, or ``node_ids`` in topological order) into ``egraph``; returns #commands. With all
    nodes, each graph output is also inserted as the load it is (producer and view), so extraction may read it
    from another e-class with the same bytes."""
    lowering = Lowering(graph, uses)
    ids = range(len(graph.nodes)) if node_ids is None else node_ids
    pending: list = []
    sent = 0
    outputs = [] if node_ids is not None else [eb.ActionCommand(eb.Expr_(SPAN, lowering.load(src, view)))
                                                for src, view in graph.outputs.values()]
    for i in ids:
        pending += lowering.node_commands(graph.nodes[i])
        if len(pending) >= chunk:
            egraph.run_program(*pending)
            sent += len(pending)
            pending = []
    pending += outputs
    if pending:
        egraph.run_program(*pending)
        sent += len(pending)
    return sent
