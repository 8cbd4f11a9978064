"""State buffers: a program's states (a KV cache) live in the executable across runs, are updated in place by
ScatterInPlace (never copied per run), agree with the reference interpreter threading the state by hand, and each
run moves only its inputs and outputs between host and device."""

from __future__ import annotations

import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.compiler import SearchOptions, compile_graph
from luminal_recipes.errors import GraphError, InputError
from luminal_recipes.graph import Graph, run_reference

D = 16


def cache_graph(rows: int) -> Graph:
    """Append one row per run into a state cache; output the column sums of the whole cache."""
    g = Graph()
    cache = g.state("cache", (rows, D))
    pos, row = g.input("pos", (1,), "i32"), g.input("row", (1, D))
    new = ops.write_rows(cache, pos, row)
    g.update_state("cache", new)
    g.mark_output("total", ops.sum(new, 0))
    return g


def compiled(graph: Graph, runtime, dims=None):
    return compile_graph(graph, runtime, dims, options=SearchOptions(use_cache=False, time_top=0)).program


def test_state_persists_across_runs_and_is_updated_in_place(runtime, assert_close):
    g = cache_graph(8)
    program = compiled(g, runtime)
    assert "ScatterInPlace" in program.kernel_counts()
    exe = runtime.load(program)
    scatter = next(n.id for n in program.nodes if n.op == "ScatterInPlace")
    assert exe.plan.resident[scatter] == "state"  # written in the state's own buffer, outside the arena
    assert exe.memory.state_bytes == 8 * D * 4 and exe.plan.peak >= exe.memory.state_bytes
    rng = np.random.default_rng(0)
    state = np.zeros((8, D), np.float32)
    for step in range(5):
        inputs = {"pos": np.array([step], np.int32), "row": rng.standard_normal((1, D)).astype(np.float32)}
        got = exe.run(inputs)
        want = run_reference(g, {**inputs, "cache": state})
        state = want["cache"]
        assert set(got) == {"total"}  # a state's new value stays in the executable
        assert_close("runtime", got["total"], want["total"])
        assert np.array_equal(exe.state("cache"), state)
        assert exe.stats.bytes_in == 4 + D * 4 and exe.stats.bytes_out == D * 4 and exe.stats.bytes_device == 0


def test_a_state_updated_by_a_copying_scatter_is_written_back(runtime):
    g = cache_graph(4)
    from luminal_recipes.runtimes.program import Program

    exe = runtime.load(Program.from_graph(g))  # the primitive Scatter copies the destination
    row = np.ones((1, D), np.float32)
    exe.run({"pos": np.array([2], np.int32), "row": row})
    exe.run({"pos": np.array([0], np.int32), "row": 2 * row})
    assert np.array_equal(exe.state("cache")[[0, 2]], np.stack([2 * row[0], row[0]]))
    assert exe.stats.bytes_device == 4 * D * 4  # the whole state, device-side, per run (not in place)


def test_states_are_set_and_reset_and_never_inputs(runtime):
    exe = runtime.load(compiled(cache_graph(4), runtime))
    exe.set_state("cache", np.full((4, D), 3.0, np.float32))
    total = exe.run({"pos": np.array([1], np.int32), "row": np.zeros((1, D), np.float32)})["total"]
    assert np.array_equal(total, np.full(D, 9.0, np.float32))
    exe.set_state("cache")
    assert not exe.state("cache").any()
    with pytest.raises(InputError, match="'cache' is a state"):
        exe.run({"pos": np.array([1], np.int32), "row": np.zeros((1, D), np.float32),
                 "cache": np.zeros((4, D), np.float32)})
    with pytest.raises(InputError, match="no state 'kv'"):
        exe.state("kv")


def test_an_input_written_in_its_slot_is_not_copied(runtime):
    exe = runtime.load(compiled(cache_graph(4), runtime))
    row = exe.input("row")
    row[...] = 5.0
    exe.run({"pos": np.array([3], np.int32), "row": row})
    assert exe.stats.bytes_in == 4  # only pos was copied
    assert np.array_equal(exe.state("cache")[3], np.full(D, 5.0, np.float32))


def test_update_state_checks_what_it_is_given():
    g = Graph()
    cache = g.state("cache", (4, D))
    with pytest.raises(GraphError, match="not a state"):
        g.update_state("other", cache)
    with pytest.raises(GraphError, match="its new value"):
        g.update_state("cache", cache.slice(0, 0, 2))


def test_a_kernel_writing_a_state_in_place_has_its_scratch_planned(runtime):
    """Regression: the memory plan skipped the scratch of kernels whose output is a state (ScatterInPlace's
    index copy), which then landed at arena offset 0 over a live input: two cache writes sharing their
    positions with an attention mask corrupted the second operand."""
    g = Graph()
    heads, dim, rows = 2, 8, 32
    kc, vc = g.state("kc", ("cache", 1, heads, dim)), g.state("vc", ("cache", 1, heads, dim))
    q, k, v = (g.input(n, (1, heads, "seq", dim)) for n in "qkv")
    pos = g.input("positions", ("seq",), "i32")
    keys, values = ops.update_cache(kc, pos, k, "ctx"), ops.update_cache(vc, pos, v, "ctx")
    g.mark_output("o", ops.scaled_dot_product_attention(q, keys, values, causal=True, positions=pos))
    dims = {"seq": 1, "ctx": 16, "cache": rows}
    program = compiled(g, runtime, dims)
    exe = runtime.load(program, dims=dims)
    prepared = runtime.prepare(program, dims)
    with_scratch = {nid for nid, (_, scratch) in prepared.items() if scratch.nbytes}
    assert with_scratch <= set(exe.plan.scratch_offsets)
    rng = np.random.default_rng(0)
    caches = {n: rng.standard_normal((rows, 1, heads, dim)).astype(np.float32) for n in ("kc", "vc")}
    inputs = {n: rng.standard_normal((1, heads, 1, dim)).astype(np.float32) for n in "qkv"}
    inputs["positions"] = np.array([8], np.int32)
    for name, value in caches.items():
        exe.set_state(name, value)
    want = run_reference(g, {**inputs, **caches}, dims=dims)
    got = exe.run(inputs)
    np.testing.assert_allclose(got["o"], want["o"], rtol=1e-5, atol=1e-6)
    assert np.array_equal(exe.state("kc"), want["kc"]) and np.array_equal(exe.state("vc"), want["vc"])
