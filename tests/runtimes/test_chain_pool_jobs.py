"""Lockstep chains run by the kernels' spinning pool workers as compiled jobs (``runtimes/cpu/jit/lockstep.py``):
the worker's wait for a part also runs the chains posted to its mailbox, without the GIL. The results are the
steps' own, bit for bit, whether the worker spins or sleeps between chains; a checked call that refuses its input
on the worker's thread stops the chain and the step raises its own error; the blocking hand-off
(``LUMINAL_RECIPES_LOCKSTEP_WORKERS=0``) runs no job."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import jit  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off: no chains", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain, lockstep  # noqa: E402

RNG = np.random.default_rng(5)


def _split_copy(dst: np.ndarray, src: np.ndarray):
    """``dst = 2 * src`` then copied halves: as Python, and described as two ``copy_region`` parts (one per
    thread) after a whole-array scale on thread 0."""
    h = dst.shape[0] // 2
    pairs = [(dst[:h], src[:h]), (dst[h:], src[h:])]

    def step():
        for d, s in pairs:
            d[...] = s

    return chain.tag(step, [chain.Call(chain.copy_region, (d, d, s, False), i) for i, (d, s) in enumerate(pairs)])


def _program(n: int = 6, rows: int = 64):
    srcs = [RNG.standard_normal((rows, 8)).astype(np.float32) for _ in range(n)]
    dsts = [np.zeros_like(s) for s in srcs]
    # each step copies the previous step's output (a chain of dependent split steps: a barrier between them)
    steps = [_split_copy(dsts[0], srcs[0])] + [_split_copy(dsts[i], dsts[i - 1]) for i in range(1, n)]
    return steps, srcs, dsts


@pytest.fixture
def lockstep_always(monkeypatch):
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    pool = cpu_threads.shared_pool()
    if not isinstance(pool, cpu_threads._SpinningPool):
        pytest.skip("the blocking pool (LUMINAL_RECIPES_SPIN_US=0): no jobs")
    return pool


@pytest.mark.parametrize("worker_spins", [True, False])
def test_a_lockstep_chain_runs_on_the_pool_workers_jobs(lockstep_always, monkeypatch, worker_spins):
    pool = lockstep_always
    monkeypatch.setattr(chain, "LOCKSTEP_WORKERS", True)
    steps, srcs, dsts = _program()
    replay = chain.capture(steps, 2)
    assert replay is not None and replay.chains == 1 and replay.lockstep == 1
    if not worker_spins:  # the worker sleeps after each part or chain: every chain wakes it
        monkeypatch.setattr(pool, "base_ns", 0)
        monkeypatch.setattr(pool, "spin_ns", 0)
    before = int(pool.mails[0][lockstep.JOB_DONE])
    for _ in range(20):
        for d in dsts:
            d[...] = -1
        srcs[0][...] = RNG.standard_normal(srcs[0].shape).astype(np.float32)
        replay()
        for d in dsts:
            assert np.array_equal(d, srcs[0])
    assert int(pool.mails[0][lockstep.JOB_DONE]) == before + 20  # every run handed thread 1 its job
    cpu_threads.run_parts([lambda: None, lambda: None])  # the worker still takes plain parts


def test_the_blocking_hand_off_runs_no_job(lockstep_always, monkeypatch):
    pool = lockstep_always
    monkeypatch.setattr(chain, "LOCKSTEP_WORKERS", False)
    steps, srcs, dsts = _program()
    replay = chain.capture(steps, 2)
    before = int(pool.mails[0][lockstep.JOB_DONE])
    replay()
    assert int(pool.mails[0][lockstep.JOB_DONE]) == before
    assert all(np.array_equal(d, srcs[0]) for d in dsts)


def test_a_refused_input_on_the_workers_thread_raises_the_steps_error(lockstep_always, monkeypatch):
    monkeypatch.setattr(chain, "LOCKSTEP_WORKERS", True)
    out = np.zeros((4, 3), np.float32)
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    idx = np.array([1, 2], np.int64)

    def scatter():
        for j, i in enumerate(idx):
            if not 0 <= i < 4:
                raise IndexError(f"row {i} outside")
            out[i] = src[j]

    # the checked scatter is thread 1's (part 1); a split copy before it keeps the chain in lockstep
    scatter = chain.tag(scatter, [chain.Call(chain.scatter_rows, (out, idx, src, 4), 1, checked=True)])
    steps, srcs, dsts = _program(2)
    replay = chain.capture([*steps, scatter], 2)
    assert replay is not None and replay.lockstep == 1
    replay()
    assert out[1].tolist() == [0, 1, 2] and out[2].tolist() == [3, 4, 5]
    for _ in range(20):  # (thread 0 may pass the barrier before the refusal late: it must not leave thread 1 waiting)
        idx[0] = 9
        with pytest.raises(IndexError, match="row 9 outside"):
            replay()
        idx[0] = 3
        replay()  # the chain runs again after a failure
        assert out[3].tolist() == [0, 1, 2]
