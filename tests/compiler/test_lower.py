"""Lowering into the e-graph and reading it back: one e-class per node, views and symbolic dims visible as
terms, rules loaded by family name."""

from __future__ import annotations

import pytest

from luminal_recipes import ops
from luminal_recipes.compiler.extract import Snapshot
from luminal_recipes.compiler.lower import canonical_strides, lower, row_major
from luminal_recipes.compiler.rules import FAMILIES, program_text, rule_text
from luminal_recipes.compiler.saturate import new_egraph, saturate, scratch_egraph
from luminal_recipes.errors import LuminalError
from luminal_recipes.graph import Graph
from luminal_recipes.graph.symbolic import to_dim


def sample_graph() -> Graph:
    g = Graph()
    x = g.input("x", ("s", 6))
    w = g.weight("w", (4, 6), "bf16")
    y = ops.linear(x.slice(0, 1, "s").pad(1, 1, 0).slice(1, 0, 6), w.cast("f32"))
    g.mark_output("y", ops.softmax(y * 2.0, -1))
    return g


def test_every_node_is_one_eclass_with_its_shape_and_dtype():
    g = sample_graph()
    with scratch_egraph(()) as egraph:  # the schema only: no rewrites
        lower(g, egraph)
        snap = Snapshot.of(egraph)
    assert sorted(snap.node_class) == list(range(len(g.nodes)))
    assert len(set(snap.node_class.values())) == len(g.nodes)  # nothing merged without rules
    for node in g.nodes:
        c = snap.node_class[node.id]
        assert snap.shape[c] == node.shape and snap.dtype[c] == node.dtype
        ops_in_class = [snap.nodes[i].op for i in snap.members[c]]
        assert ops_in_class == [{"Constant": "Const", "Input": "Input"}.get(node.op, node.op)]


def test_views_round_trip_as_terms():
    g = sample_graph()
    with scratch_egraph(()) as egraph:
        lower(g, egraph)
        snap = Snapshot.of(egraph)
    for node in g.nodes:
        enode = snap.nodes[snap.members[snap.node_class[node.id]][0]]
        loads = [a.cls for a in enode.args if hasattr(a, "cls")]
        assert len(loads) == len(node.inputs)
        for ld, (src, view) in zip(loads, node.inputs):
            got = snap.load_view(ld)
            assert got.shape == view.shape and got.offset == view.offset and got.mask == view.mask
            assert got.strides == canonical_strides(view.shape, view.strides)
            assert snap.nodes[snap.members[ld][0]].args[0].cls == snap.node_class[src]


def test_symbolic_dims_survive():
    g = sample_graph()
    with scratch_egraph(()) as egraph:
        lower(g, egraph)
        snap = Snapshot.of(egraph)
    assert snap.shape[snap.node_class[0]] == (to_dim("s"), 6)
    assert row_major((to_dim("s"), 1, 6)) == (6, 0, 1)


def test_lowering_in_small_chunks_gives_the_same_egraph():
    g = sample_graph()
    sizes = []
    for chunk in (3, 10_000):
        egraph = new_egraph()
        lower(g, egraph, chunk=chunk)
        sizes.append(saturate(egraph).enodes)
    assert sizes[0] == sizes[1]


def test_rules_load_by_family_name():
    assert "(ruleset rewrite)" in rule_text("schema")
    for family in FAMILIES:
        assert ":ruleset rewrite" in rule_text(family), family
    text = program_text(("matmul",))
    assert "matmul" in text and "softmax" not in text
    with pytest.raises(LuminalError, match="no rule family 'fusion'.*known families"):
        rule_text("fusion")
