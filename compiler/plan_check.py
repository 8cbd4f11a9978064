"""What a plan-cache entry must be before its program is used: a program for THE graph being compiled.

``check_program(data, graph, dims, kernels)`` reads the JSON of a cached program (``graph.serialize``'s format)
without trusting any of it, and returns the ``Program`` or raises ``UntrustedPlan`` with a one-line reason. It
checks, before building anything from the text:

- sizes: at most ``MAX_NODES_PER_GRAPH_NODE`` nodes per node of the graph (plus ``MAX_EXTRA_NODES``), ranks up
  to ``MAX_RANK``, dimension texts up to ``MAX_DIM_TEXT`` characters (so parsing one is shallow), element counts
  up to ``MAX_ELEMENTS``, attribute texts up to ``MAX_ATTR_TEXT`` characters, ``Elementwise`` expressions up to
  ``MAX_EXPR_TEXT`` characters and ``MAX_EXPR_DEPTH`` levels of nesting (counted without recursion, before the
  recursive parser sees them);
- kernels: every op is a kernel of the registry (``runtimes/kernels``) that the runtime has; its attributes are
  names the kernel's spec knows (its constructors' literal arguments, fixed attributes, documented attributes,
  and the graph's own attributes of that primitive) with JSON scalar values; its operand count is one its
  constructors take; an ``Elementwise`` expression parses and reads only operands the node has;
- the wiring: operands are earlier nodes; every ``Input`` node is an input, weight or state that THIS graph reads
  (reachable from its outputs), of the same kind, dtype and shape; every array constant holds the bytes of one
  of this graph's constants; the outputs are the graph's outputs, each of the graph's dtype and shape;
- bounds: every view (operands and outputs) reads only inside its producer's buffer, for every value the symbolic
  dims can take in the size bucket the plan is for. A symbolic dim is an integer polynomial (with ``//`` and
  ``%`` by constants) over the graph's symbols; a plan compiled for the bucket ``dims`` runs at any value from 1
  up to ``dims[s]`` for each symbol (``pipeline.engine``: re-bound, never reloaded), so the check evaluates each
  view's first and last element read, inside its mask, at points of that box (``bucket_points``: every point
  of a small box, else 1, the midpoint and the bucket's value of each symbol, or the corners) at which the
  graph's own views all read inside their buffers (``admissible_points``: dims a recipe ties together, such as
  a KV cache's length and the context read from it, do not vary freely); a dimension must be non-negative there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import math
import re

from luminal_recipes.errors import LuminalError
from luminal_recipes.graph.core import Graph
from luminal_recipes.graph.dtypes import to_dtype
from luminal_recipes.graph.serialize import reachable
from luminal_recipes.graph.symbolic import Expr, dims_equal, evaluate, parse_dim, prod
from luminal_recipes.runtimes.kernels import REGISTRY
from luminal_recipes.runtimes.program import Program

MAX_NODES_PER_GRAPH_NODE = 4
MAX_EXTRA_NODES = 256
MAX_RANK = 16
MAX_DIM_TEXT = 512
MAX_ELEMENTS = 1 << 42  # of any one buffer or view, at any point of the bucket (4 Ti elements)
MAX_ATTR_TEXT = 4096
MAX_EXPR_TEXT = 1 << 20
MAX_EXPR_DEPTH = 256
MAX_OPERANDS = 256
_POINTS_FULL = 64  # a bucket box of at most this many points is checked at every point


class UntrustedPlan(ValueError):
    """A cached program that is not a program of the graph being compiled (the reason is the message)."""


def _fail(message: str):
    raise UntrustedPlan(message)


# ---- what the registry allows ----------------------------------------------------------------------------------
def _kernel_schema() -> dict[str, tuple[frozenset, frozenset | None]]:
    """kernel name -> (attribute names, operand counts or None for any)."""
    schema = {}
    for name, spec in REGISTRY.items():
        attrs, counts, any_count = set(spec.attrs), set(), False
        for ctor in spec.constructors.values():
            attrs |= set(ctor.fixed)
            params = ctor.params
            attrs |= {p.name for p in params if p.sort in ("i64", "f64", "String", "EX")}
            counts.add(sum(p.sort == "Ld" for p in params))
            any_count |= any(p.sort == "EX" for p in params)
        schema[name] = (frozenset(attrs), None if any_count else frozenset(counts))
    return schema


_SCHEMA: dict | None = None


def _schema() -> dict:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = _kernel_schema()
    return _SCHEMA


# ---- texts -----------------------------------------------------------------------------------------------------
def _dim(text, where: str, symbols: set[str]):
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        _fail(f"{where}: a dimension must be a text or an integer, not {type(text).__name__}")
    if isinstance(text, int):
        text = str(text)
    if len(text) > MAX_DIM_TEXT:
        _fail(f"{where}: a dimension expression of {len(text)} characters (at most {MAX_DIM_TEXT})")
    try:
        d = parse_dim(text)
    except (LuminalError, ValueError, SyntaxError, RecursionError, MemoryError, ArithmeticError) as exc:
        _fail(f"{where}: dimension {text[:40]!r}: {str(exc)[:120]}")
    if isinstance(d, Expr):
        unknown = d.free_symbols() - symbols
        if unknown:
            _fail(f"{where}: dimension {text[:40]!r} names {sorted(unknown)[0]!r}, not a symbol of this graph")
    return d


def expression_depth(text: str) -> int:
    """The deepest nesting of parentheses in ``text`` (-1 if they do not balance), without recursion."""
    depth = deepest = 0
    for ch in text:
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return -1
    return deepest if depth == 0 else -1


_INPUT_REF = re.compile(r"(?<![\w.])in(\d+)(?![\w.])")


def _check_expression(text, operands: int, where: str) -> None:
    if not isinstance(text, str):
        _fail(f"{where}: the expression is not a text")
    if len(text) > MAX_EXPR_TEXT:
        _fail(f"{where}: an expression of {len(text)} characters (at most {MAX_EXPR_TEXT})")
    depth = expression_depth(text)
    if depth < 0:
        _fail(f"{where}: the expression's parentheses do not balance")
    if depth > MAX_EXPR_DEPTH:
        _fail(f"{where}: an expression nested {depth} deep (at most {MAX_EXPR_DEPTH})")
    from luminal_recipes.runtimes.kernels.expression import parse

    try:
        parse(text)
    except (LuminalError, ValueError, RecursionError) as exc:
        _fail(f"{where}: {str(exc)[:160]}")
    for m in _INPUT_REF.finditer(text):
        if int(m[1]) >= operands:
            _fail(f"{where}: the expression reads in{m[1]}, but the node has {operands} operands")


def _check_attrs(attrs, op: str, allowed: frozenset, where: str, graph_attrs: dict[str, set]) -> None:
    if not isinstance(attrs, dict):
        _fail(f"{where}: attributes must be a mapping")
    for key, value in attrs.items():
        if key not in allowed and key not in graph_attrs.get(op, ()):
            _fail(f"{where}: {op} has no attribute {str(key)[:40]!r}")
        values = value if isinstance(value, list) else [value]
        if len(values) > MAX_RANK:
            _fail(f"{where}: attribute {key!r} holds {len(values)} values")
        for v in values:
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, int):
                if abs(v) > MAX_ELEMENTS:
                    _fail(f"{where}: attribute {key!r} = {str(v)[:40]} is out of range")
            elif isinstance(v, float):
                pass
            elif isinstance(v, str):
                if key != "expr" and len(v) > MAX_ATTR_TEXT:
                    _fail(f"{where}: attribute {key!r} is a text of {len(v)} characters")
            else:
                _fail(f"{where}: attribute {key!r} has a value of type {type(v).__name__}")


# ---- bounds ----------------------------------------------------------------------------------------------------
def bucket_points(dims: dict[str, int]) -> list[dict[str, int]]:
    """Bindings of the symbols at which views are checked: each symbol at 1, its midpoint and its bucket value
    (every value when the whole box has at most ``_POINTS_FULL`` points; with many symbols, the box's corners;
    with more still, the three diagonal points)."""
    names = sorted(dims)
    highs = [max(1, int(dims[n])) for n in names]
    if math.prod(highs) <= _POINTS_FULL:
        choices = [range(1, h + 1) for h in highs]
    elif 3 ** len(names) <= _POINTS_FULL:
        choices = [sorted({1, max(1, h // 2), h}) for h in highs]
    elif 2 ** len(names) <= _POINTS_FULL:
        choices = [sorted({1, h}) for h in highs]
    else:
        return [dict.fromkeys(names, 1), {n: max(1, h // 2) for n, h in zip(names, highs)}, dict(zip(names, highs))]
    return [dict(zip(names, values)) for values in itertools.product(*choices)]


def _ev(d, point) -> int:
    return d if isinstance(d, int) else evaluate(d, point)


def _reads(view, size, point) -> str | None:
    """Why ``view`` = (shape, strides, offset, mask) of a buffer of ``size`` elements reads outside it at
    ``point``; None when it does not."""
    shape, strides, offset, mask = view
    n = _ev(size, point)
    sh = [_ev(d, point) for d in shape]
    if any(d < 0 for d in sh):
        return "a negative dimension"
    if math.prod(sh) > MAX_ELEMENTS:
        return f"{math.prod(sh)} elements"
    st = [_ev(s, point) for s in strides]
    off = _ev(offset, point)
    if abs(off) > MAX_ELEMENTS or any(abs(s) > MAX_ELEMENTS for s in st):
        return f"a stride or offset beyond any buffer (its own holds {n} elements)"
    first = last = off
    for axis, (d, s) in enumerate(zip(sh, st)):
        lo, hi = (0, d) if mask is None else (_ev(mask[axis][0], point), _ev(mask[axis][1], point))
        lo, hi = max(lo, 0), min(hi, d)
        if lo >= hi:
            return None  # nothing is read
        a, b = lo * s, (hi - 1) * s
        first += min(a, b)
        last += max(a, b)
    if first < 0 or last >= n:
        return f"reads elements {first}..{last} of a buffer of {n}"
    return None


def _check_view(view, size, where: str, points) -> None:
    for point in points:
        why = _reads(view, size, point)
        if why is not None:
            _fail(f"{where}: {why} at {_point(point)}")


def admissible_points(graph: Graph, dims: dict[str, int]) -> list[dict[str, int]]:
    """The ``bucket_points`` at which the graph's own views all read inside their buffers: the sizes the graph
    can run at (dims a recipe ties together, such as a KV cache's length and the context read from it, are not
    free within the box). A cached program must read inside its buffers at each of them."""
    views = {}
    sizes = [prod(n.shape) for n in graph.nodes]
    for n in graph.nodes:
        for src, v in n.inputs:
            views[(v, str(sizes[src]))] = ((v.shape, v.strides, v.offset, v.mask), sizes[src])
    for src, v in graph.outputs.values():
        views[(v, str(sizes[src]))] = ((v.shape, v.strides, v.offset, v.mask), sizes[src])
    checked = list(views.values())
    return [point for point in bucket_points(dims) if all(_reads(v, size, point) is None for v, size in checked)]


def _point(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items()) or "its sizes"


def _parse_view(v, where: str, symbols: set[str]):
    if not isinstance(v, dict) or not set(v) <= {"shape", "strides", "offset", "mask"}:
        _fail(f"{where}: not a view")
    shape, strides = v.get("shape"), v.get("strides")
    if not isinstance(shape, list) or not isinstance(strides, list) or len(shape) != len(strides) \
            or len(shape) > MAX_RANK:
        _fail(f"{where}: a view needs as many strides as dimensions (at most {MAX_RANK})")
    shape = tuple(_dim(d, where, symbols) for d in shape)
    strides = tuple(_dim(d, where, symbols) for d in strides)
    offset = _dim(v.get("offset", "0"), where, symbols)
    mask = v.get("mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(shape) or \
                not all(isinstance(m, list) and len(m) == 2 for m in mask):
            _fail(f"{where}: a mask needs one [lo, hi] per dimension")
        mask = tuple((_dim(lo, where, symbols), _dim(hi, where, symbols)) for lo, hi in mask)
    return shape, strides, offset, mask


# ---- the check -------------------------------------------------------------------------------------------------
def check_program(data, graph: Graph, dims: dict[str, int], kernels=None) -> Program:
    """The program of a cache entry, checked against ``graph`` compiled at the bucket ``dims`` for a runtime
    with ``kernels`` (default: every kernel of the registry); ``UntrustedPlan`` naming the first problem."""
    schema = _schema()
    kernels = set(REGISTRY) if kernels is None else set(kernels)
    symbols = set(dims)
    points = admissible_points(graph, dims)
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) \
            or not isinstance(data.get("outputs"), dict):
        _fail("not a program (nodes and outputs)")
    nodes = data["nodes"]
    most = MAX_NODES_PER_GRAPH_NODE * len(graph.nodes) + MAX_EXTRA_NODES
    if len(nodes) > most:
        _fail(f"{len(nodes)} nodes for a graph of {len(graph.nodes)} (at most {most})")
    graph_attrs: dict[str, set] = {}
    for n in graph.nodes:
        graph_attrs.setdefault(n.op, set()).update(k for k, _ in n.attrs)
    read = reachable(graph, [src for src, _ in graph.outputs.values()])
    sources = {n.name: n for n in graph.inputs() if n.id in read}  # what the graph reads, by name
    constants = {(str(n.dtype), tuple(str(d) for d in n.shape), hashlib.sha256(n.data.tobytes()).hexdigest())
                 for n in graph.nodes if n.op == "Constant" and n.data is not None}
    sizes, size_texts, view_memo, shape_memo = [], [], {}, set()
    for i, item in enumerate(nodes):
        where = f"node {i}"
        if not isinstance(item, dict) or not set(item) <= {"op", "dtype", "shape", "inputs", "attrs", "data"}:
            _fail(f"{where} is not a kernel node")
        op = item.get("op")
        if not isinstance(op, str) or op not in schema:
            _fail(f"{where} has the unknown kernel {str(op)[:60]!r}")
        if op not in kernels:
            _fail(f"{where}: kernel {op!r} is not one this runtime has")
        where = f"node {i} ({op})"
        allowed, counts = schema[op]
        try:
            dtype = to_dtype(item.get("dtype")) if isinstance(item.get("dtype"), str) else None
        except (LuminalError, ValueError):
            dtype = None
        if dtype is None:
            _fail(f"{where}: unknown dtype {str(item.get('dtype'))[:20]!r}")
        shape = item.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_RANK:
            _fail(f"{where}: a shape must be a list of at most {MAX_RANK} dimensions")
        shape_text = repr(shape)
        shape = tuple(_dim(d, where, symbols) for d in shape)
        size = prod(shape)
        if shape_text not in shape_memo:
            shape_memo.add(shape_text)
            for point in points:
                values = [_ev(d, point) for d in shape]
                if any(v < 0 for v in values) or math.prod(values) > MAX_ELEMENTS:
                    _fail(f"{where}: shape of {values} elements at {_point(point)}")
        attrs = item.get("attrs", {})
        _check_attrs(attrs, op, allowed, where, graph_attrs)
        inputs = item.get("inputs")
        if not isinstance(inputs, list) or len(inputs) > MAX_OPERANDS:
            _fail(f"{where}: operands must be a list")
        if counts is not None and len(inputs) not in counts:
            _fail(f"{where}: {len(inputs)} operands, the kernel takes {' or '.join(map(str, sorted(counts)))}")
        for k, edge in enumerate(inputs):
            if not isinstance(edge, list) or len(edge) != 2:
                _fail(f"{where}: operand {k} is not [node, view]")
            src, v = edge
            if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < i:
                _fail(f"{where} reads a node that does not come before it")
            memo = (repr(v), size_texts[src])  # the same view of an equal buffer is checked once
            if memo not in view_memo:
                view_memo[memo] = True
                _check_view(_parse_view(v, f"{where} operand {k}", symbols), sizes[src], f"{where} operand {k}",
                            points)
        if op == "Elementwise":
            _check_expression(attrs.get("expr"), len(inputs), where)
        if op == "Input":
            name, kind = attrs.get("name"), attrs.get("kind")
            src = sources.get(name) if isinstance(name, str) else None
            if src is None:
                _fail(f"{where}: {str(name)[:80]!r} is not an input, weight or state this graph reads")
            if src.attr("kind") != kind or src.dtype != dtype or len(src.shape) != len(shape) or \
                    not all(dims_equal(a, b) for a, b in zip(src.shape, shape)):
                _fail(f"{where}: {name!r} is not this graph's {src.attr('kind')} {src.dtype}"
                      f"[{', '.join(map(str, src.shape))}]")
        if "data" in item:
            if op != "Constant":
                _fail(f"{where}: only a constant holds data")
            _check_data(item["data"], dtype, shape, constants, where, [str(d) for d in item["shape"]])
        elif op == "Constant" and "value" not in attrs:
            _fail(f"{where}: a constant without a value")
        sizes.append(size)
        size_texts.append(str(size))
    names = set(graph.outputs)
    outputs = data["outputs"]
    if set(outputs) != names:
        extra = sorted(set(outputs) ^ names)
        _fail(f"its outputs differ from the graph's (e.g. {str(extra[0])[:60]!r})")
    for name, edge in outputs.items():
        where = f"output {name!r}"
        if not isinstance(edge, list) or len(edge) != 2 or isinstance(edge[0], bool) \
                or not isinstance(edge[0], int) or not 0 <= edge[0] < len(nodes):
            _fail(f"{where} names a node the program does not have")
        src, v = edge
        view = _parse_view(v, where, symbols)
        _check_view(view, sizes[src], where, points)
        g_src, g_view = graph.outputs[name]
        want = graph.nodes[g_src]
        if str(to_dtype(nodes[src]["dtype"])) != str(want.dtype) or len(view[0]) != len(g_view.shape) or \
                not all(dims_equal(a, b) for a, b in zip(view[0], g_view.shape)):
            _fail(f"{where} is not the graph's {want.dtype}[{', '.join(map(str, g_view.shape))}]")
    try:
        return Program.from_json(data)
    except (LuminalError, ValueError, TypeError, KeyError, IndexError, RecursionError, binascii.Error) as exc:
        _fail(f"{type(exc).__name__}: {str(exc)[:160]}")


def _check_data(text, dtype, shape, constants, where: str, shape_text) -> None:
    if not isinstance(text, str):
        _fail(f"{where}: its data is not a text")
    if any(not isinstance(d, int) for d in shape):
        _fail(f"{where}: an array constant of symbolic shape")
    expected = math.prod(shape) * dtype.np.itemsize
    if len(text) != 4 * -(-expected // 3):
        _fail(f"{where}: its data is not {expected} bytes")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        _fail(f"{where}: its data is not base64")
    if len(raw) != expected:
        _fail(f"{where}: its data is not {expected} bytes")
    if (str(dtype), tuple(shape_text), hashlib.sha256(raw).hexdigest()) not in constants:
        _fail(f"{where}: an array constant this graph does not have")
