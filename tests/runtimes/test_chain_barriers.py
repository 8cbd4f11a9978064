"""Where the CPU chains (``runtimes/cpu/jit/chain.py``) put their barriers on two threads, and what keeps a decoding
step one chain: calls that say what they read and write (``Call.access``) share a run between barriers unless one
writes what another thread touched since the last barrier; calls that do not say keep a barrier wherever the thread
changes hands. The replays stay bit for bit the steps run one by one. A ``Copy`` (the attention output's heads
back to rows) is a described step, so it no longer cuts a token's chain in two; ``crowded`` decides from the
machine's ready threads."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from chain_checks import assert_replays_as_steps, run_steps  # tests/runtimes/chain_checks.py

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import jit  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy): no chains", allow_module_level=True)

from luminal_recipes.graph.view import BoundView  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402
from luminal_recipes.runtimes.cpu.kernels import layout  # noqa: E402

RNG = np.random.default_rng(3)


def _copy_step(dst: np.ndarray, src: np.ndarray, declared: bool):
    """``dst = src`` in two parts (rows halves), described as copy_region calls, with or without their access."""
    h = dst.shape[0] // 2
    pairs = [(dst[:h], src[:h]), (dst[h:], src[h:])]

    def step():
        for d, s in pairs:
            d[...] = s

    return chain.tag(step, [chain.Call(chain.copy_region, (d, d, s, False), i,
                                       access=((s,), (d,)) if declared else None) for i, (d, s) in enumerate(pairs)])


def _gather_step(dst: np.ndarray, src: np.ndarray):
    """``dst = src`` on thread 0 alone, every row of ``src`` read: it needs what both parts of a split step wrote."""

    def step():
        dst[...] = src

    return chain.tag(step, [chain.Call(chain.copy_region, (dst, dst, src, False), None, access=((src,), (dst,)))])


def _program(declared: bool):
    """Two "products" of one x (two split copies reading x, writing their own outputs: q/k/v, gate/up), then a
    step reading both outputs whole (the next element-wise kernel) and a split copy of its result."""
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    a, b, c, d = (np.zeros((8, 16), np.float32) for _ in range(4))
    steps = [_copy_step(a, x, declared), _copy_step(b, x, declared), _gather_step(c, a), _copy_step(d, c, declared)]
    return steps, (a, b, c, d)


def _barriers(replay_chain) -> int:
    program, _ = replay_chain.layouts[replay_chain.threads]
    return int((program[:, 0] == chain.BARRIER).sum())


@pytest.mark.parametrize("declared", [True, False])
def test_barriers_follow_what_calls_read_and_write(monkeypatch, declared):
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)  # lockstep
    steps, outputs = _program(declared)
    made = []
    init = chain._Chain.__init__

    def recording(self, steps, threads):
        init(self, steps, threads)
        made.append(self)

    monkeypatch.setattr(chain._Chain, "__init__", recording)
    plain = run_steps(steps, outputs)
    replay = chain.capture(steps, 2)
    assert replay is not None and replay.chains == 1 and replay.lockstep == 1
    # declared: the two products of x share a run, the gather waits for both (1), the last copy reads the gather's
    # output, written on thread 0, from thread 1 too (2), the end (3); undeclared: one more, between the products
    assert _barriers(made[0]) == (3 if declared else 4)
    assert_replays_as_steps(replay, outputs, plain, 3)


def test_a_write_into_what_another_thread_reads_keeps_its_barrier(monkeypatch):
    """Write after read: the second step's part on thread 1 overwrites the rows of x thread 0 read (each thread
    overwriting only the rows it read itself would need none)."""
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    a = np.zeros_like(x)
    y = np.full_like(x, 5.0)

    def overwrite():
        x[...] = y

    swapped = chain.tag(overwrite, [chain.Call(chain.copy_region, (x[:4], x[:4], y[:4], False), 1,
                                               access=((y[:4],), (x[:4],))),
                                    chain.Call(chain.copy_region, (x[4:], x[4:], y[4:], False), 0,
                                               access=((y[4:],), (x[4:],)))])
    made = []
    init = chain._Chain.__init__

    def recording(self, steps, threads):
        init(self, steps, threads)
        made.append(self)

    monkeypatch.setattr(chain._Chain, "__init__", recording)
    chain.capture([_copy_step(a, x, True), _copy_step(x, y, True)], 2)
    assert _barriers(made[0]) == 1  # each thread overwrites the rows it read: the end only
    chain.capture([_copy_step(a, x, True), swapped], 2)
    assert _barriers(made[1]) == 2  # between the steps, and the end


def _fake_copy_ctx(shape, strides, size, dtype=np.float32):
    view = BoundView(tuple(shape), tuple(strides), 0, None)
    k = SimpleNamespace(view=view, dtype=np.dtype(dtype), size=size)

    def fail(msg):
        raise AssertionError(msg)

    return SimpleNamespace(inputs=[k], shape=tuple(shape), dtype=np.dtype(dtype), fail=fail)


def test_copy_is_described_and_exact(monkeypatch):
    """A decoding step's attention output [batch, heads, seq, d] read as [batch, seq, heads, d]: the Copy is
    compiled copies (so its step joins the chain), exact (-0.0 kept, unlike ``x + 0``), split over the threads."""
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 64)
    heads, seq, d = 9, 2, 64
    flat = RNG.standard_normal(heads * seq * d).astype(np.float32)
    flat[5] = -0.0
    ctx = _fake_copy_ctx((1, seq, heads, d), (heads * seq * d, d, seq * d, 1), flat.size)
    out = np.full((1, seq, heads, d), np.nan, np.float32)
    step = layout.prepare_copy(ctx)(out, [flat], {})
    phases = chain.phases_of(step)
    assert phases is not None and len(phases) == 1 and len(phases[0]) == 2, "the Copy is not described, split"
    assert all(call.access is not None for call in phases[0])
    step()
    want = flat.reshape(1, heads, seq, d).transpose(0, 2, 1, 3)
    assert np.array_equal(out, want) and np.signbit(out[0, 0, 0, 5])
    out.fill(np.nan)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    replay = chain.capture([step, _gather_step(np.zeros_like(out), out)], 2)
    replay()
    assert np.array_equal(out, want) and np.signbit(out[0, 0, 0, 5])


def test_crowded_from_ready_threads(monkeypatch):
    """Two threads on two cores: other processes' ready threads beyond the chain's (``/proc/loadavg``'s running
    count, less this process's) turn lockstep off, and it comes back once they leave; this process's own other
    threads (a library's OpenMP workers spinning down) never do."""
    monkeypatch.setattr(chain, "ADAPTIVE", True)
    monkeypatch.setattr(chain.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_threads, "_POOL", None)
    running = {"n": 1, "own": 1}
    monkeypatch.setattr(cpu_threads, "_running_threads", lambda: running["n"])
    monkeypatch.setattr(cpu_threads, "_own_running_threads", lambda: running["own"])
    clock = {"t": 1000.0}
    import time

    monkeypatch.setattr(time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(chain, "_CROWD", {"next": 0.0, "others": 0.0, "crowded": False})

    def decide(n: int, samples: int = 12) -> bool:
        running["n"] = n
        for _ in range(samples):
            clock["t"] += chain.CROWD_EVERY_S
            got = chain.crowded(2)
        return got

    assert not decide(1)  # this thread alone
    assert not decide(2)  # one other ready thread: lockstep still
    assert decide(4)  # three others: the calling thread alone
    assert decide(2, 1)  # not back at once
    assert not decide(1)  # back when the others have left
    running["own"] = 4
    assert not decide(4)  # four ready threads, all this process's
    running["own"] = 2
    assert decide(5)  # three of them another process's
    running["own"] = 1
    monkeypatch.setattr(chain, "ADAPTIVE", False)
    assert not decide(6)  # LUMINAL_RECIPES_CHAIN_LOCKSTEP other than auto: never


@pytest.mark.parametrize("threads", [1, 2])
def test_the_chains_of_a_capture_share_one_interpreter(monkeypatch, threads):
    """Chains with different argument layouts (a copy of 2-d rows; a checked row scatter and a 1-d copy), split
    by a step that is not described: one interpreter for both - the union of their opcodes, one numba compile
    per capture rather than one per chain - and the replay is still the steps run one by one, bit for bit."""
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    a, b = np.zeros_like(x), np.zeros_like(x)
    table = np.zeros((4, 3), np.float32)
    idx = np.array([2], np.int32)
    row = RNG.standard_normal((1, 3)).astype(np.float32)
    flat, flat_copy = np.zeros(12, np.float32), np.zeros(12, np.float32)

    def plain():  # not described: the two chains' border
        flat[...] = table.reshape(-1) + 1

    def scatter():
        table[int(idx[0])] = row[0]

    def copy_flat():
        flat_copy[...] = flat

    steps = [_copy_step(a, x, True), _copy_step(b, a, True), plain,
             chain.tag(scatter, [chain.Call(chain.scatter_rows, (table, idx, row, 4), checked=True)]),
             chain.tag(copy_flat, [chain.Call(chain.copy_region, (flat_copy, flat_copy, flat, False))])]
    outputs = (a, b, table, flat, flat_copy)
    for step in steps:
        step()
    want = [o.copy() for o in outputs]
    made, asked = [], []
    init, interpreter = chain._Chain.__init__, chain._interpreter

    def recording(self, steps, threads):
        init(self, steps, threads)
        made.append(self)

    def interpreting(opcodes):
        asked.append(list(opcodes))
        return interpreter(opcodes)

    monkeypatch.setattr(chain._Chain, "__init__", recording)
    monkeypatch.setattr(chain, "_interpreter", interpreting)
    replay = chain.capture(steps, threads)
    assert replay is not None and replay.chains == 2 and replay.launches == 3
    assert len(asked) == 1 and len(made) == 2, asked  # one interpreter for the capture
    union = asked[0]
    assert set(made[0].opcodes) != set(made[1].opcodes) and set(union) == set(made[0].opcodes + made[1].opcodes)
    assert made[0].run_fn is made[1].run_fn
    for c in made:  # every program's opcodes renumbered into the union
        for program, _ in c.layouts.values():
            ops = program[:, 0][program[:, 0] != chain.BARRIER]
            assert {union[op] for op in ops} == set(c.opcodes)
    for _ in range(2):
        for o in outputs:
            o.fill(np.nan)
        table.fill(0)  # read before it is written: as it was
        replay()
        for got, expected in zip(outputs, want):
            assert np.array_equal(got, expected), "chained != step by step"
