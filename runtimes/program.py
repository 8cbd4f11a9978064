"""The contract between the compiler and the runtimes: a ``Program`` of kernel nodes and the kernel vocabulary.

A ``Program`` has the shape of an HLIR graph (``graph.core.Node`` objects in topological order, inputs are
``(producer id, View)`` edges, every node writes one contiguous output) but its ops are *kernels*: the primitives,
plus the fused kernels that egglog rules discover, each described once in the kernel registry
(``runtimes/kernels``). The compiler emits Programs; a runtime executes them. ``KERNELS`` documents each
kernel's semantics, operands and attributes; both sides must agree with it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from luminal_recipes.graph.core import Graph, Node
from luminal_recipes.graph.serialize import nodes_from_json, nodes_to_json
from luminal_recipes.graph.view import View

from .kernels import REGISTRY

# kernel name -> its contract text (semantics, operands, attributes), from the registry (runtimes/kernels)
KERNELS: dict[str, str] = {name: spec.describe() for name, spec in REGISTRY.items()}


@dataclass
class Program:
    """Kernel nodes in topological order and the named outputs (``(node id, view)`` like ``Graph.outputs``)."""

    nodes: list[Node]
    outputs: dict[str, tuple[int, View]]
    meta: dict = field(default_factory=dict)  # e.g. candidate id, cost estimate, search report

    def kernel_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def to_json(self) -> dict:
        """Nodes and outputs as JSON-ready data (``graph.serialize``'s format; ``meta`` is not included)."""
        return nodes_to_json(self.nodes, self.outputs)

    @staticmethod
    def from_json(data: dict) -> Program:
        nodes, outputs = nodes_from_json(data)
        return Program(nodes, outputs)

    @staticmethod
    def from_graph(graph: Graph) -> Program:
        """The naive program: every primitive is its own kernel (always valid)."""
        return Program(list(graph.nodes), dict(graph.outputs))
