"""An ATen FX graph (after AOTAutograd's decompositions) translated into one HLIR ``Graph``.

Placeholders become graph inputs, except the ones AOTAutograd reports as static (parameters and buffers): those
become named weights, bound once from the module's own tensors (``params.py``). A ``SymInt`` placeholder becomes a
symbolic dim (Dynamo's own symbol name, e.g. ``s81``); every symbolic size in the graph is read from the node's
``meta["val"]`` (a sympy expression over those symbols) and turned into a ``Dim``; a symbolic size used as a
number (an operand of ``add``) is a 0-dim i32 input each call feeds with its value (``Context.dim_value``). Each
``call_function`` is looked up in the op table (``optable.OPS``); an op that is not there, or whose arguments its
entry refuses, raises ``Unsupported`` naming the op, which the caller turns into a fallback to eager PyTorch (or,
strict, an error).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import LuminalError
from ..graph import DType, Graph, Tensor
from ..graph.symbolic import Expr, add, floordiv, mod, mul, to_dim


class Unsupported(Exception):
    """An FX node this backend cannot translate (``op``: the ATen op's name, ``why``: what about it)."""

    def __init__(self, op: str, why: str = ""):
        super().__init__(f"{op}{': ' + why if why else ''}")
        self.op, self.why = op, why


class UnsupportedTorchOp(LuminalError):
    """``LUMINAL_TORCH_STRICT=1`` and the graph holds an op this backend does not translate."""


_DTYPES = {
    torch.float32: DType.F32, torch.float64: DType.F64, torch.float16: DType.F16, torch.bfloat16: DType.BF16,
    torch.int64: DType.I32, torch.int32: DType.I32, torch.int16: DType.I32, torch.int8: DType.I32,
    torch.uint8: DType.U8, torch.bool: DType.BOOL,
}


# float64 is translated only on the numpy runtime (the HLIR's f64 computes in f64 there; the CUDA kernels have no
# f64), and only by the entries whose compositions are f64 arithmetic as written: element-wise arithmetic,
# powers, exp/log, sin/cos, comparisons and selections, casts, constants and ranges, views, concatenation.
# Everything else that makes or reads a float64 tensor (a matmul, a reduction, a norm: kernels that compute
# floats in f32) runs in eager PyTorch.
F64_RUNTIMES = (None, "numpy")


def _f64_ops() -> frozenset:
    a, prims = torch.ops.aten, torch.ops.prims
    return frozenset([
        a.add.Tensor, a.add.Scalar, a.sub.Tensor, a.sub.Scalar, a.rsub.Scalar, a.rsub.Tensor, a.mul.Tensor,
        a.mul.Scalar, a.div.Tensor, a.div.Scalar, a.neg.default, a.reciprocal.default, a.sqrt.default,
        a.rsqrt.default, a.exp.default, a.exp2.default, a.log.default, a.log2.default, a.sin.default,
        a.cos.default, a.pow.Tensor_Scalar, a.pow.Scalar, a.where.self, a.where.ScalarSelf, a.where.ScalarOther,
        a.where.Scalar, a.masked_fill.Scalar, a.masked_fill.Tensor, a.lt.Tensor, a.lt.Scalar, a.le.Tensor,
        a.le.Scalar, a.gt.Tensor, a.gt.Scalar, a.ge.Tensor, a.ge.Scalar, a.eq.Tensor, a.eq.Scalar, a.ne.Tensor,
        a.ne.Scalar, a.isnan.default, a._to_copy.default, prims.convert_element_type.default, a.clone.default,
        a.alias.default,
        a.lift_fresh_copy.default, a.detach.default, a.full.default, a.full_like.default, a.scalar_tensor.default,
        a.arange.start_step, a.arange.start, a.arange.default, a.view.default, a._unsafe_view.default,
        a.reshape.default, a.permute.default, a.transpose.int, a.t.default, a.unsqueeze.default, a.squeeze.dim,
        a.squeeze.dims, a.squeeze.default, a.expand.default, a.slice.Tensor, a.select.int, a.cat.default,
        a.split.Tensor, a.split_with_sizes.default, a.unbind.int, a.repeat.default, a.flip.default,
    ])


F64_OPS = _f64_ops()


def _is_f64(value, shaped: bool = False) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 and (not shaped or v.dim() > 0)
               for v in values)


