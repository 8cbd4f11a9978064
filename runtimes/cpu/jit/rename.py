"""Private memory for a chain's temporaries, so independent branches can run on different threads (``chain.py``).

The memory planner (``runtimes/memory.py``) packs the arena in program order: a buffer whose lifetime has ended
gives its bytes to the next one. Inside a lockstep chain that turns independent branches into dependent ones: in
the tiny FLUX.2 transformer, the q branch's RoPE output sits in the bytes the k branch's norm writes next, and the
two branches' interleaved stacks share one buffer, so the k branch waited for the q branch (``_touches``) though
neither reads the other's values. Such a touch is *false*: the two calls reach the same bytes at steps where
different buffers hold them. ``rename`` finds the false touches of a chain's runs of single-thread calls and gives
one of the two buffers memory of its own, where it can: a buffer that lives only inside the run (its first and last
step there) and that only calls of one branch reach. Its calls' addresses in the chain's int table (and in int64
tables of addresses they are given, copied first) move to the private memory; nothing else changes, so every call
computes the same bits on other bytes. Buffers the caller sees (inputs, outputs, anything live before or after the
run) never move.

``buffers``: per arena buffer ``(first byte, end byte, first step, last step)``, steps as indices in the chain's
``steps`` (``Executable._buffer_lifetimes``: the planner's buffers at the arena's address).
"""

from __future__ import annotations

import numpy as np

ALIGN = 64


def _live(buffers: list[tuple], lo: int, hi: int, step: int) -> list[int]:
    """The buffers holding bytes of ``[lo, hi)`` at ``step``."""
    return [k for k, (b_lo, b_hi, first, last) in enumerate(buffers)
            if b_lo < hi and lo < b_hi and first <= step <= last]


def false_touch(a: tuple, b: tuple, step_a: int, step_b: int, buffers: list[tuple]) -> tuple | None:
    """Where calls ``a`` and ``b`` (spans ``(reads, writes)``) meet only in bytes that different buffers hold at
    their two steps: ``(buffers a reaches there, buffers b reaches there)``; None for a true touch (a buffer both
    reach, or bytes no buffer covers)."""
    ka, kb = set(), set()
    pairs = [(x, y) for x in a[1] for y in b[0] + b[1]] + [(x, y) for x in a[0] for y in b[1]]
    for (x_lo, x_hi), (y_lo, y_hi) in pairs:
        lo, hi = max(x_lo, y_lo), min(x_hi, y_hi)
        if lo >= hi:
            continue
        at_a, at_b = _live(buffers, lo, hi, step_a), _live(buffers, lo, hi, step_b)
        if not at_a or not at_b or set(at_a) & set(at_b):
            return None
        covered_a = sum(min(hi, buffers[k][1]) - max(lo, buffers[k][0]) for k in at_a)
        covered_b = sum(min(hi, buffers[k][1]) - max(lo, buffers[k][0]) for k in at_b)
        if covered_a < hi - lo or covered_b < hi - lo:  # bytes outside the buffers: unknown
            return None
        ka.update(at_a)
        kb.update(at_b)
    return (frozenset(ka), frozenset(kb)) if ka else None


class Renamer:
    """The chain's encoded calls, patched in place when a buffer moves: ``calls[g]`` = ``(step, spans, arrays,
    tables, held, checked)`` - the call's step, its ``(reads, writes)`` spans, its array arguments ``(int column,
    first byte, end byte)``, its int64 tables ``(int column, array)``, integers it is given that may be
    addresses - and ``ints`` the chain's int table."""

    def __init__(self, calls: list[list], ints: list[int], buffers: list[tuple]):
        self.calls, self.ints, self.buffers = calls, ints, buffers
        self.keep: list[np.ndarray] = []  # the private buffers and patched tables (the chain holds them)
        self.moved: dict[int, int] = {}  # buffer -> the bytes it moved by

    def movable(self, k: int, run: set[int], group_of: dict[int, int]) -> bool:
        """Whether buffer ``k`` lives only inside ``run`` (the calls' indices) and only one group's calls reach it
        (through arrays wholly inside it, no address given as a number, no checked call)."""
        lo, hi, first, last = self.buffers[k]
        if k in self.moved:
            return False
        window = [g for g, c in enumerate(self.calls) if first <= c[0] <= last]
        if not window or not set(window) <= run:
            return False
        steps_in_run = {self.calls[g][0] for g in run}
        if first not in steps_in_run or last not in steps_in_run:
            return False
        groups = set()
        for g in window:
            step, spans, arrays, tables, held, checked = self.calls[g]
            reach = any(a_lo < hi and lo < a_hi or (a_lo == a_hi and lo <= a_lo < hi) for _, a_lo, a_hi in arrays)
            reach = reach or any(((t >= lo) & (t < hi)).any() for _, t in tables)
            if not reach:
                continue
            if checked or any(a_lo < hi and lo < a_hi and (a_lo < lo or a_hi > hi) for _, a_lo, a_hi in arrays):
                return False
            if any(((v >= lo) & (v < hi)).any() for v in held):
                return False
            groups.add(group_of[g])
        return len(groups) == 1

    def move(self, k: int) -> None:
        """Buffer ``k``'s calls (every call at its steps reaching its bytes) pointed at private memory."""
        lo, hi, first, last = self.buffers[k]
        memory = np.empty(hi - lo + ALIGN, np.uint8)
        base = memory.ctypes.data
        delta = base + (-base) % ALIGN - lo
        self.keep.append(memory)
        self.moved[k] = delta

        def shift(ranges):
            return tuple((r_lo + delta, r_hi + delta) if lo <= r_lo and r_hi <= hi else (r_lo, r_hi)
                         for r_lo, r_hi in ranges)

        for g, (step, spans, arrays, tables, *_) in enumerate(self.calls):
            if not first <= step <= last:
                continue
            for n, (col, a_lo, a_hi) in enumerate(arrays):
                if lo <= a_lo and a_hi <= hi and (a_lo < a_hi or a_lo < hi):
                    self.ints[col] += delta
                    arrays[n] = (col, a_lo + delta, a_hi + delta)
            for n, (col, table) in enumerate(tables):
                inside = (table >= lo) & (table < hi)
                if inside.any():
                    copy = table.copy()
                    copy[inside] += delta
                    self.keep.append(copy)
                    self.ints[col] = copy.ctypes.data
                    tables[n] = (col, copy)
            self.calls[g][1] = (shift(spans[0]), shift(spans[1]))
