"""Analytic cost model: estimated seconds of a kernel from the work its registry spec describes (flops, bytes
moved, launches; ``runtimes.kernels.spec``) on a backend's ``Machine``.

The same numbers rank e-nodes during extraction (``extract.local_costs``) and whole candidate programs
(``program_cost``). They only need to order candidates sensibly; measurement on the runtime has the last word.
"""

from __future__ import annotations

from collections.abc import Mapping

from luminal_recipes.graph.core import Node
from luminal_recipes.graph.dtypes import DType
from luminal_recipes.graph.view import View
from luminal_recipes.runtimes.kernels import (
    PRIMITIVE_KERNELS,
    PROBE_DIM,
    KernelCall,
    Machine,
    Work,
    bind,
    numel,
    spec,
    touched,
)

CPU = Machine()  # a runtime without a machine description of its own is costed as a generic CPU
PRIMITIVES = PRIMITIVE_KERNELS

__all__ = ["CPU", "PRIMITIVES", "PROBE_DIM", "Machine", "Work", "bind", "kernel_work", "node_seconds", "numel",
           "program_cost", "touched"]


def kernel_work(op: str, out_shape, out_dtype: DType, inputs: list[tuple[View, DType]], attrs: Mapping,
                dims: Mapping[str, int]) -> Work:
    """Work of one Program node (also used for e-nodes, given their class shapes and load views)."""
    return spec(op).work(KernelCall(tuple(out_shape), out_dtype, list(inputs), attrs, dims))


def node_seconds(node: Node, dtype_of, dims: Mapping[str, int], machine: Machine = CPU) -> float:
    inputs = [(view, dtype_of(src)) for src, view in node.inputs]
    return kernel_work(node.op, node.shape, node.dtype, inputs, dict(node.attrs), dims).seconds(machine)


def program_cost(program, dims: Mapping[str, int], machine: Machine = CPU, memo: dict | None = None) -> float:
    """Estimated seconds of one run of a Program (every kernel once). ``memo`` (a dict shared by the calls of one
    search, for the same dims and machine) keeps each distinct kernel call's cost: a model's repeated blocks and
    the candidates of one graph repeat most of them."""
    memo = {} if memo is None else memo
    dtypes = {n.id: n.dtype for n in program.nodes}
    total = 0.0
    for n in program.nodes:
        key = (n.op, n.shape, n.dtype, n.attrs, tuple((view, dtypes[src]) for src, view in n.inputs))
        try:
            seconds = memo.get(key)
        except TypeError:  # an unhashable attribute: costed each time
            seconds, key = None, None
        if seconds is None:
            seconds = node_seconds(n, dtypes.__getitem__, dims, machine)
            if key is not None:
                memo[key] = seconds
        total += seconds
    return total
