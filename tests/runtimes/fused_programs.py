"""Hand-built Programs of fused kernels next to the primitive graph they replace.

``Fused(graph)`` starts a Program from a graph's nodes (inputs, weights, and the primitive reference
computation, which stays dead code in the Program: the memory planner drops it) and appends kernel nodes by
hand, the way the compiler's extraction emits them.
"""

from __future__ import annotations

from luminal_recipes.graph import Graph, Node, Tensor, View, to_dtype
from luminal_recipes.runtimes.program import Program


class Fused:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[Node] = list(graph.nodes)

    def add(self, op: str, inputs, shape, dtype="f32", **attrs) -> int:
        edges = tuple((t.node, t.view) if isinstance(t, Tensor) else t for t in inputs)
        node = Node(len(self.nodes), op, edges, tuple(shape), to_dtype(dtype), tuple(sorted(attrs.items())))
        self.nodes.append(node)
        return node.id

    def edge(self, node_id: int, view: View | None = None) -> tuple[int, View]:
        """An edge reading a kernel's output (contiguous unless ``view`` is given)."""
        return (node_id, view or View.contiguous(self.nodes[node_id].shape))

    def program(self, **outputs: int) -> Program:
        return Program(self.nodes, {k: self.edge(v) for k, v in outputs.items()})
