"""The memory planner: liveness, arena reuse, in-place kernels, exact byte accounting, and that none of it
changes a result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused
from runtime_kinds import runs_numpy_kernels

from luminal_recipes import ops
from luminal_recipes.errors import UnboundDimError
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes import memory
from luminal_recipes.runtimes.memory import plan_memory
from luminal_recipes.runtimes.program import Program


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def deep_mlp(layers: int = 4, width: int = 32):
    g = Graph()
    x = g.input("x", ("s", width))
    h = x
    for i in range(layers):
        h = ops.silu(ops.linear(h, g.weight(f"w{i}", (width, width)), g.weight(f"b{i}", (width,))))
    g.mark_output("y", h)
    return g


def mlp_weights(rng, layers: int = 4, width: int = 32):
    w = {}
    for i in range(layers):
        w[f"w{i}"] = randn(rng, width, width) / np.float32(np.sqrt(width))
        w[f"b{i}"] = randn(rng, width)
    return w


def test_arena_reuses_memory_and_results_are_unchanged(runtime, rng, assert_close):
    g = deep_mlp()
    program = Program.from_graph(g)
    weights, x = mlp_weights(rng), randn(rng, 6, 32)
    exe = runtime.load(program, weights, {"s": 6})
    plan = exe.plan
    plan.check()
    assert plan.arena_bytes < plan.total_buffer_bytes / 4  # far below "every intermediate lives forever"
    assert plan.live_peak <= plan.arena_bytes <= 2 * plan.live_peak
    assert len(plan.aliases) > 0  # elementwise chains ran in place
    want = run_reference(g, {"x": x}, weights, {"s": 6})["y"]
    if runs_numpy_kernels(runtime):  # numpy's sums are the reference's, bit for bit
        assert np.array_equal(exe.run({"x": x})["y"], want)
    else:  # a device's reductions add in their own order
        assert_close("runtime", exe.run({"x": x})["y"], want)


def test_in_place_is_only_used_when_the_input_dies_here(runtime, rng):
    g = Graph()
    x = g.input("x", (4, 4))
    a = x * 2.0
    b = a + 1.0  # a is read again below: b must not overwrite it
    c = b * a
    t = c + c.T  # c is read transposed by the same kernel: writing in place would corrupt it
    g.mark_output("t", t)
    g.mark_output("a", a)
    program = Program.from_graph(g)
    plan = runtime.plan(program)
    plan.check()
    assert a.node not in plan.aliases.values()  # an output is never overwritten
    assert plan.aliases.get(b.node) != a.node
    assert plan.aliases.get(t.node) != c.node
    xv = randn(rng, 4, 4)
    got = runtime.run(program, {"x": xv})
    want = run_reference(g, {"x": xv})
    assert np.array_equal(got["t"], want["t"]) and np.array_equal(got["a"], want["a"])


def test_outputs_stay_alive_to_the_end(runtime, rng):
    g = Graph()
    x = g.input("x", (64,))
    early = x * 3.0
    g.mark_output("early", early)
    h = x
    for _ in range(10):  # plenty of later buffers that could reuse early's bytes
        h = ops.exp(h * 0.01) + 1.0
    g.mark_output("late", h)
    xv = randn(rng, 64)
    got = runtime.run(Program.from_graph(g), {"x": xv})
    assert np.array_equal(got["early"], xv * np.float32(3.0))


def test_sweep_strategy_for_large_programs_is_also_valid(runtime, rng, monkeypatch):
    g = deep_mlp()
    program, weights, x = Program.from_graph(g), mlp_weights(rng), randn(rng, 5, 32)
    greedy = runtime.load(program, weights, {"s": 5})
    monkeypatch.setattr(memory, "GREEDY_BY_SIZE_LIMIT", 0)
    swept = runtime.load(program, weights, {"s": 5})
    assert swept.plan.strategy == "sweep" and greedy.plan.strategy == "greedy-by-size"
    swept.plan.check()
    assert swept.plan.live_peak <= swept.plan.arena_bytes
    assert np.array_equal(swept.run({"x": x})["y"], greedy.run({"x": x})["y"])


def test_byte_accounting_is_exact(runtime, rng):
    """Weights count at their packed size (f4e2m1: half a byte), the arena is the one buffer allocated, and
    the planned peak is their sum."""
    g = Graph()
    x = g.input("x", (3, 32))
    w = g.weight("w", (8, 32), "bf16")
    packed = g.weight("packed", (8, 16), "u8")
    fp4 = g.weight("fp4", (4, 6), "f4e2m1")
    y = ops.linear(x, w) + ops.sum(packed.cast("f32"), -1).unsqueeze(0).broadcast_to((3, 8))
    y = y + ops.sum(fp4.cast("f32")).unsqueeze(0).unsqueeze(0).broadcast_to((3, 8))
    g.mark_output("y", y + g.constant(np.arange(24, dtype=np.float32).reshape(3, 8)))
    weights = {"w": randn(rng, 8, 32, dtype=ml_dtypes.bfloat16),
               "packed": rng.integers(0, 255, (8, 16), np.uint8),
               "fp4": randn(rng, 4, 6).astype(ml_dtypes.float4_e2m1fn)}
    exe = runtime.load(Program.from_graph(g), weights)
    mem = exe.memory
    assert mem.weight_bytes == 8 * 32 * 2 + 8 * 16 + 4 * 6 // 2
    assert mem.weight_array_bytes == sum(a.nbytes for a in weights.values())  # f4 arrays hold a byte each
    assert mem.arena_bytes == exe.arena.nbytes == exe.plan.arena_bytes
    assert mem.constant_bytes == exe.plan.constant_bytes == 24 * 4
    assert mem.planned_peak == mem.weight_bytes + mem.constant_bytes + mem.arena_bytes == exe.plan.peak
    assert mem.live_peak <= mem.arena_bytes
    assert plan_memory(Program.from_graph(g), weight_bytes=123).weight_bytes == 123


def test_activation_buffers_are_sized_exactly(runtime):
    g = Graph()
    x = g.input("x", (5, 7), "bf16")
    g.mark_output("y", (x * x).cast("f32"))
    plan = plan_memory(Program.from_graph(g))
    assert plan.nbytes[x.node] == 5 * 7 * 2
    assert plan.nbytes[plan.order[-1]] == 5 * 7 * 4
    assert all(b.offset % 64 == 0 and b.nbytes % 64 == 0 for b in plan.buffers)


def test_kernel_scratch_is_planned(runtime, monkeypatch):
    if not runs_numpy_kernels(runtime):
        pytest.skip("numpy's Softmax reads this view through scratch; a CUDA row kernel reads it in place")
    from luminal_recipes.runtimes.cpu import jit

    monkeypatch.setattr(jit, "AVAILABLE", False)  # numpy's passes (the compiled row kernel reads it in place too)
    g = Graph()
    x = g.input("x", (2, 16, 40))
    f = Fused(g)
    # rows of this view cannot be flattened to (32, 40) without a copy: the kernel reads through scratch
    y = f.add("Softmax", [x.permute(1, 0, 2)], (16, 2, 40))
    plan = runtime.plan(f.program(y=y))
    size = 2 * 16 * 40 * 4
    assert plan.scratch_bytes[y] >= size
    assert plan.arena_bytes >= plan.scratch_bytes[y] + 2 * size  # scratch, input and output are live together
    plan.check()


def test_unbound_dims_are_named(runtime):
    g = deep_mlp()
    with pytest.raises(UnboundDimError, match="'s'"):
        plan_memory(Program.from_graph(g))
    with pytest.raises(UnboundDimError, match="s"):
        runtime.load(Program.from_graph(g), {}, {})


def test_planning_a_large_program_is_fast(rng):
    """20 000 buffers plan in seconds (the compiler plans every candidate before running any)."""
    import time

    g = Graph()
    h = g.input("x", (8, 8))
    for _ in range(10_000):
        h = h * 1.0001 + h
    g.mark_output("y", h)
    t0 = time.perf_counter()
    plan = plan_memory(Program.from_graph(g))
    assert time.perf_counter() - t0 < 20
    assert plan.arena_bytes <= 4 * 8 * 8 * 4 + 4 * 64


def test_integer_work_on_the_inputs_alone_runs_first(runtime, rng):
    """``run_order``: a causal mask built from position ids (integer compares, a bool cast to f32) depends on the
    inputs alone, so it runs before the weighted work the program's walk put first (on the CPU such steps run
    from Python and would cut the compiled steps into two chains); the float work on the inputs alone and every
    weighted node keep their program order, and the values are the reference's."""
    g = Graph()
    x = g.input("x", (4, 8))
    pos = g.input("pos", (4,), "i32")
    h = ops.linear(x, g.weight("w", (8, 8)))  # weighted: emitted first
    keys = g.iota(8)
    mask = ((keys.expand(0, 4) < pos.expand(1, 8)).cast("f32") - 1.0) * 1e9
    scaled = x * 0.5  # float work on the inputs alone: keeps its place
    g.mark_output("y", h + mask + scaled)
    program = Program.from_graph(g)
    plan = plan_memory(program)
    by_id = {n.id: n for n in program.nodes}
    kernels = [nid for nid in plan.order if by_id[nid].op not in memory.SOURCE_OPS]
    ints = [nid for nid in kernels if not by_id[nid].dtype.is_float
            or any(not by_id[src].dtype.is_float for src, _ in by_id[nid].inputs)]
    assert ints and kernels[:len(ints)] == ints  # the integer work first (with the sources it reads)
    program_order = [n.id for n in program.nodes]
    rest = kernels[len(ints):]
    assert rest == sorted(rest, key=program_order.index)  # the rest in program order
    assert program_order.index(h.node) < program_order.index(ints[0])  # (which put the weighted product first)
    position = {nid: i for i, nid in enumerate(plan.order)}
    assert all(position[src] < position[nid] for nid in plan.order for src, _ in by_id[nid].inputs)
    xv, pv, wv = randn(rng, 4, 8), np.array([0, 3, 5, 8], np.int32), randn(rng, 8, 8)
    got = runtime.run(program, {"x": xv, "pos": pv}, {"w": wv})["y"]
    want = run_reference(g, {"x": xv, "pos": pv}, {"w": wv})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
