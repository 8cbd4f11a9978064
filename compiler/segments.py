"""Repeated blocks searched once: the graph is cut into segments (each ``Graph.blocks`` range, and the runs of
nodes between them), each segment becomes a standalone graph, and segments whose standalone graphs are
identical (same ops, shapes, dtypes, views and wiring in node order; weight names aside) share one search. The
chosen template program is then instantiated for every segment with its own weights and inputs.

Standalone graphs name their external operands ``arg{k}`` (outputs of earlier segments), their own inputs and
weights ``in{j}`` and their exported values ``o{i}``, so names never enter the comparison. Scalar constants
are free leaves: each segment makes its own, so a constant shared by every block does not tie the blocks
together.

Assembling the whole program merges kernels that compute the same value: the same kernel, attributes, shape and
dtype reading the same operands through the same views (a causal mask or RoPE table that every decoder layer
builds from the positions is computed once, not once per layer). Inputs, constants holding data and kernels that
write into an operand's buffer are never merged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from luminal_recipes.graph.core import Graph, Node
from luminal_recipes.graph.serialize import reachable
from luminal_recipes.graph.view import View
from luminal_recipes.runtimes.kernels import ALIASING_KERNELS
from luminal_recipes.runtimes.program import Program

ASSEMBLY = 3  # in the plan cache's key: 2 merges kernels that compute the same value (``assemble``); 3: whole
# candidates timed in turns (``search._time_candidates``)


@dataclass
class Segment:
    name: str                    # block name, or "glue:<first node id>"
    graph: Graph                 # standalone graph
    key: str                     # identical keys -> identical standalone graphs
    args: list[int]              # original producer of each arg{k}
    locals: dict[str, int]       # in{j} -> original Input node id
    exports: list[int]           # original node id of each output o{i}
    uses: dict[int, int] = field(default_factory=dict)  # standalone node id -> readers in the whole graph


def _is_scalar_constant(node: Node) -> bool:
    return node.op == "Constant" and node.data is None


def _leaf_blocks(graph: Graph) -> list[tuple[str, range]]:
    """Blocks containing no other block, in node order, without overlaps (later overlapping ones dropped)."""
    blocks = [(name, r) for name, r in graph.blocks.items() if len(r)]
    leaves = [(n, r) for n, r in blocks
              if not any(r.start <= o.start and o.stop <= r.stop and (o.start, o.stop) != (r.start, r.stop)
                         for _, o in blocks)]
    leaves.sort(key=lambda item: (item[1].start, item[1].stop))
    out, end = [], 0
    for name, r in leaves:
        if r.start >= end:
            out.append((name, r))
            end = r.stop
    return out


def split(graph: Graph) -> list[Segment]:
    """The graph's reachable nodes cut into segments, in node order."""
    roots = [src for src, _ in graph.outputs.values()]
    live = reachable(graph, roots)
    readers: dict[int, int] = {}
    for i in sorted(live):
        for src, _ in graph.nodes[i].inputs:
            readers[src] = readers.get(src, 0) + 1
    for src in roots:
        readers[src] = readers.get(src, 0) + 1

    owner: dict[int, str] = {}
    for name, r in _leaf_blocks(graph):
        for i in r:
            owner[i] = name
    groups: list[tuple[str, list[int]]] = []
    label = None
    for i in sorted(live):
        if _is_scalar_constant(graph.nodes[i]):
            continue
        block = owner.get(i)
        if not groups or (block or "") != label:
            groups.append((block or f"glue:{i}", []))
            label = block or ""
        groups[-1][1].append(i)

    segment_of = {i: k for k, (_, ids) in enumerate(groups) for i in ids}
    exported: dict[int, set[int]] = {k: set() for k in range(len(groups))}
    for i in live:
        for src, _ in graph.nodes[i].inputs:
            if src in segment_of and i in segment_of and segment_of[src] != segment_of[i]:
                exported[segment_of[src]].add(src)
    for src in roots:
        if src in segment_of:
            exported[segment_of[src]].add(src)
    return [_standalone(graph, name, ids, sorted(exported[k]), readers)
            for k, (name, ids) in enumerate(groups)]


