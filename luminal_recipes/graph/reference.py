"""The reference interpreter: executes HLIR node by node with numpy. The semantic oracle for every test.

It is deliberately simple: each node's output is a fresh contiguous array; each input edge is read through its
view (``BoundView.gather``). Floating-point ops compute in the graph's dtype (``mode="native"``), or in f64 for
every float node (``mode="f64"``) when a test wants an error-free baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..errors import InputError, UnboundDimError
from . import gguf_blocks
from .core import Graph, Node
from .dtypes import DType
from .serialize import reachable
from .symbolic import evaluate, free_symbols, shape_str

WeightSource = Mapping[str, np.ndarray] | Callable[[str], np.ndarray]


def _mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # C semantics (fmod / truncated division), like the CUDA and luminal backends.
    return np.fmod(a, b)


_UNARY = {"Log2": np.log2, "Exp2": np.exp2, "Sin": np.sin, "Sqrt": np.sqrt, "Recip": lambda x: 1 / x}
_BINARY = {"Add": np.add, "Mul": np.multiply, "Mod": _mod, "LessThan": np.less}


def run_reference(
    graph: Graph,
    inputs: Mapping[str, np.ndarray] | None = None,
    weights: WeightSource | None = None,
    dims: Mapping[str, int] | None = None,
    outputs: list[str] | None = None,
    mode: str = "native",
) -> dict[str, np.ndarray]:
    """Run ``graph`` and return its named outputs as numpy arrays (shapes bound by ``dims``)."""
    if mode not in ("native", "f64"):
        raise ValueError("mode must be 'native' or 'f64'")
    inputs = dict(inputs or {})
    dims = dict(dims or {})
    missing = sorted(graph.symbols() - set(dims))
    if missing:
        users = [f"{n.attr('kind')} '{n.name}' {shape_str(n.shape)}" for n in graph.inputs()
                 if free_symbols(n.shape) & set(missing)]
        raise UnboundDimError(
            f"run: symbolic dimension(s) {', '.join(missing)} have no value"
            + (f" (used by {', '.join(users[:3])})" if users else "") + "; pass dims={"
            + ", ".join(f"'{m}': ..." for m in missing) + "}"
        )
    names = list(graph.outputs) if outputs is None else outputs
    need = reachable(graph, [graph.outputs[n][0] for n in names])
    values: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        if node.id in need:
            values[node.id] = _run_node(graph, node, values, inputs, weights, dims, mode)
    result = {}
    for name in names:
        src, view = graph.outputs[name]
        result[name] = view.bind(dims).gather(values[src].reshape(-1))
    return result


def _compute_dtype(dtype: DType, mode: str) -> np.dtype:
    if dtype.is_float:
        return np.dtype(np.float64) if mode == "f64" else (np.dtype(np.float32) if dtype.bits < 16 else dtype.np)
    return dtype.np


def _run_node(graph: Graph, node: Node, values, inputs, weights, dims, mode) -> np.ndarray:
    shape = tuple(evaluate(d, dims) for d in node.shape)
    out_dtype = _compute_dtype(node.dtype, mode)
    args = [view.bind(dims).gather(values[src].reshape(-1)) for src, view in node.inputs]
    op = node.op
    if op == "Input":
        arr = _fetch_input(node, inputs, weights)
        if tuple(arr.shape) != shape:
            raise InputError(
                f"{node.attr('kind')} '{node.name}' has shape {tuple(arr.shape)}, the graph declares "
                f"{shape_str(node.shape)} = {shape} with the given dims"
            )
        return _to_compute(arr, node.dtype, out_dtype)
    if op == "Constant":
        if node.data is not None:
            return _to_compute(node.data, node.dtype, out_dtype)
        return np.asarray(node.attr("value"), dtype=out_dtype).reshape(())
    if op == "Iota":
        return np.arange(shape[0], dtype=np.int32)
    if op in _UNARY:
        with np.errstate(all="ignore"):
            return _round(_UNARY[op](args[0]), node.dtype, out_dtype)
    if op in _BINARY:
        with np.errstate(all="ignore"):
            out = _BINARY[op](args[0], args[1])
        return out if op == "LessThan" else _round(out, node.dtype, out_dtype)
    if op == "SumReduce":
        return np.sum(args[0], axis=node.attr("axis"), dtype=out_dtype)
    if op == "MaxReduce":
        x = args[0]
        if x.shape[node.attr("axis")] == 0:
            return np.full(shape, -np.inf if node.dtype.is_float else np.iinfo(out_dtype).min, dtype=out_dtype)
        return np.max(x, axis=node.attr("axis")).astype(out_dtype, copy=False)
    if op == "Cast":
        return _cast(args[0], graph.nodes[node.inputs[0][0]].dtype, node.dtype, out_dtype)
    if op == "Dequant":
        return _round(gguf_blocks.dequantize(args[0], node.attr("qtype")), node.dtype, out_dtype)
    if op == "Gather":
        table, idx = args
        if idx.size and (idx.min() < 0 or idx.max() >= table.shape[0]):
            raise InputError(f"Gather #{node.id}: index out of range [0, {table.shape[0]}) in {idx.min()}..{idx.max()}")
        return table[idx]
    if op == "Scatter":
        dest, idx, src = args
        out = dest.copy()
        out[idx] = src
        return out
    raise AssertionError(f"reference interpreter has no rule for op {op}")


def _fetch_input(node: Node, inputs, weights) -> np.ndarray:
    name, kind = node.name, node.attr("kind")
    if kind == "weight" and weights is not None:
        arr = weights(name) if callable(weights) else weights.get(name)
        if arr is None:
            raise InputError(f"weight '{name}' was not provided")
    elif name in inputs:
        arr = inputs[name]
    else:
        raise InputError(f"{kind} '{name}' was not provided; pass it in the {kind}s mapping")
    arr = np.asarray(arr)
    if arr.dtype != node.dtype.np:
        raise InputError(f"{kind} '{name}' has dtype {arr.dtype}, the graph declares {node.dtype}; convert it first")
    return arr


def _round(x: np.ndarray, dtype: DType, compute: np.dtype) -> np.ndarray:
    """Results of sub-16-bit float ops are held in f32 but rounded to their dtype, as a device would store them."""
    if dtype.is_float and compute != dtype.np and compute != np.float64:
        return x.astype(dtype.np).astype(compute)
    return x.astype(compute, copy=False)


def _to_compute(arr: np.ndarray, dtype: DType, compute: np.dtype) -> np.ndarray:
    return arr.astype(compute) if arr.dtype != compute else arr


def _cast(x: np.ndarray, src: DType, dst: DType, compute: np.dtype) -> np.ndarray:
    """Round to the target dtype exactly (via ml_dtypes), then hold it in the compute dtype."""
    if dst == DType.BOOL:
        return x != 0
    if dst.is_int:
        if src.is_float:
            with np.errstate(all="ignore"):
                x = np.trunc(x)
        return x.astype(dst.np)
    with np.errstate(over="ignore"):  # overflow becomes inf (or NaN for formats without inf), as on a device
        rounded = x.astype(dst.np) if x.dtype != dst.np else x
    return rounded.astype(compute)
