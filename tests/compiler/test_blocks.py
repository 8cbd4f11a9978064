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


def test_a_value_every_block_computes_alike_is_computed_once(runtime, assert_close):
    """A causal mask every decoder layer builds from the same positions (its own Iota, compare and cast in each
    block) is one kernel chain in the assembled program, not one per layer; the layers' own work is not merged."""
    g = Graph()
    x = g.input("x", (1, 4, 8))
    pos = g.input("pos", (4,), "i32")
    for i in range(3):
        with g.block(f"layers.{i}"):
            keys = g.iota(4).expand(0, 4)
            allowed = ops.logical_not(pos.expand(1, 4) < keys)
            bias = ops.cast(ops.logical_not(allowed), x.dtype) * -1e9
            scores = ops.linear(x, g.weight(f"layers.{i}.w", (4, 8))) + bias.unsqueeze(0).broadcast_to((1, 4, 4))
            x = ops.linear(ops.softmax(scores, -1), g.weight(f"layers.{i}.v", (8, 4)))
    g.mark_output("y", x)
    plan = compile_graph(g, runtime, options=SearchOptions(use_cache=False))
    assert sum(n.op == "Iota" for n in plan.program.nodes) == 1
    reads_pos = [n for n in plan.program.nodes if any(plan.program.nodes[s].attr("name") == "pos" for s, _ in n.inputs)]
    assert len(reads_pos) == 1
    assert sum(n.op == "Input" and n.attr("kind") == "weight" for n in plan.program.nodes) == 6
    check_program(g, plan.program, runtime, assert_close)
