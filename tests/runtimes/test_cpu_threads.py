"""``cpu_threads.claimed``: parts that take tasks in turn."""

from __future__ import annotations

import threading
import time

import pytest

from luminal_recipes.runtimes.cpu import threads as cpu_threads


@pytest.mark.parametrize(("count", "slots"), [(0, 2), (1, 1), (5, 1), (7, 2), (20, 3)])
def test_claimed_runs_every_task_once(count, slots):
    ran = []
    lock = threading.Lock()

    def task(slot, j):
        with lock:
            ran.append((slot, j))

    step = cpu_threads.claimed(count, slots, task)
    for _ in range(3):  # a step runs again from the first task
        ran.clear()
        step()
        assert sorted(j for _, j in ran) == list(range(count))
        assert all(0 <= slot < max(slots, 1) for slot, _ in ran)


def test_claimed_lets_a_fast_part_take_what_a_slow_one_has_not_started():
    """A part held up (here: sleeping in its first task, as a core the OS gives to another job) takes no more
    tasks while the other part runs the rest."""
    taken = {0: 0, 1: 0}

    def task(slot, j):
        taken[slot] += 1
        if slot == 1:
            time.sleep(0.3)

    cpu_threads.claimed(40, 2, task)()
    assert taken[0] + taken[1] == 40 and taken[1] <= 1, taken


def test_claimed_raises_a_tasks_error():
    def task(slot, j):
        if j == 3:
            raise ValueError("task 3")

    with pytest.raises(ValueError, match="task 3"):
        cpu_threads.claimed(8, 2, task)()


def _pools():
    from luminal_recipes.runtimes.cpu import jit

    pools = [cpu_threads._Pool()]
    if jit.AVAILABLE:
        from luminal_recipes.runtimes.cpu.jit import spin

        pools.append(cpu_threads._SpinningPool(spin))
    return pools


@pytest.mark.parametrize("kind", ["blocking", "spinning"])
def test_pool_hands_parts_to_workers_and_wakes_sleeping_ones(kind, monkeypatch):
    """Every part runs exactly once per call, whoever runs it; a worker takes its part while the caller is busy
    with its own (here: the caller's part waits until the worker's has run), also after the worker went to sleep
    (past ``SPIN_S`` without parts); results of many calls in a row and errors reach the caller."""
    pools = _pools()
    if kind == "spinning" and len(pools) == 1:
        pytest.skip("no numba: only the blocking pool")
    monkeypatch.setattr(cpu_threads, "SPIN_S", 1e-3)
    pool = pools[0] if kind == "blocking" else cpu_threads._SpinningPool(pools[1].spin)
    for rounds, nap in ((200, 0.0), (3, 0.02)):  # back to back (spinning workers), then asleep between calls
        for r in range(rounds):
            done = [0, 0, 0]
            ran_by = {}
            started = threading.Event()

            def mine(done=done, started=started):
                assert started.wait(10)  # the workers' parts run while the caller's has not finished
                done[0] += 1

            def theirs(k, done=done, ran_by=ran_by, started=started):
                ran_by[k] = threading.current_thread().name
                done[k] += 1
                if k == 2:
                    started.set()

            pool.run([mine, lambda: theirs(1), lambda: theirs(2)])
            assert done == [1, 1, 1], (r, done)
            assert ran_by[2] != threading.current_thread().name  # (part 1 may be the caller's, once it is done)
            time.sleep(nap)
    with pytest.raises(ValueError, match="part 1"):
        pool.run([lambda: None, lambda: (_ for _ in ()).throw(ValueError("part 1"))])
    done = []
    pool.run([lambda: done.append(0), lambda: done.append(1)])  # still usable after an error
    assert sorted(done) == [0, 1]


def test_blas_for_small_products_runs_blas_on_one_thread():
    """A product below ``SMALL_PRODUCT`` multiply-adds runs BLAS single-threaded (restored after); a large one
    keeps BLAS's threads."""
    controls = cpu_threads._blas_controls()
    if not controls:
        pytest.skip("no BLAS library found by threadpoolctl")
    get, put = controls[0]
    before = get()
    put(2)
    try:
        with cpu_threads.blas_for(cpu_threads.SMALL_PRODUCT - 1):
            assert get() == 1
        assert get() == 2
        with cpu_threads.blas_for(cpu_threads.SMALL_PRODUCT):
            assert get() == 2
    finally:
        put(before)
