"""Atomic flags the CPU thread pool (``cpu/threads.py``) hands parts over with, read and written by compiled code
that releases the GIL: a worker waiting for its next part, or the caller waiting for a worker's part to finish,
spins on a flag for a bounded time without the GIL (so the other thread runs Python meanwhile) instead of
sleeping in the kernel, whose wake-up costs 20-50 us on this kind of machine (a virtual CPU woken by an
interrupt) - more than a decoding step's matrix-vector product takes on a core.

Every access is a sequentially consistent atomic on an ``int64`` array element (LLVM's ``load atomic`` /
``store atomic`` / ``cmpxchg``); the spin loops execute the CPU's pause hint between reads (``pause`` on x86;
elsewhere none), bound their time by the monotonic clock (libc's ``clock_gettime``, the vDSO) and give their
core away now and then (``sched_yield``). The pool's hand-off is one call per wait (``lockstep.pool_wait``, ``post``,
``finish``, ``wait_done``), so a worker takes the GIL once per part; ``load`` and ``store`` are the single-flag
forms its Python side uses.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_spin = numba.njit(cache=True, nogil=True)
_MACHINE = platform.machine().lower()
# the spin-wait hint as an LLVM intrinsic (numba's JIT has no inline assembler): ``pause`` on x86
_PAUSE = "llvm.x86.sse2.pause" if _MACHINE in ("x86_64", "amd64", "i686", "x86") else ""


def _pointer(context, builder, signature, args):
    aryty = signature.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)


@intrinsic
def atomic_load(typingctx, array, index):
    """``array[index]`` read atomically (sequentially consistent)."""
    sig = types.int64(array, index)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_pointer(context, builder, signature, args), "seq_cst", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, array, index, value):
    """``array[index] = value`` atomically (sequentially consistent)."""
    sig = types.none(array, index, types.int64)

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, _pointer(context, builder, signature, args), "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, array, index, expected, value):
    """``array[index] = value`` if it holds ``expected`` (atomically); whether it did."""
    sig = types.boolean(array, index, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        pair = builder.cmpxchg(_pointer(context, builder, signature, args), args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return sig, codegen


@intrinsic
def fetch_add(typingctx, address, value):
    """The int64 at ``address`` (a raw address, not an array element) increased by ``value`` atomically; returns
    the value before: the counters parts on several cores claim their next chunk from (``f32_kernels``'
    ``sgemm_tasks``, the AMX products' chunks)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return builder.atomic_rmw("add", builder.inttoptr(args[0], i64.as_pointer()), args[1], "seq_cst")

    return sig, codegen


@intrinsic
def pause(typingctx):
    """The CPU's spin-wait hint (nothing where it has none)."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        if _PAUSE:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        _PAUSE), [])
        return context.get_dummy_value()

    return sig, codegen


@_spin
def load(flags, index):
    return atomic_load(flags, index)


@_spin
def store(flags, index, value):
    atomic_store(flags, index, value)


@intrinsic
def monotonic_ns(typingctx):
    """Nanoseconds of the monotonic clock (libc's ``clock_gettime(CLOCK_MONOTONIC)``, by name: the vDSO, ~20 ns;
    the CPU's time-stamp counter is not used, a virtual machine's may differ between cores)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        spec = cgutils.alloca_once(builder, ir.LiteralStructType([i64, i64]))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [
            ir.IntType(32), spec.type]), "clock_gettime")
        builder.call(fn, [ir.Constant(ir.IntType(32), 1), spec])  # CLOCK_MONOTONIC
        seconds = builder.load(cgutils.gep_inbounds(builder, spec, 0, 0))
        nanos = builder.load(cgutils.gep_inbounds(builder, spec, 0, 1))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanos)

    return sig, codegen


@intrinsic
def yield_core(typingctx):
    """``sched_yield()``: let another thread that is ready to run on this core run first (libc's, by name)."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@_spin
def ticks():
    """Nanoseconds of the monotonic clock (as ``time.monotonic_ns``)."""
    return monotonic_ns()


# ---- the pool's hand-off (``cpu/threads.py`` ``_SpinningPool``): one call per wait, so a worker re-enters Python
# (and takes the GIL) once per part. Per worker, ``stride`` int64 slots from ``base``: POSTED, CLAIMED, DONE, ASLEEP.
POSTED, CLAIMED, DONE, ASLEEP = 0, 1, 2, 3
TIMED_OUT, MINE, PREEMPTED, WAKE_CALLER = 0, 1, 2, 3


@_spin
def claim_posted(flags, base, value):
    """Claim the part posted as ``value`` (CLAIMED below it: set to it); whether this call did (one caller wins)."""
    while True:
        current = atomic_load(flags, base + CLAIMED)
        if current >= value:
            return False
        if compare_exchange(flags, base + CLAIMED, current, value):
            return True


@_spin
def raise_to(flags, index, value):
    """``flags[index] = max(flags[index], value)`` atomically: a part finished late (its caller interrupted)
    never lowers a newer part's DONE."""
    while True:
        current = atomic_load(flags, index)
        if current >= value or compare_exchange(flags, index, current, value):
            return


@_spin
def post(flags, stride, workers, value, asleep):
    """Post part ``value`` to workers ``0..workers-1``; ``asleep[i]`` set to whether worker i was asleep (to be
    woken; its ASLEEP flag cleared here). Returns how many were."""
    sleeping = 0
    for i in range(workers):
        atomic_store(flags, stride * i + POSTED, value)
    for i in range(workers):
        if atomic_load(flags, stride * i + ASLEEP) != 0:
            atomic_store(flags, stride * i + ASLEEP, 0)
            asleep[i] = 1
            sleeping += 1
        else:
            asleep[i] = 0
    return sleeping


@_spin
def claim_unstarted(flags, stride, workers, value, mine):
    """The caller, its own part done: claim every posted part no worker has started (``mine[i]`` 1 where this
    call claimed worker i's part, last worker first); how many it claimed."""
    count = 0
    for i in range(workers - 1, -1, -1):
        if claim_posted(flags, stride * i, value):
            mine[i] = 1
            count += 1
        else:
            mine[i] = 0
    return count


@_spin
def finish(flags, stride, workers, value, mine, budget, yield_every):
    """The caller, its own part done: ``claim_unstarted``; if it claimed any, their count, negated (the caller
    runs them, then ``wait_done``); else ``wait_done``: 1 if every part is done, 0 if not within ``budget``."""
    claimed = claim_unstarted(flags, stride, workers, value, mine)
    if claimed:
        return -claimed
    return 1 if wait_done(flags, stride, workers, value, budget, yield_every) else 0


@_spin
def wait_done(flags, stride, workers, value, budget, yield_every):
    """Spin until every worker's DONE is ``value`` (yielding the core every ``yield_every`` ns), at most ``budget``
    ns; whether they all are."""
    start = monotonic_ns()
    next_yield = start + yield_every
    i = 0
    while i < workers:
        if atomic_load(flags, stride * i + DONE) == value:
            i += 1
            continue
        now = monotonic_ns()
        if now - start >= budget:
            return False
        if now >= next_yield:
            yield_core()
            next_yield = monotonic_ns() + yield_every
        pause()
    return True