def f64_refusal(node: torch.fx.Node, f64: bool) -> str | None:
    """Why ``node`` cannot be translated for its float64 values (None: it can). A node makes or reads a float64
    tensor: translated where ``f64`` (the runtime computes in f64) and its op is in ``F64_OPS``. A 0-dim float64
    operand (a Python float Dynamo passes as a tensor under ``dynamic=True``) does not count: entries cast their
    operands to the output's dtype, as torch does with a 0-dim tensor."""
    if not (_is_f64(node.meta.get("val")) or any(_is_f64(a.meta.get("val"), shaped=True)
                                                 for a in node.all_input_nodes)):
        return None
    if not f64:
        return "float64: this runtime has no f64 kernels (the numpy runtime computes float64 in f64)"
    if node.target not in F64_OPS:
        return "float64 operands: this entry computes floats in f32 (docs/torch.md lists the float64 ops)"
    return None


def op_name(target) -> str:
    return str(target) if not callable(target) or isinstance(target, torch._ops.OpOverload) \
        else getattr(target, "__name__", str(target))


def sym_to_dim(expr) -> object:
    """A sympy expression over Dynamo's size symbols as a ``Dim`` (int or ``Expr``)."""
    import sympy
    from torch.utils._sympy.functions import CleanDiv, FloorDiv, Mod, PythonMod

    if isinstance(expr, int):
        return expr
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return Expr.symbol(str(expr))
    if isinstance(expr, sympy.Add):
        out = 0
        for a in expr.args:
            out = add(out, sym_to_dim(a))
        return out
    if isinstance(expr, sympy.Mul):
        out = 1
        for a in expr.args:
            out = mul(out, sym_to_dim(a))
        return out
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        out = 1
        for _ in range(int(expr.exp)):
            out = mul(out, sym_to_dim(expr.base))
        return out
    if isinstance(expr, (FloorDiv, CleanDiv)) and expr.args[1].is_Integer:
        return floordiv(sym_to_dim(expr.args[0]), int(expr.args[1]))
    if isinstance(expr, (Mod, PythonMod)) and expr.args[1].is_Integer:
        return mod(sym_to_dim(expr.args[0]), int(expr.args[1]))
    raise Unsupported("symbolic size", f"expression {expr} has no HLIR form")


def _expr(x: torch.SymInt):
    """The SymInt's expression after the shape environment's replacements (a guard ``s94 == s87`` made while
    tracing turns every ``s94`` into ``s87``)."""
    node = x.node
    env = getattr(node, "shape_env", None)
    return env.replace(node.expr) if env is not None else node.expr


def as_dim(x) -> object:
    if isinstance(x, torch.SymInt):
        return sym_to_dim(_expr(x))
    if isinstance(x, bool) or not isinstance(x, (int, Expr)):
        raise Unsupported("size", f"{x!r} is not an integer size")
    return to_dim(x)


def to_dtype(dt: torch.dtype, compute: DType | None = None) -> DType:
    if dt not in _DTYPES:
        raise Unsupported(f"dtype {dt}", "no HLIR dtype (f32, f16, bf16, integers as i32, u8, bool)")
    out = _DTYPES[dt]
    return compute if compute is not None and out == DType.F32 else out


@dataclass
class Placeholder:
    """How one FX placeholder (in call order) is fed: a graph input, a weight, a symbolic dim, or unused."""

    kind: str            # "input" | "weight" | "dim"
    name: str
    torch_dtype: torch.dtype | None = None
    shape: tuple = ()


@dataclass
class Translation:
    graph: Graph
    placeholders: list[Placeholder]
    outputs: list[tuple]  # per FX output: ("tensor", name, torch dtype) | ("arg", placeholder index) |
                          # ("dim", Dim) | ("none",)
    inputs: dict[str, Tensor] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)  # ATen op name -> count
    single: bool = False  # the graph returns one value, not a tuple (a partition's submodule)
    values: dict[str, object] = field(default_factory=dict)  # i32 scalar input -> the symbolic size it carries


