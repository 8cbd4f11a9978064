"""Shared checks of the chain tests: a recorded chain must give, run after run, the bits its steps give one by one."""

from __future__ import annotations

import numpy as np


def run_steps(steps, outputs) -> list[np.ndarray]:
    """Run ``steps`` one by one; return copies of ``outputs``, then fill them with NaN (a chain that skips a
    write then leaves NaN behind)."""
    for step in steps:
        step()
    plain = [o.copy() for o in outputs]
    for o in outputs:
        o.fill(np.nan)
    return plain


def assert_replays_as_steps(replay, outputs, plain, runs: int, what: str = "chained") -> None:
    """``runs`` replays, each giving ``plain`` bit for bit, the outputs filled with NaN again after each."""
    for _ in range(runs):
        replay()
        for got, want in zip(outputs, plain):
            assert np.array_equal(got, want), f"{what} != step by step"
        for o in outputs:
            o.fill(np.nan)