def _standalone(graph: Graph, name: str, ids: list[int], exports: list[int],
                readers: dict[int, int]) -> Segment:
    g = Graph()
    local: dict[int, int] = {}
    args: list[int] = []
    arg_of: dict[int, int] = {}
    locals_: dict[str, int] = {}
    uses: dict[int, int] = {}
    members = set(ids)

    def operand(src: int) -> int:
        node = graph.nodes[src]
        if _is_scalar_constant(node):
            return g.constant(node.attr("value"), node.dtype).node
        if src in members:
            return local[src]
        if src not in arg_of:
            arg = g.add_node("Input", (), node.shape, node.dtype, {"name": f"arg{len(args)}", "kind": "arg"})
            arg_of[src] = arg.id
            uses[arg.id] = readers.get(src, 0)
            args.append(src)
        return arg_of[src]

    for i in ids:
        node = graph.nodes[i]
        inputs = tuple((operand(src), view) for src, view in node.inputs)
        attrs = dict(node.attrs)
        if node.op == "Input":
            attrs["name"] = f"in{len(locals_)}"
            locals_[attrs["name"]] = i
        new = g.add_node(node.op, inputs, node.shape, node.dtype, attrs, node.data)
        local[i] = new.id
        uses[new.id] = readers.get(i, 0)
    for k, i in enumerate(exports):
        g.outputs[f"o{k}"] = (local[i], View.contiguous(graph.nodes[i].shape))
    return Segment(name, g, _key(g), args, locals_, exports, uses)


def _key(g: Graph) -> str:
    h = hashlib.sha256()
    for n in g.nodes:
        attrs = [(k, v) for k, v in n.attrs if k != "name" or n.op != "Input" or str(v).startswith("arg")]
        h.update(f"{n.op}|{n.dtype}|{[str(d) for d in n.shape]}|{attrs!r}|".encode())
        for src, view in n.inputs:
            h.update(f"{src}:{view};".encode())
        h.update(b"\n")
    for name, (src, view) in g.outputs.items():
        h.update(f"{name}={src}:{view}\n".encode())
    return h.hexdigest()


def assemble(graph: Graph, segments: list[Segment], templates: list[Program],
             produced: dict[int, int] | None = None) -> Program:
    """One Program for the whole graph: each segment's template instantiated with its own operands. ``produced``
    (if given) is filled with the program node of every value a segment exports (original node id -> id)."""
    nodes: list[Node] = []
    produced = {} if produced is None else produced  # original node id -> program node id
    constants: dict[tuple, int] = {}  # (dtype, value) -> program node id
    computed: dict[tuple, int] = {}  # (op, operands, shape, dtype, attributes) -> the program node computing it

    def add(op, inputs, shape, dtype, attrs, data=None) -> int:
        inputs, attrs = tuple(inputs), tuple(sorted(attrs.items()))
        key = None
        if op != "Input" and data is None and op not in ALIASING_KERNELS:
            try:
                key = (op, inputs, tuple(shape), dtype, attrs)
                hash(key)
            except TypeError:  # an attribute that cannot be hashed: not merged
                key = None
            if key is not None and key in computed:
                return computed[key]
        nid = len(nodes)
        nodes.append(Node(nid, op, inputs, shape, dtype, attrs, data))
        if key is not None:
            computed[key] = nid
        return nid

    def constant(node: Node) -> int:
        key = (node.dtype, repr(node.attr("value")))
        if key not in constants:
            constants[key] = add("Constant", (), node.shape, node.dtype, dict(node.attrs))
        return constants[key]

    for seg, template in zip(segments, templates):
        mapped: dict[int, int] = {}
        for t in template.nodes:
            if t.op == "Input":
                name = t.attr("name")
                if t.attr("kind") == "arg":
                    mapped[t.id] = produced[seg.args[int(name[3:])]]
                else:
                    original = graph.nodes[seg.locals[name]]
                    mapped[t.id] = add("Input", (), original.shape, original.dtype, dict(original.attrs))
            elif t.op == "Constant" and t.data is None:
                mapped[t.id] = constant(t)
            else:
                inputs = ((mapped[s], v) for s, v in t.inputs)
                mapped[t.id] = add(t.op, inputs, t.shape, t.dtype, dict(t.attrs), t.data)
        for k, original in enumerate(seg.exports):
            produced[original] = mapped[template.outputs[f"o{k}"][0]]
    outputs = {}
    for name, (src, view) in graph.outputs.items():
        node = graph.nodes[src]
        outputs[name] = (constant(node) if _is_scalar_constant(node) else produced[src], view)
    return Program(nodes, outputs)