class Context:
    """What an op-table entry is given: the graph, the node being translated, and helpers for its meta."""

    def __init__(self, graph: Graph, compute: DType | None, f64: bool = True):
        self.g = graph
        self.compute = compute
        self.f64 = f64  # float64 translates (the runtime computes it in f64)
        self.node: torch.fx.Node | None = None
        self.values: dict[str, object] = {}  # input name -> the symbolic size it carries (``dim_value``)

    def dim_value(self, d, dtype: DType = DType.I32) -> Tensor:
        """A symbolic size used as a number (``arange(n) + past_length``, ``cumulative_length + n``): a 0-dim i32
        input that each call feeds with the size's value (``CompiledGraph``), so every program computes with the
        actual length, never with a size bucket's."""
        if isinstance(d, int):
            return self.g.constant(d, dtype)
        name = next((n for n, known in self.values.items() if known == d), None)
        if name is None:
            name = f"dim_value{len(self.values)}"
            self.values[name] = d
            t = self.g.input(name, (), DType.I32)
        else:
            t = self.g.tensor(name)
        return t if dtype == DType.I32 else t.cast(dtype)

    def val(self, node=None):
        node = self.node if node is None else node
        return node.meta.get("val")

    def out_shape(self, index: int | None = None) -> tuple:
        v = self.val()
        if index is not None:
            v = v[index]
        return tuple(as_dim(d) for d in v.shape)

    def out_dtype(self, index: int | None = None) -> DType:
        v = self.val()
        if index is not None:
            v = v[index]
        return to_dtype(v.dtype, self.compute)

    def dtype(self, dt: torch.dtype) -> DType:
        return to_dtype(dt, self.compute)


def translate(gm: torch.fx.GraphModule, static: set[int], compute: DType | None = None,
              f64: bool = True) -> Translation:
    """Translate ``gm`` (ATen ops); placeholders whose positions are in ``static`` become weights; float64 where
    ``f64`` (the runtime computes in f64), else it is refused."""

    graph = Graph()
    cx = Context(graph, compute, f64)
    env: dict[torch.fx.Node, object] = {}
    placeholders: list[Placeholder] = []
    inputs: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    outputs: list[tuple] = []
    position = 0
    block, start = None, 0
    for node in gm.graph.nodes:
        cx.node = node
        key = _block_of(node) if node.op == "call_function" else block
        if key != block:  # a repeated layer (``layers.3``) is one block: the compiler searches equal ones once
            if block is not None:
                graph.blocks[block] = range(start, len(graph.nodes))
            block, start = (key if key not in graph.blocks else None), len(graph.nodes)
        try:
            position = _one(gm, node, cx, env, placeholders, inputs, counts, outputs, static, compute, position)
        except Unsupported as exc:
            if not hasattr(exc, "node"):
                exc.node = node.name if node.op == "call_function" else None
            raise
    if block is not None:
        graph.blocks[block] = range(start, len(graph.nodes))
    for name in cx.values:
        inputs[name] = graph.tensor(name)
    return Translation(graph, placeholders, outputs, inputs, counts, getattr(cx, "single", False), dict(cx.values))


