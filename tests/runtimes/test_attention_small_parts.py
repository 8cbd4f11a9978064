"""The 16-dim attention's parts (``jit/attention_small.attention16_part``): the tasks (a head's query rows, at
most ``TASK_ROWS``) cut into one range per core, each core's part taking its own range, then whatever the others
have left. Every task must run exactly once whichever parts run and in whatever order (a part that starts late
or never leaves its range to the others), with the same bits, and the kernel must give PyTorch's SDPA values for
odd head counts and lengths off the tasks' rows, on 1 to 3 threads (tests/TOLERANCES.md "attention")."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu import threads as cpu_threads
from luminal_recipes.runtimes.cpu.kernels import attention_small

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="the compiled kernel needs numba")
D = 16


def _qkv(h: int, s: int, t: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(2 * rng.standard_normal((h, n, D))).astype(np.float32) for n in (s, t, t)]


def _sdpa(q, k, v, scale):
    q, k, v = (torch.from_numpy(a).double() for a in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).numpy()


def _parts(h: int, s: int, t: int, per_task: int, ranges: int):
    """The kernel's tables as ``attention_small.prepare`` builds them: tasks, counters, range ends, starts."""
    blocks = -(-s // per_task)
    bounds = [s * i // blocks for i in range(blocks + 1)]
    tasks = np.array([(hh, bounds[b], bounds[b + 1]) for hh in range(h) for b in range(blocks)], np.int64)
    n = len(tasks)
    starts = np.array([n * i // ranges for i in range(ranges)], np.int64)
    ends = np.array([n * (i + 1) // ranges for i in range(ranges)], np.int64)
    return tasks, np.zeros(ranges * attention_small._kernels().STRIDE, np.int64), ends, starts


@pytest.mark.parametrize(("h", "s", "t", "per_task", "ranges"), [
    (5, 70, 45, 32, 3),   # odd heads, rows off the tasks, q_len != kv_len, ranges of unequal task counts
    (3, 37, 37, 4, 2),    # many short tasks
    (1, 6, 90, 32, 1),    # one task
    (2, 9, 9, 8, 4),      # more ranges than heads
])
@pytest.mark.parametrize("schedule", ["one part", "last part alone", "in turn", "threads"])
def test_every_task_runs_once_whatever_the_schedule(h, s, t, per_task, ranges, schedule, assert_close):
    kernel = attention_small._kernels()
    q, k, v = _qkv(h, s, t, seed=h * 100 + s)
    scale = np.float32(0.3)
    tasks, counters, ends, starts = _parts(h, s, t, per_task, ranges)
    stride = kernel.STRIDE
    outs = []
    for order in ([0], [ranges - 1], list(range(ranges))):  # reference schedules: one part takes everything
        out = np.full((h, s, D), np.nan, np.float32)
        counters[::stride] = starts
        for slot in order:
            scratch = [np.full(shape, np.nan, np.float32) for shape in ((D, t), (D, t), (4, t), (4, D))]
            kernel.attention16_part(q, k, v, out, tasks, counters, ends, slot, scale, *scratch)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    out = np.full((h, s, D), np.nan, np.float32)
    counters[::stride] = starts
    scratch = [[np.zeros(shape, np.float32) for shape in ((D, t), (D, t), (4, t), (4, D))] for _ in range(ranges)]
    if schedule == "threads":  # every part at once, each on its own thread
        workers = [threading.Thread(target=kernel.attention16_part, args=(
            q, k, v, out, tasks, counters, ends, slot, scale, *scratch[slot])) for slot in range(ranges)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        slots = {"one part": [0], "last part alone": [ranges - 1], "in turn": list(range(ranges))}[schedule]
        for slot in slots:
            kernel.attention16_part(q, k, v, out, tasks, counters, ends, slot, scale, *scratch[slot])
    assert np.array_equal(out, outs[0]), "a task ran twice with other bits, or not at all"
    assert (counters[::stride] >= ends).all()
    assert_close("attention", out, _sdpa(q, k, v, 0.3))


@pytest.mark.parametrize(("h", "s", "t"), [(5, 37, 37), (3, 70, 41), (7, 4, 33)])
def test_kernel_on_one_to_three_threads(h, s, t, numpy_runtime, assert_close, monkeypatch):
    """Through the runtime (``attention_small.prepare``): the same bits on 1, 2 and 3 threads, PyTorch's values."""
    g = Graph()
    q, k, v = g.input("q", (1, h, s, D)), g.input("k", (1, h, t, D)), g.input("v", (1, h, t, D))
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, scale=0.3))
    rng = np.random.default_rng(h * s)
    inputs = {n: (2 * rng.standard_normal((1, h, m, D))).astype(np.float32) for n, m in zip("qkv", (s, t, t))}
    prepared = []
    real = attention_small.prepare

    def spy(ctx, rows):
        prepared.append(cpu_threads.THREADS)
        return real(ctx, rows)

    monkeypatch.setattr(attention_small, "prepare", spy)
    monkeypatch.setattr(attention_small, "TASK_ROWS", 8)  # several tasks a head, so parts share heads
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        f = Fused(g)
        y = f.add("Attention", [q, k, v], (1, h, s, D), scale=0.3)
        results.append(numpy_runtime.run(f.program(y=y), inputs)["y"])
    assert prepared == [1, 2, 3], "the compiled 16-dim kernel did not run"
    assert all(np.array_equal(results[0], r) for r in results[1:])
    ref = _sdpa(*(inputs[n][0] for n in "qkv"), 0.3)[None]
    assert_close("attention", results[0], ref)
