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