def _block_of(node: torch.fx.Node) -> str | None:
    """The outermost module of ``node``'s module stack that is an element of a ModuleList (its path ends in an
    index: ``model.layers.3``), or None."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def _one(gm, node, cx, env, placeholders, inputs, counts, outputs, static, compute, position) -> int:
    """Translate one FX node into ``env``; returns the next placeholder position."""
    from .optable import OPS

    graph = cx.g
    val = node.meta.get("val")
    if node.op == "placeholder":
        index, position = position, position + 1
        if isinstance(val, torch.SymInt):
            dim = as_dim(val)
            placeholders.append(Placeholder("dim", str(val.node.expr)))
            env[node] = dim
            return position
        if not isinstance(val, torch.Tensor):
            raise Unsupported("input", f"placeholder {node.name} is {type(val).__name__}, not a tensor")
        if val.device.type != "cpu" and val.device.type != "meta":
            raise Unsupported("input", f"{node.name} lives on {val.device}; the backend takes CPU tensors")
        shape = tuple(as_dim(d) for d in val.shape)
        if val.dtype == torch.float64 and (val.dim() == 0 or cx.f64):
            # f64 where the runtime computes in f64; else a Python float Dynamo passes as a 0-dim float64 tensor
            # (dynamic=True) is an f32 input: torch computes with it in the other operand's dtype (a 0-dim tensor
            # does not promote)
            dtype = DType.F64 if cx.f64 else compute or DType.F32
        elif val.dtype not in _DTYPES or val.dtype == torch.float64:
            raise Unsupported(f"input of dtype {val.dtype}", f"placeholder {node.name}")
        else:
            dtype = to_dtype(val.dtype, compute)
        name = f"p{index}_{node.name}"
        kind = "weight" if index in static else "input"
        t = graph.weight(name, shape, dtype) if kind == "weight" else graph.input(name, shape, dtype)
        if kind == "input":
            inputs[name] = t
        placeholders.append(Placeholder(kind, name, val.dtype, shape))
        env[node] = t
    elif node.op == "get_attr":
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            raise Unsupported("get_attr", f"{node.target} is not a tensor")
        if value.numel() > 4096:
            raise Unsupported("get_attr", f"constant {node.target} has {value.numel()} elements")
        dtype = to_dtype(value.dtype, compute)
        array = value.detach().cpu()
        if value.dtype == torch.float64 and not cx.f64:
            raise Unsupported("get_attr", f"constant {node.target} is float64; this runtime has no f64 kernels")
        array = (array.to(torch.float64) if dtype == DType.F64 else array.to(torch.float32)) \
            if array.dtype.is_floating_point else array.to(torch.int64)
        env[node] = graph.constant(array.numpy(), dtype) if value.dim() else \
            graph.constant(array.item(), dtype)
    elif node.op == "call_function":
        name = op_name(node.target)
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool) and \
                node.target is not operator.getitem:
            env[node] = as_dim(val)  # size arithmetic: read from the node's value, not recomputed
            return position
        if node.target is operator.getitem:
            src = env[node.args[0]]
            item = src[node.args[1]]
            if item is None:
                raise Unsupported(op_name(node.args[0].target), f"output {node.args[1]} is not translated")
            env[node] = item
            return position
        fn = OPS.get(node.target)
        if fn is None:
            raise Unsupported(name)
        refused = f64_refusal(node, cx.f64)
        if refused:
            raise Unsupported(name, refused)
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        counts[name] = counts.get(name, 0) + 1
        try:
            env[node] = fn(cx, *args, **kwargs)
        except Unsupported as exc:
            if exc.op.startswith(("dtype", "size", "symbolic")):  # name the op that met it
                raise Unsupported(name, f"{exc.op}: {exc.why}") from exc
            raise
        except LuminalError as exc:
            raise Unsupported(name, str(exc)) from exc
    elif node.op == "output":
        placeholder_nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
        result = node.args[0]
        cx.single = not isinstance(result, (list, tuple))
        for i, out in enumerate([result] if cx.single else result):
            if out is None:
                outputs.append(("none",))
            elif isinstance(out, torch.fx.Node) and out.op == "placeholder":
                outputs.append(("arg", placeholder_nodes.index(out)))
            else:
                value = env[out] if isinstance(out, torch.fx.Node) else out
                if isinstance(value, Tensor):
                    ov = out.meta.get("val")
                    graph.mark_output(f"out{i}", value)
                    outputs.append(("tensor", f"out{i}", ov.dtype, tuple(ov.shape)))
                elif isinstance(value, (int, Expr)):
                    outputs.append(("dim", value))
                else:
                    raise Unsupported("output", f"output {i} is {type(value).__name__}")
    else:
        raise Unsupported(node.op)
    return position
