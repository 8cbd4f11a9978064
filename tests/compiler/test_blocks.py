"""Repeated blocks are searched once and instantiated with their own weights."""

from __future__ import annotations

from compiler_helpers import check_program

from luminal_recipes import ops
from luminal_recipes.compiler import SearchOptions, compile_graph, search
from luminal_recipes.compiler.segments import split
from luminal_recipes.graph import Graph


def stacked_layers(n: int = 4) -> Graph:
    g = Graph()
    x = g.input("x", (1, 5, 16))
    x = ops.linear(x, g.weight("embed", (16, 16)))
    for i in range(n):
        with g.block(f"layers.{i}"):
            h = ops.rms_norm(x, g.weight(f"layers.{i}.norm", (16,)))
            h = ops.silu(ops.linear(h, g.weight(f"layers.{i}.up", (32, 16))))
            x = x + ops.linear(h, g.weight(f"layers.{i}.down", (16, 32))) * 0.5
    g.mark_output("y", ops.softmax(x, -1))
    return g


def test_identical_blocks_share_one_search(runtime, assert_close, monkeypatch):
    g = stacked_layers(4)
    segments = split(g)
    assert [s.name for s in segments] == ["glue:0", "layers.0", "layers.1", "layers.2", "layers.3", "glue:" +
                                          segments[-1].name.split(":")[1]]
    assert len({s.key for s in segments[1:5]}) == 1
    calls = []
    original = search.search_segment
    monkeypatch.setattr(search, "search_segment", lambda seg, *a: calls.append(seg.name) or original(seg, *a))
    plan = compile_graph(g, runtime, options=SearchOptions(use_cache=False))
    assert calls == ["glue:0", "layers.0", segments[-1].name]
    assert plan.report["segments"] == 6 and plan.report["distinct_segments"] == 3
    # every block reads its own weights
    names = {n.attr("name") for n in plan.program.nodes if n.op == "Input"}
    assert {f"layers.{i}.{w}" for i in range(4) for w in ("norm", "up", "down")} <= names
    check_program(g, plan.program, runtime, assert_close)


def test_blocks_with_different_shapes_are_searched_separately(runtime, assert_close):
    g = Graph()
    x = g.input("x", (3, 8))
    for i, width in enumerate((8, 8, 4)):
        with g.block(f"b{i}"):
            x = ops.gelu(ops.linear(x, g.weight(f"w{i}", (width, x.shape[-1]))))
    g.mark_output("y", x)
    key = {s.name: s.key for s in split(g)}
    assert key["b0"] == key["b1"] != key["b2"]
    plan = compile_graph(g, runtime, options=SearchOptions(use_cache=False))
    check_program(g, plan.program, runtime, assert_close)


def test_a_constant_shared_by_all_blocks_does_not_tie_them(runtime):
    """Scalar constants are deduplicated graph-wide (the first block creates them, later blocks reuse them);
    the
    segments still hash equal because each makes its own copy."""
    g = stacked_layers(3)
    keys = [s.key for s in split(g) if s.name.startswith("layers.")]
    assert len(set(keys)) == 1
