"""Structural hashing (same structure -> same hash, whatever the ids, names and weight values), JSON round
trip, and printing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ml_dtypes import bfloat16

from luminal_recipes import ops
from luminal_recipes.graph import Graph, dumps, format_graph, loads, run_reference, structural_hash
from luminal_recipes.graph.serialize import structural_hashes


def _block(g: Graph, prefix: str, hidden: int = 16, act=ops.silu, transpose_residual: bool = False):
    """A small pre-norm MLP block with a residual, over a symbolic sequence length."""
    x = g.input(f"{prefix}x", ("s", hidden))
    norm_w = g.weight(f"{prefix}norm.weight", (hidden,))
    w1 = g.weight(f"{prefix}up.weight", (2 * hidden, hidden), "bf16")
    b1 = g.weight(f"{prefix}up.bias", (2 * hidden,))
    w2 = g.weight(f"{prefix}down.weight", (hidden, 2 * hidden), "bf16")
    h = ops.linear(ops.rms_norm(x, norm_w), w1, b1)
    h = ops.linear(act(h), w2)
    residual = x
    if (
        transpose_residual
    ):  # same shapes, different view: (s, hidden) read through a double transpose of a copy
        residual = x.T.contiguous().T
    out = h + residual
    g.mark_output(f"{prefix}out", out)
    return out


def _weights(prefix: str, hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"{prefix}norm.weight": rng.standard_normal(hidden).astype(np.float32),
        f"{prefix}up.weight": rng.standard_normal((2 * hidden, hidden)).astype(bfloat16),
        f"{prefix}up.bias": rng.standard_normal(2 * hidden).astype(np.float32),
        f"{prefix}down.weight": rng.standard_normal((hidden, 2 * hidden)).astype(bfloat16),
    }


def _offset_graph() -> Graph:
    """A graph that already holds unrelated nodes (and shared scalar constants), so ids start elsewhere."""
    g = Graph()
    junk = g.input("unrelated", (3, 3))
    ops.exp(junk * 2.0 + 1.0)
    g.constant(1e-6)
    return g


def test_hash_ignores_node_ids_names_and_weight_values():
    a = Graph()
    _block(a, "layers.0.")
    b = _offset_graph()
    _block(b, "model.blocks.7.")
    assert a.nodes[-1].id != b.nodes[-1].id
    assert structural_hash(a) == structural_hash(b)
    # weight values live outside the graph: two runs with different weights change results, never the hash
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    ra = run_reference(a, {"layers.0.x": x}, _weights("layers.0.", 16, 1), {"s": 3})["layers.0.out"]
    rb = run_reference(b, {"model.blocks.7.x": x}, _weights("model.blocks.7.", 16, 2), {"s": 3})
    assert not np.allclose(ra, rb["model.blocks.7.out"])


def test_repeated_blocks_in_one_graph_hash_alike():
    g = Graph()
    outs = [_block(g, f"layers.{i}.") for i in range(3)]
    node_hashes = structural_hashes(g)
    assert len({node_hashes[o.node] for o in outs}) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"hidden": 24},  # a shape
        {"act": ops.gelu},  # an op
        {"transpose_residual": True},  # a view
    ],
)
def test_hash_changes_with_structure(change):
    a, b = Graph(), Graph()
    _block(a, "")
    _block(b, "", **change)
    assert structural_hash(a) != structural_hash(b)


def test_hash_changes_with_dtype_constants_and_symbols():
    def build(dtype="f32", scale=2.0, dim="s"):
        g = Graph()
        g.mark_output("y", g.input("x", (dim, 4), dtype) * scale)
        return structural_hash(g)

    assert len({build(), build("f16"), build(scale=3.0), build(dim="p"), build(dim="s + 1")}) == 5
    assert build() == build()


def _rich_graph() -> Graph:
    """Symbolic dims, masked and broadcast views, array constants (f32 and bf16), gather, scatter, casts."""
    g = Graph()
    x = g.input("x", ("s", 8))
    table = g.constant(np.arange(24, dtype=np.float32).reshape(6, 4) / 7)
    ids = g.input("ids", ("s",), "i32")
    emb = ops.embedding(ids, table)  # (s, 4)
    half = ops.split(x, [4, 4], -1)[1].pad(0, 1, 0).slice(0, 0, "s")  # masked view
    scale = g.constant(np.linspace(-1, 1, 4), "bf16").cast("f32").expand(0, "s")
    y = ops.softmax(emb * scale + half, -1)
    cache = g.input("cache", (6, 4))
    z = ops.write_rows(cache, ids.slice(0, 0, 1), y.slice(0, 0, 1))
    g.mark_output("y", y)
    g.mark_output("cache", z)
    g.mark_output("yt", y.T)
    return g


def _rich_inputs(s: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(s)
    return {
        "x": rng.standard_normal((s, 8)).astype(np.float32),
        "ids": rng.integers(0, 6, s).astype(np.int32),
        "cache": rng.standard_normal((6, 4)).astype(np.float32),
    }


@pytest.mark.parametrize("s", [1, 3])
def test_json_round_trip_preserves_hash_results_and_text(s):
    g = _rich_graph()
    text = dumps(g)
    json.loads(text)  # plain JSON
    back = loads(text)
    assert structural_hash(back) == structural_hash(g)
    assert format_graph(back) == format_graph(g)
    assert dumps(back) == text
    want = run_reference(g, _rich_inputs(s), dims={"s": s})
    got = run_reference(back, _rich_inputs(s), dims={"s": s})
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_printing_lists_every_node_and_output():
    g = _rich_graph()
    text = str(g)
    lines = text.splitlines()
    assert len(lines) == len(g.nodes) + len(g.outputs)
    assert lines[0].startswith("%0 = Input(")
    for op in ("Gather", "Scatter", "SumReduce", "MaxReduce", "Exp2", "Cast", "Constant"):
        assert op in text
    assert "mask[" in text  # a padded view is shown on its edge
    assert "output yt = %" in text
    assert "(s, 8)" in text
