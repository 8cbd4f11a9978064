"""Atomic flags the CPU thread pool (``cpu/threads.py``) hands parts over with, read and written by compiled code
that releases the GIL: a worker waiting for its next part, or the caller waiting for a worker's part to finish,
spins on a flag for a bounded time without the GIL (so the other thread runs Python meanwhile) instead of
sleeping in the kernel, whose wake-up costs 20-50 us on this kind of machine (a virtual CPU woken by an
interrupt) - more than a decoding step's matrix-vector product takes on a core.

Every access is a sequentially consistent atomic on an ``int64`` array element (LLVM's ``load atomic`` /
``store atomic`` / ``cmpxchg``); the spin loops execute the CPU's pause hint between reads (``pause`` on x86;
elsewhere none).
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


@_spin
def claim(flags, index, expected, value):
    """Set ``flags[index]`` from ``expected`` to ``value``; whether this call did (one caller wins)."""
    return compare_exchange(flags, index, expected, value)


@_spin
def wait_change(flags, index, seen, spins):
    """Spin (without the GIL) until ``flags[index] != seen`` or ``spins`` reads have passed; its last value."""
    for _ in range(spins):
        value = atomic_load(flags, index)
        if value != seen:
            return value
        pause()
    return atomic_load(flags, index)


@_spin
def wait_equal(flags, index, wanted, spins):
    """Spin (without the GIL) until ``flags[index] == wanted`` or ``spins`` reads have passed; whether it is."""
    for _ in range(spins):
        if atomic_load(flags, index) == wanted:
            return True
        pause()
    return atomic_load(flags, index) == wanted
