"""Printing, structural hashing and (de)serialisation of graphs.

The structural hash depends only on ops, attributes, shapes, dtypes, views and the wiring between nodes, visited in
a canonical order from the outputs: node ids, input/weight names and weight values do not enter it. Two transformer
layers with different weights therefore hash the same, which is how the compiler finds repeated blocks.
"""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np

from .core import Graph, Node
from .dtypes import to_dtype
from .symbolic import shape_str, to_dim
from .view import View

# Attributes that name things rather than describe computation.
_NAMING_ATTRS = {"name"}


def format_graph(graph: Graph) -> str:
    lines = []
    for n in graph.nodes:
        args = ", ".join(f"%{src}{'' if v.is_contiguous() else '[' + str(v) + ']'}" for src, v in n.inputs)
        attrs = ", ".join(f"{k}={v!r}" for k, v in n.attrs)
        lines.append(f"%{n.id} = {n.op}({args}{'; ' + attrs if attrs else ''}) -> {n.dtype}{shape_str(n.shape)}")
    for name, (src, v) in graph.outputs.items():
        lines.append(f"output {name} = %{src}{'' if v.is_contiguous() else '[' + str(v) + ']'}")
    return "\n".join(lines)


def _node_signature(n: Node) -> str:
    attrs = [(k, v) for k, v in n.attrs if k not in _NAMING_ATTRS]
    return f"{n.op}|{n.dtype}|{shape_str(n.shape)}|{attrs!r}"


def structural_hashes(graph: Graph, roots: list[int] | None = None) -> dict[int, str]:
    """Hash of every node reachable from ``roots`` (default: outputs), from its own signature and its inputs'."""
    hashes: dict[int, str] = {}
    for n in graph.nodes:  # nodes are created in topological order
        h = hashlib.sha256(_node_signature(n).encode())
        for src, view in n.inputs:
            h.update(hashes[src].encode())
            h.update(str(view).encode())
        hashes[n.id] = h.hexdigest()
    if roots is None:
        return hashes
    keep = reachable(graph, roots)
    return {i: h for i, h in hashes.items() if i in keep}


def reachable(graph: Graph, roots) -> set[int]:
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(src for src, _ in graph.nodes[i].inputs)
    return seen


def structural_hash(graph: Graph) -> str:
    """One hash for the whole graph: its outputs (by position, with views) and everything they depend on."""
    if not graph.outputs:
        roots = list(range(len(graph.nodes)))
        node_hashes = structural_hashes(graph)
        return hashlib.sha256("".join(sorted(node_hashes[r] for r in roots)).encode()).hexdigest()
    node_hashes = structural_hashes(graph)
    h = hashlib.sha256()
    for src, view in graph.outputs.values():
        h.update(node_hashes[src].encode())
        h.update(str(view).encode())
    return h.hexdigest()


def nodes_to_json(nodes, outputs: dict) -> dict:
    """Nodes (any op names: graphs' primitives or programs' kernels) and named outputs as JSON-ready data; the
    one serialiser of graphs and compiled programs (``runtimes.program.Program.to_json``)."""
    items = []
    for n in nodes:
        item = {
            "op": n.op,
            "dtype": str(n.dtype),
            "shape": [str(d) for d in n.shape],
            "inputs": [[src, view.to_json()] for src, view in n.inputs],
        }
        if n.attrs:
            item["attrs"] = dict(n.attrs)
        if n.data is not None:
            item["data"] = base64.b64encode(np.ascontiguousarray(n.data).tobytes()).decode()
        items.append(item)
    return {"nodes": items, "outputs": {k: [src, v.to_json()] for k, (src, v) in outputs.items()}}


def nodes_from_json(data: dict) -> tuple[list[Node], dict]:
    """The inverse of ``nodes_to_json``: nodes numbered in order, and the outputs."""
    nodes = []
    for i, item in enumerate(data["nodes"]):
        dtype = to_dtype(item["dtype"])
        shape = tuple(to_dim(d) for d in item["shape"])
        arr = None
        if "data" in item:
            arr = np.frombuffer(base64.b64decode(item["data"]), dtype=dtype.np).reshape(
                tuple(int(d) for d in shape)).copy()
        inputs = tuple((src, View.from_json(v)) for src, v in item["inputs"])
        nodes.append(Node(i, item["op"], inputs, shape, dtype, tuple(sorted(item.get("attrs", {}).items())), arr))
    outputs = {k: (src, View.from_json(v)) for k, (src, v) in data["outputs"].items()}
    return nodes, outputs


def to_json(graph: Graph) -> dict:
    return {"format": "luminal-recipes/hlir", "version": 1, **nodes_to_json(graph.nodes, graph.outputs)}


def from_json(data: dict) -> Graph:
    nodes, outputs = nodes_from_json(data)
    g = Graph()
    for n in nodes:  # add_node checks that every op is a primitive
        node = g.add_node(n.op, n.inputs, n.shape, n.dtype, dict(n.attrs), data=n.data)
        if node.op == "Input":
            g._inputs_by_name[node.name] = node.id
    g.outputs.update(outputs)
    return g


def dumps(graph: Graph) -> str:
    return json.dumps(to_json(graph))


def loads(text: str) -> Graph:
    return from_json(json.loads(text))
