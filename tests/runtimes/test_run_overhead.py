"""What the numpy runtime does around its kernels: ``run``'s per-binding shortcuts (inputs checked and copied, outputs
copied, as before), no thread hand-off for a row kernel whose whole is small, small im2col products on one BLAS
thread."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes.errors import InputError
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu import threads as cpu_threads
from luminal_recipes.runtimes.program import Program


def test_run_copies_inputs_and_outputs_and_checks_them(numpy_runtime, rng):
    g = Graph()
    x, b = g.input("x", (3, 5)), g.input("b", (5,))
    g.mark_output("y", x * 2.0 + b.broadcast_to((3, 5)))
    exe = numpy_runtime.load(Program.from_graph(g))
    x1, x2, b1 = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5), (3, 5), (5,)))
    first = exe.run({"x": x1, "b": b1})["y"]
    second = exe.run({"x": x2, "b": b1})["y"]
    assert first.flags.writeable and not np.shares_memory(first, exe.arena)
    assert np.array_equal(first, x1 * 2 + b1) and np.array_equal(second, x2 * 2 + b1)
    assert exe.stats.bytes_in == x2.nbytes + b1.nbytes and exe.stats.bytes_out == second.nbytes
    exe.input("x")[...] = x1  # written in its slot: bound without a copy
    assert np.array_equal(exe.run({"x": exe.input("x"), "b": b1})["y"], first)
    assert exe.stats.bytes_in == b1.nbytes
    with pytest.raises(InputError, match="input 'x' has shape"):
        exe.run({"x": x1[:2], "b": b1})
    with pytest.raises(InputError, match="input 'b' has dtype float64"):
        exe.run({"x": x1, "b": b1.astype(np.float64)})
    with pytest.raises(InputError, match="'c'"):
        exe.run({"x": x1, "b": b1, "c": b1})
    with pytest.raises(InputError, match="'b'"):
        exe.run({"x": x1})


def test_part_count_asks_min_part_elements_per_part(monkeypatch):
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    assert cpu_threads.part_count(4, cpu_threads.MIN_PART) == 1
    assert cpu_threads.part_count(4, 2 * cpu_threads.MIN_PART) == 2
    assert cpu_threads.part_count(1, 8 * cpu_threads.MIN_PART) == 1
    assert cpu_threads.part_count(0, 0) == 1


def _rope(numpy_runtime, heads: int, tokens: int) -> tuple[np.ndarray, list[int]]:
    """RMSNormRoPE over ``heads`` x ``tokens`` rows of 8 (rows read in place out of a fused projection): its
    output, and the parts of every hand-off to the workers while it ran."""
    g = Graph()
    qkv = g.input("qkv", (1, tokens, 3 * heads * 8))
    k = qkv.slice(2, heads * 8, 2 * heads * 8).reshape((1, tokens, heads, 8)).transpose(1, 2)
    w, cos, sin = g.input("w", (8,)), g.input("cos", (tokens, 8)), g.input("sin", (tokens, 8))
    pairs = (1, heads, tokens, 4, 2)
    f = Fused(g)
    y = f.add("RMSNormRoPE", [k, w.broadcast_to(k.shape), cos.broadcast_to(k.shape).reshape(pairs),
                              sin.broadcast_to(k.shape).reshape(pairs)], pairs, eps=1e-6)
    rng = np.random.default_rng(3)
    angles = rng.random((tokens, 4)) * 6
    inputs = {"qkv": rng.standard_normal(qkv.shape).astype(np.float32), "w": rng.standard_normal(8).astype(np.float32),
              "cos": np.repeat(np.cos(angles), 2, -1).astype(np.float32),
              "sin": np.repeat(np.sin(angles), 2, -1).astype(np.float32)}
    exe = numpy_runtime.load(f.program(y=y))
    handoffs: list[int] = []
    pools = (cpu_threads._Pool, cpu_threads._SpinningPool)  # whichever the process uses
    runs = [pool.run for pool in pools]

    def counting(run):
        def counted(self, parts):
            handoffs.append(len(parts))
            return run(self, parts)

        return counted

    for pool, run in zip(pools, runs):
        pool.run = counting(run)
    try:
        out = exe.run(inputs)["y"]
    finally:
        for pool, run in zip(pools, runs):
            pool.run = run
    return out, handoffs


def test_a_row_kernel_small_as_a_whole_runs_on_the_calling_thread(numpy_runtime, monkeypatch):
    """FLUX.2's tiny q/k norm (4 heads of 15 tokens): each head alone is one part, and so is the whole; it used to
    be dealt out over the cores head by head, a hand-off costing more than the work. The same bits either way."""
    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    small, handoffs = _rope(numpy_runtime, 4, 15)
    assert handoffs == []
    monkeypatch.setattr(cpu_threads, "MIN_PART", 16)  # every head worth a part: dealt out over both cores
    split, handoffs = _rope(numpy_runtime, 4, 15)
    assert handoffs == [2]
    assert np.array_equal(small, split)


class _Recorder:
    entered = 0

    def __enter__(self):
        _Recorder.entered += 1

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize(("out_channels", "height", "one_thread"), [(3, 9, True), (64, 400, False)])
def test_small_im2col_products_run_on_one_blas_thread(out_channels, height, one_thread, numpy_runtime,
                                                      monkeypatch, rng):
    """A two-threaded OpenBLAS call waits for its helper thread whenever the OS has descheduled it (the tiny
    VAE's last layer: 0.3 ms on one thread, 8 ms on two with other jobs running): im2col products too small to
    cut into chunks, as MatMul's, run on one; large ones keep BLAS's threads."""
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(jit, "AVAILABLE", False)  # the im2col path
    monkeypatch.setattr(cpu_threads, "blas_single_threaded", _Recorder)
    _Recorder.entered = 0
    g = Graph()
    x = g.input("x", (1, 8, height, 11))
    wt = g.weight("w", (out_channels, 8, 3, 3))
    f = Fused(g)
    y = f.add("Conv2d", [x.pad(2, 1, 1).pad(3, 1, 1), wt], (1, out_channels, height, 11))
    weights = {"w": rng.standard_normal((out_channels, 8, 3, 3)).astype(np.float32)}
    exe = numpy_runtime.load(f.program(y=y), weights)
    exe.run({"x": rng.standard_normal((1, 8, height, 11)).astype(np.float32)})
    assert (_Recorder.entered == 1) == one_thread
