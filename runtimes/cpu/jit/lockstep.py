"""Lockstep chains (``chain.py``) run by the kernels' pool workers (``threads._SpinningPool``) without the GIL.

A lockstep chain runs its program on every thread at once. Handed over as Python parts, each start cost a
worker two trips through the GIL (to call its part, and to return from it); the caller holds the GIL while it
runs the steps between chains, so the worker sleeps on it and the hand-over is a futex wake-up, 20-50 us on a
virtual CPU - as much as a short chain's whole work: chains with few split phases ran on the calling thread
alone, and on a second thread of its own (``threads.blocking_pool``) a chain found that thread asleep every time.

Here a pool worker's wait for its next part (``pool_wait``) also watches a mailbox
of its own: the caller writes the chain's job (the interpreter's address and its arrays: ``job_row``) and a
generation number, the worker sees it within a spin's read and calls the interpreter by address (``chain._call``,
its arrays rebuilt from the job by ``chain._view``), then waits again for a part or a chain. No Python runs on the
worker between them, so while the worker spins (the pool's ``SPIN_US`` after its last part or chain, where the
pool spins at all) a chain's hand-off costs a cache line's round trip; a sleeping worker is woken as for a part.
The caller waits for the workers' ``DONE`` before it returns (a chain's flags are reset at its next run).
"""

from __future__ import annotations

import numba
import numpy as np

from .chain import ABORT, FAILED, _call, _view
from .spin import (
    ASLEEP,
    CLAIMED,
    DONE,
    MINE,
    POSTED,
    PREEMPTED,
    TIMED_OUT,
    WAKE_CALLER,
    atomic_load,
    atomic_store,
    claim_posted,
    compare_exchange,
    monotonic_ns,
    pause,
    raise_to,
    yield_core,
)

_STRIDE = 8  # one cache line per flag
JOB_POST, JOB_DONE = 0, _STRIDE  # a worker's mailbox: the chain posted last, the chain finished last
MAIL = 2 * _STRIDE
# a job: the interpreter's address, the thread index, then (address, shape, byte strides) of the program, the int
# and float tables (2-D) and the flags (1-D), the thread count, the barrier's spins (``chain._source``'s ``run``)
JOB_COLUMNS = 22
_nogil = numba.njit(cache=True, nogil=True)
_ = (ASLEEP, CLAIMED, compare_exchange)  # (the flags' layout is spin.py's)


@_nogil
def run_job(mail, job):
    """Run the chain of ``job`` (posted as ``mail[JOB_POST]``), then ``mail[JOB_DONE]`` = that generation."""
    posted = atomic_load(mail, JOB_POST)
    flags = _view(job, 0, 17, "i8:1:C:rw")
    rc = _call(job[0, 0], "int64", (job[0, 1], _view(job, 0, 2, "i8:2:C:rw"), _view(job, 0, 7, "i8:2:C:rw"),
                                    _view(job, 0, 12, "f8:2:C:rw"), flags, job[0, 20], job[0, 21]))
    if rc == FAILED:  # the interpreter itself raised: the other threads leave at their next barrier
        atomic_store(flags, ABORT, 1)
    atomic_store(mail, JOB_DONE, posted)


@_nogil
def pool_wait(flags, base, caller, done, seen, budget, yield_every, preempted, mail, job):
    """A worker's wait for its next part, running meanwhile every chain posted to this worker's ``mail``
    (``run_job``; after a chain its spin starts again: ``budget`` counts from the chain's end).

    First ``DONE = done`` (its last part finished; 0: none; if the caller sleeps waiting for it, ``flags[caller]``
    set, that flag is cleared and WAKE_CALLER returned at once), then spin until ``POSTED != seen`` (a part claimed
    by the caller is skipped), yielding the core every ``yield_every`` ns, at most ``budget`` ns. Returns
    ``posted * 4 + status``: MINE (posted and claimed here), TIMED_OUT, or PREEMPTED (the spin itself was held up
    more than ``preempted`` ns between two reads: the core is shared with other work, so spinning takes time from
    it)."""
    if done > 0:
        raise_to(flags, base + DONE, done)
        if atomic_load(flags, caller) != 0 and compare_exchange(flags, caller, 1, 0):
            return seen * 4 + WAKE_CALLER
    start = monotonic_ns()
    last = start
    next_yield = start + yield_every
    while True:
        if atomic_load(mail, JOB_POST) != atomic_load(mail, JOB_DONE):
            run_job(mail, job)
            start = monotonic_ns()
            last = start
            next_yield = start + yield_every
            continue
        posted = atomic_load(flags, base + POSTED)
        if posted != seen:
            if claim_posted(flags, base, posted):
                return posted * 4 + MINE
            seen = posted  # the caller ran it
        now = monotonic_ns()
        if now - last > preempted:
            return seen * 4 + PREEMPTED
        if now - start >= budget:
            return seen * 4 + TIMED_OUT
        if now >= next_yield:
            yield_core()
            now = monotonic_ns()
            next_yield = now + yield_every
        last = now
        pause()


@_nogil
def await_done(mail, value):
    """Spin until ``mail[JOB_DONE]`` reaches ``value`` (the worker passed the chain's last barrier: microseconds
    after this thread did); past ~1 ms give the core away between reads (a worker descheduled on this core)."""
    start = monotonic_ns()
    n = 0
    while atomic_load(mail, JOB_DONE) < value:
        n += 1
        if (n & 63) == 0 and monotonic_ns() - start > 1_000_000:
            yield_core()
        else:
            pause()


def job_row(run_address: int, t: int, args: tuple) -> np.ndarray:
    """The job of thread ``t`` for a chain whose interpreter is at ``run_address``, run with ``args`` =
    ``(program, ints, floats, flags, threads, spins)``."""
    program, ints, floats, flags, threads, spins = args
    row = [run_address, t]
    for a in (program, ints, floats, flags):
        row += [a.ctypes.data, *a.shape, *a.strides]
    row += [threads, spins]
    if len(row) != JOB_COLUMNS:
        raise ValueError(f"a chain job of {len(row)} columns, not {JOB_COLUMNS}")
    return np.array(row, np.int64).reshape(1, JOB_COLUMNS)
