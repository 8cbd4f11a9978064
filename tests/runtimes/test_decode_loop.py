"""A 64-step decode loop: each step appends one row to a KV-cache-like state (ScatterInPlace, in the state's own
buffer) and attends over the filled prefix (a symbolic length n, re-bound each step within the loaded bucket).
Per step, the bytes moved between host and device are the step's inputs and output - O(new tokens), never
O(cache) - and neither the work nor the time grows with the cache's allocated length. On the CUDA backends the
128 re-bindings (64 lengths, two cache sizes) compile nothing: one module per program."""

from __future__ import annotations

import statistics
import time

import numpy as np

from luminal_recipes import instrument, ops
from luminal_recipes.compiler import SearchOptions, compile_graph
from luminal_recipes.compiler.cost import kernel_work
from luminal_recipes.graph import Graph, run_reference

D, STEPS = 16, 64


def decode_graph(rows: int) -> Graph:
    g = Graph()
    cache = g.state("cache", (rows, D))
    pos, row, q = g.input("pos", (1,), "i32"), g.input("row", (1, D)), g.input("q", (1, D))
    new = ops.write_rows(cache, pos, row)
    g.update_state("cache", new)
    prefix = new.slice(0, 0, "n")  # the filled rows
    g.mark_output("y", ops.matmul(ops.softmax(ops.matmul(q, prefix.T), -1), prefix))
    return g


def decode(runtime, rows: int, check: bool):
    g = decode_graph(rows)
    program = compile_graph(g, runtime, {"n": STEPS}, options=SearchOptions(use_cache=False, time_top=0)).program
    assert "ScatterInPlace" in program.kernel_counts()
    before = instrument.snapshot()
    exe = runtime.load(program, dims={"n": STEPS})  # the bucket: the longest prefix of the loop
    loaded = instrument.snapshot()
    rng = np.random.default_rng(0)
    state = np.zeros((rows, D), np.float32)
    seconds, moved, work = [], [], []
    dtypes = {n.id: n.dtype for n in program.nodes}
    for t in range(STEPS):
        inputs = {"pos": np.array([t], np.int32), "row": rng.standard_normal((1, D)).astype(np.float32),
                  "q": rng.standard_normal((1, D)).astype(np.float32)}
        t0 = time.perf_counter()
        y = exe.run(inputs, dims={"n": t + 1})["y"]
        seconds.append(time.perf_counter() - t0)
        moved.append((exe.stats.bytes_in, exe.stats.bytes_out, exe.stats.bytes_device))
        work.append(sum(kernel_work(n.op, n.shape, n.dtype, [(v, dtypes[s]) for s, v in n.inputs], dict(n.attrs),
                                    {"n": t + 1}).bytes for n in program.nodes))
        if check:
            want = run_reference(g, {**inputs, "cache": state}, dims={"n": t + 1})
            state = want["cache"]
            np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-5)
    if check:
        assert np.array_equal(exe.state("cache"), state)
    assert exe.stats.arena_allocations == 0 and exe.stats.rebinds == STEPS
    # a code-generating backend (cuda, cuda-emu) builds at most one module for the program (none when it still
    # holds it), and re-binding to each of the lengths builds nothing: kernels read the length from an argument
    after = instrument.snapshot()
    assert (loaded - before)[instrument.CUDA_MODULE] <= 1
    assert (after - loaded)[instrument.CUDA_MODULE] == 0 and (after - loaded)[instrument.CUDA_COMPILE] == 0
    return statistics.median(seconds), moved, work, exe.stats.rebind_seconds / exe.stats.rebinds


def test_decode_steps_move_only_new_tokens_and_do_not_grow_with_the_cache(runtime):
    short = decode(runtime, 256, check=True)
    long = decode(runtime, 8192, check=False)
    step_bytes = (4 + 2 * D * 4, D * 4, 0)  # pos + row + q in, y out, nothing copied device-side
    assert short[1] == long[1] == [step_bytes] * STEPS
    assert short[2] == long[2]  # the kernels' work, step by step, does not depend on the allocated length
    assert long[0] < 3 * short[0] + 1e-3, (short[0], long[0])  # per-step median time: generous factor
