"""Analytic cost model: estimated seconds of a kernel from its flops, its bytes moved and a launch cost.

The same numbers rank e-nodes during extraction (``extract.local_costs``) and whole candidate programs
(``program_cost``). They only need to order candidates sensibly; measurement on the runtime has the last word.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from luminal_recipes.graph.core import Node
from luminal_recipes.graph.dtypes import DType
from luminal_recipes.graph.symbolic import Dim, evaluate, free_symbols
from luminal_recipes.graph.view import View

# size assumed for a symbolic dimension that has no binding (cost only; never used to run anything)
PROBE_DIM = 128


@dataclass(frozen=True)
class Machine:
    launch_s: float = 4e-6          # per kernel call (numpy dispatch, allocation-free)
    bytes_per_s: float = 8e9        # sustained memory bandwidth
    ew_flops_per_s: float = 1.5e9   # elementwise arithmetic
    mm_flops_per_s: float = 4e10    # BLAS matrix products


CPU = Machine()

# flops per output element of the fused kernels, beyond their matmul parts
_PER_ELEMENT = {"Softmax": 5.0, "LayerNorm": 8.0, "RMSNorm": 5.0}
# primitive op names in Programs; anything else is a fused kernel
PRIMITIVES = {"Log2", "Exp2", "Sin", "Sqrt", "Recip", "Add", "Mul", "Mod", "LessThan", "SumReduce",
              "MaxReduce", "Iota", "Gather", "Scatter", "Cast", "Constant", "Input"}


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


@dataclass
class Work:
    """What one kernel does: flops on BLAS, elementwise flops, bytes read and written."""

    mm_flops: float = 0.0
    ew_flops: float = 0.0
    bytes: float = 0.0
    launches: int = 1

    def seconds(self, machine: Machine = CPU) -> float:
        return (self.launches * machine.launch_s + self.bytes / machine.bytes_per_s
                + self.ew_flops / machine.ew_flops_per_s + self.mm_flops / machine.mm_flops_per_s)


def expr_ops(expr: str) -> int:
    """Arithmetic ops in an Elementwise expression string (each '(' opens one op or one constant)."""
    return max(0, expr.count("(") - expr.count("(Const"))


def kernel_work(op: str, out_shape, out_dtype: DType, inputs: list[tuple[View, DType]], attrs: Mapping,
                dims: Mapping[str, int]) -> Work:
    """Work of one Program node (also used for e-nodes, given their class shapes and load views)."""
    if op in ("Input", "Constant"):
        return Work(launches=0)
    out_n = numel(out_shape, dims)
    read = sum(touched(v, dims) * dt.bits / 8 for v, dt in inputs)
    written = out_n * out_dtype.bits / 8
    work = Work(bytes=read + written)
    if op in ("MatMul", "DequantMatMul"):
        k = bind(inputs[0][0].shape[-1], dims)
        work.mm_flops = 2.0 * out_n * k
        if op == "DequantMatMul":
            work.ew_flops = 2.0 * attrs.get("out_features", 1) * attrs.get("in_features", 1)
    elif op in ("Attention", "AttentionBlocked"):
        q, k = inputs[0][0], inputs[1][0]
        s, t, d = bind(q.shape[-2], dims), bind(k.shape[-2], dims), bind(q.shape[-1], dims)
        batch = numel(q.shape[:-2], dims)
        dv = bind(out_shape[-1], dims)
        work.mm_flops = 2.0 * batch * s * t * (d + dv)
        work.ew_flops = 5.0 * batch * s * t
        if op == "Attention":  # one (S, T) score buffer per batch row, written and read back
            work.bytes += 2.0 * batch * s * t * 4
        else:  # online softmax: rescaling the accumulator once per key block
            blocks = max(1, -(-t // int(attrs.get("block", 128))))
            work.ew_flops += 2.0 * batch * s * dv * blocks
    elif op == "Conv2d":
        w = inputs[1][0]
        work.mm_flops = 2.0 * out_n * numel(w.shape[1:], dims)
    elif op == "Elementwise":
        work.ew_flops = out_n * expr_ops(attrs.get("expr", ""))
    elif op in ("SumReduce", "MaxReduce"):
        work.ew_flops = numel(inputs[0][0].shape, dims)
    elif op in _PER_ELEMENT:
        work.ew_flops = _PER_ELEMENT[op] * out_n
    elif op == "Scatter":
        work.bytes += written  # the copy of the destination
    elif op == "ScatterInPlace":
        work.bytes -= written + touched(inputs[0][0], dims) * out_dtype.bits / 8  # only the rows written move
        work.bytes += 2 * touched(inputs[2][0], dims) * out_dtype.bits / 8
    elif op == "Iota":
        work.ew_flops = out_n
    else:
        work.ew_flops = out_n
    return work


def node_seconds(node: Node, dtype_of, dims: Mapping[str, int], machine: Machine = CPU) -> float:
    inputs = [(view, dtype_of(src)) for src, view in node.inputs]
    return kernel_work(node.op, node.shape, node.dtype, inputs, dict(node.attrs), dims).seconds(machine)


def program_cost(program, dims: Mapping[str, int], machine: Machine = CPU) -> float:
    """Estimated seconds of one run of a Program (every kernel once)."""
    dtypes = {n.id: n.dtype for n in program.nodes}
    return sum(node_seconds(n, dtypes.__getitem__, dims, machine) for n in program.nodes)
