"""Helpers for recipe tests: write recipe files into a temporary folder and locate text inside them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


def _position(text: str, needle: str, occurrence: int = 1) -> str:
    """``line:col`` (1-based) of the ``occurrence``-th ``needle`` in ``text``, as errors report it."""
    index = -1
    for _ in range(occurrence):
        index = text.index(needle, index + 1)
    line = text.count("\n", 0, index) + 1
    col = index - (text.rfind("\n", 0, index) + 1) + 1
    return f"{line}:{col}"


@pytest.fixture
def write(tmp_path: Path):
    """write(name, yaml_text) -> (path, text): a dedented recipe file in tmp_path."""

    def _write(name: str, text: str) -> tuple[Path, str]:
        text = textwrap.dedent(text).lstrip("\n")
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path, text

    return _write


@pytest.fixture
def position():
    """position(text, needle) -> 'line:col' (1-based) of needle in text."""
    return _position


def _signature(graph, call):
    """The nodes one module call added, edges inside the call made relative, constants by value (the graph
    shares scalar constants between layers): equal for equal structure."""
    nodes = [n for n in graph.nodes[call.start : call.end] if n.op != "Constant"]
    local = {n.id: i for i, n in enumerate(nodes)}

    def edge(src, view):
        producer = graph.nodes[src]
        if producer.op == "Constant":
            return ("const", producer.attrs, str(view))
        return ("in", local[src], str(view)) if src in local else ("ext", str(producer.shape), str(view))

    return tuple(
        (
            n.op,
            str(n.dtype),
            str(n.shape),
            tuple((k, v) for k, v in n.attrs if k != "name"),
            tuple(edge(src, view) for src, view in n.inputs),
        )
        for n in nodes
    )


@pytest.fixture
def block_signature():
    """block_signature(graph, call) -> hashable structure of the nodes one module call added."""
    return _signature
