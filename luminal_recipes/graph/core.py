"""The lazy tensor graph (HLIR): nodes are primitive ops, edges carry zero-copy views.

Nothing computes here. ``Graph`` records nodes; ``Tensor`` is a handle ``(graph, node, view, dtype)``. Every node
writes one contiguous output of its ``shape``; consumers read it through the ``View`` stored on their input edge.

Primitive ops (luminal's set): unary ``Log2 Exp2 Sin Sqrt Recip``; binary ``Add Mul Mod LessThan``; ``SumReduce
MaxReduce`` over one axis; ``Iota`` (0..n-1 as i32); ``Gather`` (rows of a table by index); ``Scatter`` (rows written
into a copy of a destination); ``Cast``; ``Dequant`` (GGUF block-quantized bytes decoded to floats, as a cast
from a block format: ``graph.gguf_blocks`` defines the formats); plus ``Constant`` and ``Input`` (activations and
named weights).
Binary ops need equal shapes and dtypes: broadcasting and promotion are always explicit.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BroadcastError, DTypeError, GraphError, ShapeError
from .dtypes import DType, to_dtype
from .symbolic import Dim, dims_equal, free_symbols, prod, shape_str, to_dim
from .view import View

UNARY_OPS = ("Log2", "Exp2", "Sin", "Sqrt", "Recip")
BINARY_OPS = ("Add", "Mul", "Mod", "LessThan")
REDUCE_OPS = ("SumReduce", "MaxReduce")
PRIMITIVE_OPS = UNARY_OPS + BINARY_OPS + REDUCE_OPS + ("Iota", "Gather", "Scatter", "Cast", "Dequant", "Constant",
                                                      "Input")


@dataclass(frozen=True)
class Node:
    """One primitive op. ``inputs`` are ``(producer id, view)`` edges; the output is contiguous ``shape``."""

    id: int
    op: str
    inputs: tuple[tuple[int, View], ...]
    shape: tuple[Dim, ...]
    dtype: DType
    attrs: tuple[tuple[str, Any], ...] = ()
    data: np.ndarray | None = field(default=None, compare=False, repr=False)  # array constants only

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def name(self) -> str | None:
        return self.attr("name")


class Graph:
    """A DAG of primitive ops. Build it through ``input``/``weight``/``constant`` and ``Tensor`` methods."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.outputs: dict[str, tuple[int, View]] = {}
        self._inputs_by_name: dict[str, int] = {}
        self._scalar_consts: dict[tuple, int] = {}
        # name -> node ids created inside ``block(name)``: repeated layers the compiler searches once
        self.blocks: dict[str, range] = {}

    @contextmanager
    def block(self, name: str) -> Iterator[None]:
        """Mark the nodes created inside as one block (e.g. ``layers.3``). Blocks whose subgraphs hash equal
        (``serialize.structural_hashes``) share one compiler search; nodes made earlier are the block's inputs."""
        start = len(self.nodes)
        try:
            yield
        finally:  # also when the body leaves by an exception (the recipe interpreter returns that way)
            self.blocks[name] = range(start, len(self.nodes))

    # ---- node creation -----------------------------------------------------------------------------------------
    def add_node(
        self, op: str, inputs, shape, dtype: DType, attrs: dict | None = None, data: np.ndarray | None = None
    ) -> Node:
        if op not in PRIMITIVE_OPS:
            raise GraphError(f"unknown primitive op '{op}'; primitives are {', '.join(PRIMITIVE_OPS)}")
        node = Node(len(self.nodes), op, tuple(inputs), tuple(shape), dtype, tuple(sorted((attrs or {}).items())), data)
        self.nodes.append(node)
        return node

    def _source(self, op: str, name: str, shape, dtype, kind: str) -> Tensor:
        if name in self._inputs_by_name:
            raise GraphError(f"{op} '{name}' is declared twice in this graph; names of inputs and weights are unique")
        shape = tuple(to_dim(d) for d in shape)
        for d in shape:
            if isinstance(d, int) and d < 0:
                raise ShapeError(
                    f"{op} '{name}': shape {shape_str(shape)} has a negative dimension; sizes "
                    f"are >= 0 (name a symbol such as 's' for a size known only at run time)"
                )
        node = self.add_node("Input", (), shape, to_dtype(dtype), {"name": name, "kind": kind})
        self._inputs_by_name[name] = node.id
        return Tensor(self, node.id, View.contiguous(shape), node.dtype)

    def input(self, name: str, shape, dtype="f32") -> Tensor:
        """An activation input, supplied at run time."""
        return self._source("input", name, shape, dtype, "input")

    def weight(self, name: str, shape, dtype="f32") -> Tensor:
        """A named weight, bound lazily by the runtime (e.g. from a memory-mapped checkpoint)."""
        return self._source("weight", name, shape, dtype, "weight")

    def state(self, name: str, shape, dtype="f32") -> Tensor:
        """A state buffer (e.g. a KV cache): it lives in the executable across runs, starts at zero, and its new
        value is the output of the same name (``update_state``). The reference interpreter takes its current
        value as an input of that name."""
        return self._source("state", name, shape, dtype, "state")

    def update_state(self, name: str, t: Tensor) -> Tensor:
        """Declare ``t`` the new value of state ``name`` after a run (an output of the same name)."""
        node = self._inputs_by_name.get(name)
        if node is None or self.nodes[node].attr("kind") != "state":
            raise GraphError(f"update_state: '{name}' is not a state of this graph; declare it with state()")
        src = self.nodes[node]
        if not (t.dtype == src.dtype and len(t.shape) == len(src.shape)
                and all(dims_equal(a, b) for a, b in zip(t.shape, src.shape))):
            raise ShapeError(f"update_state: state '{name}' is {src.dtype}{shape_str(src.shape)}, its new value "
                             f"{t.dtype}{shape_str(t.shape)}")
        return self.mark_output(name, t)

    def constant(self, value, dtype="f32") -> Tensor:
        """A constant: a Python scalar (shape ``()``, deduplicated) or a small numpy array (stored in the graph)."""
        dtype = to_dtype(dtype)
        if np.ndim(value) == 0:
            v = float(value) if dtype.is_float else int(value)
            key = (dtype, repr(v))
            if key not in self._scalar_consts:
                self._scalar_consts[key] = self.add_node("Constant", (), (), dtype, {"value": v}).id
            return Tensor(self, self._scalar_consts[key], View.contiguous(()), dtype)
        arr = np.ascontiguousarray(np.asarray(value).astype(dtype.np))
        digest = hashlib.sha256(arr.tobytes()).hexdigest()[:16]
        node = self.add_node("Constant", (), arr.shape, dtype, {"array": digest}, data=arr)
        return Tensor(self, node.id, View.contiguous(arr.shape), dtype)

    def iota(self, n: Dim | str) -> Tensor:
        n = to_dim(n)
        node = self.add_node("Iota", (), (n,), DType.I32)
        return Tensor(self, node.id, View.contiguous((n,)), DType.I32)

    def mark_output(self, name: str, t: Tensor) -> Tensor:
        t._check_graph(self, "mark_output")
        self.outputs[name] = (t.node, t.view)
        return t

    # ---- queries -----------------------------------------------------------------------------------------------
    def node(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def inputs(self, kind: str | None = None) -> list[Node]:
        return [n for n in self.nodes if n.op == "Input" and (kind is None or n.attr("kind") == kind)]

    def symbols(self) -> set[str]:
        out: set[str] = set()
        for n in self.nodes:
            out |= free_symbols(n.shape)
        return out

    def tensor(self, name: str) -> Tensor:
        if name in self.outputs:
            nid, view = self.outputs[name]
            return Tensor(self, nid, view, self.nodes[nid].dtype)
        nid = self._inputs_by_name[name]
        return Tensor(self, nid, View.contiguous(self.nodes[nid].shape), self.nodes[nid].dtype)

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        from .serialize import format_graph

        return format_graph(self)


class Tensor:
    """A lazy handle on a node's output seen through a view. Movement methods return new views, never copies."""

    __slots__ = ("graph", "node", "view", "dtype")

    def __init__(self, graph: Graph, node: int, view: View, dtype: DType):
        self.graph, self.node, self.view, self.dtype = graph, node, view, dtype

    # ---- basic properties ------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.view.shape

    @property
    def ndim(self) -> int:
        return len(self.view.shape)

    @property
    def numel(self) -> Dim:
        return prod(self.view.shape)

    @property
    def name(self) -> str | None:
        return self.graph.nodes[self.node].name

    def __repr__(self) -> str:
        return f"Tensor({self.graph.nodes[self.node].op}#{self.node}, {shape_str(self.shape)}, {self.dtype})"

    def _check_graph(self, graph: Graph, op: str) -> None:
        if graph is not self.graph:
            raise GraphError(f"{op}: operands belong to different graphs; build each model in one Graph")

    def _with_view(self, view: View) -> Tensor:
        return Tensor(self.graph, self.node, view, self.dtype)

    def _axis(self, axis: int, op: str) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise ShapeError(f"{op}: axis {axis} is out of range for a tensor of shape {shape_str(self.shape)}")
        return axis % self.ndim

    # ---- movement (views) ------------------------------------------------------------------------------------
    def permute(self, *axes) -> Tensor:
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return self._with_view(self.view.permute(axes))

    def transpose(self, a: int = -2, b: int = -1) -> Tensor:
        a, b = self._axis(a, "transpose"), self._axis(b, "transpose")
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.permute(axes)

    @property
    def T(self) -> Tensor:  # noqa: N802 - the conventional name
        return self.transpose(-2, -1)

    def contiguous(self) -> Tensor:
        """Materialise this view into a new contiguous buffer (``x + 0``, as luminal does)."""
        if self.view.is_contiguous():
            return self
        zero = self.graph.constant(0, self.dtype).broadcast_to(self.shape)
        return _binary("Add", self, zero)

    def reshape(self, *shape) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(to_dim(d) for d in shape)
        if -1 in shape:
            shape = _infer_minus_one(self.shape, shape)
        if not dims_equal(prod(shape), self.numel):
            raise ShapeError(
                f"reshape: cannot reshape {shape_str(self.shape)} ({self.numel} elements) to {shape_str(shape)} "
                f"({prod(shape)} elements); the element counts must agree"
            )
        view = self.view.reshape(shape)
        if view is None:  # strides cannot express it: copy to a contiguous buffer first
            base = self.contiguous()
            return base._with_view(base.view.reshape(shape))
        return self._with_view(view)

    def merge_dims(self, a: int, b: int) -> Tensor:
        a, b = self._axis(a, "merge_dims"), self._axis(b, "merge_dims")
        if b != a + 1:
            raise ShapeError(f"merge_dims: axes {a} and {b} must be adjacent (b == a + 1)")
        shape = self.shape[:a] + (self.shape[a] * self.shape[b],) + self.shape[b + 1 :]
        return self.reshape(shape)

    def split_dim(self, axis: int, sizes) -> Tensor:
        axis = self._axis(axis, "split_dim")
        sizes = tuple(to_dim(s) for s in sizes)
        if -1 in sizes:
            sizes = _infer_minus_one((self.shape[axis],), sizes)
        return self.reshape(self.shape[:axis] + sizes + self.shape[axis + 1 :])

    def slice(self, axis: int, start: Dim | str | None = None, stop: Dim | str | None = None, step: int = 1) -> Tensor:
        axis = self._axis(axis, "slice")
        size = self.shape[axis]
        start = 0 if start is None else to_dim(start)
        stop = size if stop is None else to_dim(stop)
        if isinstance(start, int) and start < 0 and isinstance(size, int):
            start += size
        if isinstance(stop, int) and stop < 0 and isinstance(size, int):
            stop += size
        return self._with_view(self.view.slice(axis, start, stop, step))

    def flip(self, axis: int) -> Tensor:
        """Reverse the order along one axis (a view with a negative stride)."""
        return self._with_view(self.view.flip(self._axis(axis, "flip")))

    def pad(self, axis: int, before: Dim, after: Dim) -> Tensor:
        """Zero-pad one axis (the view reads 0 outside the original range)."""
        return self._with_view(self.view.pad(self._axis(axis, "pad"), before, after))

    def expand(self, axis: int, size: Dim | str) -> Tensor:
        """Insert a broadcast axis of ``size`` at position ``axis`` (stride 0)."""
        if axis < 0:
            axis += self.ndim + 1
        return self._with_view(self.view.expand(axis, size))

    def unsqueeze(self, axis: int) -> Tensor:
        return self.expand(axis, 1)

    def squeeze(self, axis: int) -> Tensor:
        axis = self._axis(axis, "squeeze")
        if not dims_equal(self.shape[axis], 1):
            raise ShapeError(
                f"squeeze: axis {axis} of shape {shape_str(self.shape)} has size {self.shape[axis]}, not 1"
            )
        return self.reshape(self.shape[:axis] + self.shape[axis + 1 :])

    def broadcast_to(self, shape) -> Tensor:
        """numpy-style explicit broadcast: new leading axes and size-1 axes stretch (stride 0)."""
        shape = tuple(to_dim(d) for d in shape)
        if len(shape) < self.ndim:
            raise BroadcastError(
                f"broadcast_to: cannot broadcast {shape_str(self.shape)} to fewer dims {shape_str(shape)}"
            )
        view = self.view
        for _ in range(len(shape) - self.ndim):
            view = view.expand(0, 1)
        for axis, (have, want) in enumerate(zip(view.shape, shape)):
            if dims_equal(have, want):
                continue
            if not dims_equal(have, 1):
                raise BroadcastError(
                    f"broadcast_to: cannot broadcast {shape_str(self.shape)} to {shape_str(shape)}: axis {axis} has "
                    f"size {have}, expected {want} or 1"
                )
            view = view.broadcast_dim(axis, want)
        return self._with_view(view)

    # ---- arithmetic sugar (same-shape tensors, or Python scalars broadcast explicitly) ------------------------
    def _lift(self, other) -> Tensor:
        if isinstance(other, Tensor):
            return other
        if isinstance(other, (int, float, np.number)):
            return self.graph.constant(other, self.dtype).broadcast_to(self.shape)
        raise DTypeError(f"cannot combine a tensor with {type(other).__name__}; use a Tensor or a Python number")

    def __add__(self, other) -> Tensor:
        return _binary("Add", self, self._lift(other))

    def __radd__(self, other) -> Tensor:
        return _binary("Add", self._lift(other), self)

    def __mul__(self, other) -> Tensor:
        return _binary("Mul", self, self._lift(other))

    def __rmul__(self, other) -> Tensor:
        return _binary("Mul", self._lift(other), self)

    def __neg__(self) -> Tensor:
        return self * -1.0 if self.dtype.is_float else self * -1

    def __sub__(self, other) -> Tensor:
        return self + (-self._lift(other))

    def __rsub__(self, other) -> Tensor:
        return self._lift(other) + (-self)

    def __truediv__(self, other) -> Tensor:
        if isinstance(other, (int, float)):
            return self * (1.0 / other)
        return self * unary("Recip", self._lift(other))

    def __rtruediv__(self, other) -> Tensor:
        return self._lift(other) * unary("Recip", self)

    def __mod__(self, other) -> Tensor:
        return _binary("Mod", self, self._lift(other))

    def __lt__(self, other) -> Tensor:
        return _binary("LessThan", self, self._lift(other))

    def __gt__(self, other) -> Tensor:
        return _binary("LessThan", self._lift(other), self)

    def cast(self, dtype) -> Tensor:
        return cast(self, dtype)


def _infer_minus_one(old_shape, shape):
    known = [d for d in shape if not (isinstance(d, int) and d == -1)]
    if len(known) != len(shape) - 1:
        raise ShapeError(f"reshape: at most one -1 is allowed in {shape_str(shape)}")
    from .symbolic import floordiv

    total, rest = prod(old_shape), prod(known)
    if isinstance(rest, int) and isinstance(total, int) and (rest == 0 or total % rest):
        raise ShapeError(f"reshape: cannot infer -1 in {shape_str(shape)} from {shape_str(old_shape)}")
    if not isinstance(rest, int):
        raise ShapeError(f"reshape: cannot infer -1 when the other dims are symbolic ({shape_str(shape)})")
    missing = floordiv(total, rest)
    return tuple(missing if isinstance(d, int) and d == -1 else d for d in shape)


# ---- primitive constructors ------------------------------------------------------------------------------------
def _edge(t: Tensor) -> tuple[int, View]:
    return (t.node, t.view)


def unary(op: str, x: Tensor) -> Tensor:
    if op not in UNARY_OPS:
        raise GraphError(f"'{op}' is not a unary primitive ({', '.join(UNARY_OPS)})")
    if not x.dtype.is_float:
        raise DTypeError(f"{op}: needs a floating-point operand, got {x.dtype}; cast it first, e.g. x.cast('f32')")
    node = x.graph.add_node(op, (_edge(x),), x.shape, x.dtype)
    return Tensor(x.graph, node.id, View.contiguous(x.shape), x.dtype)


def _binary(op: str, a: Tensor, b: Tensor) -> Tensor:
    a._check_graph(b.graph, op)
    if len(a.shape) != len(b.shape) or not all(dims_equal(x, y) for x, y in zip(a.shape, b.shape)):
        raise BroadcastError(
            f"{op}: operand shapes {shape_str(a.shape)} and {shape_str(b.shape)} differ; HLIR never broadcasts "
            f"implicitly: call .broadcast_to(...) or .expand(axis, size) on the smaller operand first"
        )
    if a.dtype != b.dtype:
        raise DTypeError(
            f"{op}: operand dtypes {a.dtype} and {b.dtype} differ; HLIR never promotes implicitly: cast one "
            f"operand, e.g. b.cast('{a.dtype}')"
        )
    out_dtype = DType.BOOL if op == "LessThan" else a.dtype
    node = a.graph.add_node(op, (_edge(a), _edge(b)), a.shape, out_dtype)
    return Tensor(a.graph, node.id, View.contiguous(a.shape), out_dtype)


def binary(op: str, a: Tensor, b: Tensor) -> Tensor:
    if op not in BINARY_OPS:
        raise GraphError(f"'{op}' is not a binary primitive ({', '.join(BINARY_OPS)})")
    return _binary(op, a, b)


def reduce(op: str, x: Tensor, axis: int) -> Tensor:
    if op not in REDUCE_OPS:
        raise GraphError(f"'{op}' is not a reduction primitive ({', '.join(REDUCE_OPS)})")
    axis = x._axis(axis, op)
    if x.dtype == DType.BOOL:
        raise DTypeError(f"{op}: cannot reduce a bool tensor; cast it to i32 or f32 first")
    shape = x.shape[:axis] + x.shape[axis + 1 :]
    node = x.graph.add_node(op, (_edge(x),), shape, x.dtype, {"axis": axis})
    return Tensor(x.graph, node.id, View.contiguous(shape), x.dtype)


def cast(x: Tensor, dtype) -> Tensor:
    dtype = to_dtype(dtype)
    source = _materialised(x)
    if source is not None and dtype.bits <= x.dtype.bits:
        # a narrowing cast of a materialised view (``contiguous()``: a reshape strides cannot express, e.g. the
        # repeat_interleave of diffusers' f64 RoPE tables then ``.float()``): cast the viewed tensor in its own
        # shape, where the cast can fuse into its element-wise producer, and materialise the narrower values
        # instead. The same elements move in the same order, so the values are the Cast's
        producer, view = source
        narrow = cast(Tensor(x.graph, producer, View.contiguous(x.graph.node(producer).shape), x.dtype), dtype)
        return narrow._with_view(view).contiguous()._with_view(x.view)
    node = x.graph.add_node("Cast", (_edge(x),), x.shape, dtype)
    return Tensor(x.graph, node.id, View.contiguous(x.shape), dtype)


def _materialised(x: Tensor) -> tuple[int, View] | None:
    """``(producer, view)`` when ``x`` reads the buffer ``contiguous()`` made of that view of a whole contiguous
    tensor (``view + 0``), else None."""
    node = x.graph.node(x.node)
    if node.op != "Add" or len(node.inputs) != 2:
        return None
    (producer, view), (zero, _) = node.inputs
    const = x.graph.node(zero)
    value = dict(const.attrs).get("value")
    if const.op != "Constant" or const.shape != () or value != 0 or math.copysign(1.0, value) < 0:
        return None  # x + (-0.0) keeps a -0.0 that x + 0 makes +0.0
    return producer, view


def dequant(packed: Tensor, qtype: str, dtype="f32") -> Tensor:
    """``packed`` u8 ``[..., row_bytes]``, rows of whole GGUF ``qtype`` blocks -> ``[..., K]`` decoded values
    (``graph.gguf_blocks``: K = row_bytes / type_size * block_size), computed in f32."""
    from . import gguf_blocks

    if qtype not in gguf_blocks.QTYPES:
        raise DTypeError(f"Dequant: unknown GGUF quantization type {qtype!r}; supported: "
                         f"{', '.join(gguf_blocks.QTYPES)}")
    if packed.dtype != DType.U8:
        raise DTypeError(f"Dequant: packed {qtype} data must be u8 bytes, got {packed.dtype}")
    if packed.ndim < 1 or not isinstance(packed.shape[-1], int):
        raise ShapeError(f"Dequant: packed {qtype} data needs a fixed last axis of bytes, got "
                         f"{shape_str(packed.shape)}")
    _, bs, ts = gguf_blocks.QTYPES[qtype]
    if packed.shape[-1] % ts:
        raise ShapeError(f"Dequant: rows of {packed.shape[-1]} bytes are not whole {qtype} blocks of {ts} bytes")
    dt = to_dtype(dtype)
    shape = packed.shape[:-1] + (packed.shape[-1] // ts * bs,)
    node = packed.graph.add_node("Dequant", (_edge(packed),), shape, dt, {"qtype": qtype})
    return Tensor(packed.graph, node.id, View.contiguous(shape), dt)


def gather(table: Tensor, indices: Tensor) -> Tensor:
    """``out[i..., r...] = table[indices[i...], r...]``: rows of ``table`` picked by i32 ``indices``."""
    table._check_graph(indices.graph, "Gather")
    if indices.dtype != DType.I32:
        raise DTypeError(f"Gather: indices must be i32, got {indices.dtype}; cast them with .cast('i32')")
    if table.ndim < 1:
        raise ShapeError("Gather: the table needs at least one axis to index")
    shape = indices.shape + table.shape[1:]
    node = table.graph.add_node("Gather", (_edge(table), _edge(indices)), shape, table.dtype)
    return Tensor(table.graph, node.id, View.contiguous(shape), table.dtype)


def scatter(dest: Tensor, indices: Tensor, src: Tensor) -> Tensor:
    """A copy of ``dest`` with rows ``indices[j]`` replaced by ``src[j]`` (KV-cache writes)."""
    dest._check_graph(src.graph, "Scatter")
    if indices.dtype != DType.I32 or indices.ndim != 1:
        raise DTypeError(f"Scatter: indices must be a 1-D i32 tensor, got {indices.dtype} {shape_str(indices.shape)}")
    want = indices.shape + dest.shape[1:]
    if src.ndim != len(want) or not all(dims_equal(a, b) for a, b in zip(src.shape, want)):
        raise ShapeError(
            f"Scatter: source rows have shape {shape_str(src.shape)}, expected {shape_str(want)} "
            f"(len(indices) rows of the destination's row shape)"
        )
    if src.dtype != dest.dtype:
        raise DTypeError(f"Scatter: source dtype {src.dtype} differs from destination {dest.dtype}; cast it first")
    node = dest.graph.add_node("Scatter", (_edge(dest), _edge(indices), _edge(src)), dest.shape, dest.dtype)
    return Tensor(dest.graph, node.id, View.contiguous(dest.shape), dest.dtype)
