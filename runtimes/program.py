"""The contract between the compiler and the runtimes: a ``Program`` of kernel nodes and the kernel vocabulary.

A ``Program`` has the shape of an HLIR graph (``graph.core.Node`` objects in topological order, inputs are
``(producer id, View)`` edges, every node writes one contiguous output) but its ops are *kernels*: the primitives,
plus the fused kernels below that egglog rules discover. The compiler emits Programs; a runtime executes them.
``KERNELS`` documents each kernel's operands and attributes; both sides must agree with it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from luminal_recipes.graph.core import PRIMITIVE_OPS, Graph, Node
from luminal_recipes.graph.serialize import nodes_from_json, nodes_to_json
from luminal_recipes.graph.view import View

KERNELS: dict[str, str] = {op: "HLIR primitive; semantics of graph.reference" for op in PRIMITIVE_OPS}
KERNELS.update({
    "MatMul": "inputs (a [..., M, K], b [..., K, N][, bias [..., M, N]]), any strides (transposes and broadcast "
              "batch axes are views); out [..., M, N] = a @ b (+ bias), accumulated in f32.",
    "Elementwise": "inputs in0..inN, each viewed at the output shape; attr expr: an s-expression over the inputs "
                   "(in0, in1...), constants (Const <float>) and primitive unary/binary ops, e.g. "
                   "'(Mul in0 (Recip (Add (Exp2 in1) (Const 1.0))))'; evaluated per element, one output buffer.",
    # also '(Cast <dtype> x)' (the Cast primitive's semantics) and bare numbers; floats compute in f32,
    # integers in their dtype, LessThan gives bool, a Const takes its partner operand's type, the result
    # converts to the node's dtype
    "Softmax": "input x [..., N]; out = softmax over the last axis (max-subtracted).",
    "LayerNorm": "input x [..., N]; attr eps; out = (x - mean) / sqrt(var + eps) over the last axis, no affine "
                 "(GroupNorm is this kernel on the [N, groups, C/groups*HW] view).",
    "RMSNorm": "input x [..., N]; attr eps; out = x / sqrt(mean(x^2) + eps) over the last axis, no affine.",
    "Attention": "inputs (q [..., S, D], k [..., T, D], v [..., T, Dv][, bias [..., S, T]]); attr scale; out "
                 "[..., S, Dv] = softmax(q k^T * scale + bias) v, never materialising (S, T, D).",
    "AttentionBlocked": "as Attention, attr block: keys processed block by block with an online softmax, never "
                        "materialising (S, T).",
    "Conv2d": "inputs (x [N, C, H, W] (already zero-padded), w [O, C, kh, kw]); attr stride; out [N, O, Ho, Wo].",
    # (stride: an int or an (sh, sw) pair; an optional third input is a bias viewed at [N, O, Ho, Wo])
    "DequantMatMul": "inputs (x [..., M, K], packed weight, scales...); attrs format ('fp8'|'nvfp4'), layout, "
                     "out_features, in_features; out [..., M, out_features] = x @ dequant(W).T, W stays packed.",
    # inputs in order, as ops.quant takes them, then an optional bias viewed at the output shape:
    #   fp8:   (x, weight f8 [N, K], weight_scale f32 [] | [1] | [N] | [N, 1]); layout ignored
    #   nvfp4: (x, weight u8, weight_scale f8e4m3, weight_scale_2 f32 [] | [1]); layout 'modelopt' | 'comfy'
    # with ops.quant.dequant_nvfp4's shapes for each layout (comfy: padded rows, 128x4-swizzled scales)
    "ScatterInPlace": "as Scatter, but writes into the destination's buffer (legal only when nothing else reads "
                      "the destination afterwards; the memory planner aliases the two).",
})


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
