"""Graph capture for the CPU backend: runs of compiled kernel calls replayed as one compiled call ("chains").

A decoding step of a language model is ~550 kernel calls of a few microseconds each; called one by one from
Python each costs ~6 us of dispatch, and on two threads each split kernel hands its second part to a sleeping pool
worker (20-50 us). A kernel step whose whole work is calls of numba functions carries a description (``tag``): its
*phases*, each a list of ``Call(fn, args, part)`` that may run at once (``part``: the part of a split kernel, run
by thread ``part % T``; ``None``: the whole call, on thread 0), phase after phase. ``NumpyBackend.capture``
(``capture`` here) turns every maximal run of described steps into a *program* - per call a row: which argument
layout (opcode), which thread, where its arguments start in an int64 and a float64 table (array address, shape,
byte strides; scalars) - run by a generated ``numba.njit(nogil=True)`` interpreter with one branch per opcode.
The interpreter rebuilds each array from the table (``_view``) and calls the kernel's own machine code at its
address (``_call``, numba's calling convention): nothing is compiled or linked again, so a model needs one small
interpreter (compiled once, then cached on disk) whatever its depth, and every kernel runs the very code it runs
when called from Python (all the chains of one capture share one interpreter, with the union of their opcodes:
one compile, not one per chain). Steps without a description (numpy, BLAS, host work) run as they are, between
chains.

On ``THREADS`` = T > 1 every thread runs the chain at once (the caller and T - 1 workers of the kernels' pool, which
run it as a compiled job without the GIL, ``lockstep.py``: one hand-off per chain rather than one per kernel), each
calling the parts it owns, with a barrier row after a phase where the next phase's threads differ (two phases on
thread 0 alone need none). Single-part calls that say what they touch are spread over the threads by the memory
they share (``_assign_run``), a temporary that ties two independent branches together only through the arena's
reused bytes moved to private memory first (``rename.py``). The barrier spins on atomics (``spin.py``) for
``SPINS`` reads, then yields its core until the others arrive, so a descheduled thread slows the chain but cannot
hang it; a thread whose call raises or refuses its input sets an abort flag every waiting thread sees.

The same kernels run on the same arguments in the same order with the same parts: results are bit for bit those
of the steps run one by one. A kernel that checks its input (``Call.checked``: returns nonzero on bad input) or
raises stops the chain at the next barrier; that step then runs on its own, which raises its located error.

Generated sources go to ``<plan cache folder>/cpu-chains/`` (named by a digest of the source, this file,
``spin.py`` and numba's version) and are imported from there so numba caches their machine code; a file that
differs from the generated text is rewritten, never imported. ``LUMINAL_RECIPES_CHAIN=0`` turns chains off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from .. import threads as cpu_threads
from .spin import atomic_load, atomic_store, compare_exchange, pause

ENV = "LUMINAL_RECIPES_CHAIN"
# a chain with fewer kernels split over the threads runs on the calling thread alone (its parts one after another):
# handing a chain to the pool's workers costs a wake-up (20-50 us), which a few split products do not repay (a
# decode program whose attention runs as BLAS products, between the chains, has one or two per chain)
MIN_SPLIT_PHASES = 8
# ... or one split phase of this many multiply-adds (``Call.work``; an AMX product's parts, ``amx.MACS_PER_PART``
# each at least): its second core pays for the chain's hand-off by itself, which before it was a pool hand-off of
# its own between two chains
LOCKSTEP_WORK = 1 << 23
SPINS = 2000  # barrier reads (with the pause hint, ~20-40 ns each here) before a waiting thread yields its core
_STRIDE = 8  # int64 flags one cache line apart
COUNT, GEN, ERR, ABORT = 0, _STRIDE, 2 * _STRIDE, 3 * _STRIDE


def enabled() -> bool:
    """Whether chains are on (``LUMINAL_RECIPES_CHAIN`` not 0), read at each capture."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Call(NamedTuple):
    """One call of a compiled (nogil) function: ``fn(*args)``. ``part``: which part of a split kernel (thread
    ``part % T`` runs it), ``None`` for a whole call (thread 0). ``checked``: it returns nonzero on bad input.
    ``blas``: it calls BLAS (``f32_kernels.sgemm_tasks``), which must then run single-threaded: a chain holding
    such a call runs under ``threads.blas_single_threaded``. ``access``: ``(reads, writes)``, every array whose
    memory the call may read and may write (a superset is fine, a missing one is a race); given, the chain puts
    a barrier before the call only where it touches what another thread touched since the last barrier and one
    of the two writes it (``_layout``). ``None``: unknown - a barrier wherever the thread changes hands.
    ``work``: multiply-adds the call does (0: not said); a phase split over the threads with ``LOCKSTEP_WORK`` of
    them runs its chain in lockstep, however few split phases it has (``_Chain``)."""

    fn: Any
    args: tuple
    part: int | None = None
    checked: bool = False
    blas: bool = False
    access: tuple | None = None
    work: int = 0


def tag(step: Callable, *phases: Sequence[Call], redescribe: Callable[[], Sequence] | None = None) -> Callable:
    """Describe ``step`` as ``phases`` (each a sequence of calls that may run at once) and return it. Calls of
    functions that are not module-level numba dispatchers leave the step undescribed (run from Python).
    ``redescribe``: phases of the same work with its parts cut again under ``threads.finer_parts`` (``finer``)."""
    phases = tuple(tuple(phase) for phase in phases if phase)
    if phases and chainable(phases):
        try:
            step.chain = phases
        except AttributeError:  # a builtin or bound method: wrapped
            inner = step

            def step():
                inner()

            step.chain = phases
        if redescribe is not None:
            step.rechain = redescribe
    return step


def chainable(phases: tuple) -> bool:
    """Every call is of a module-level numba dispatcher, with arguments a chain carries (``tag``'s test)."""
    return all(hasattr(call.fn, "overloads") and describable(call.args) for phase in phases for call in phase)


def phases_of(step: Callable) -> tuple | None:
    return getattr(step, "chain", None)


def finer(step: Callable, size: int) -> tuple | None:
    """``step``'s phases with its kernels' parts of ``size`` elements at least (``threads.finer_parts``), for a
    chain run on every thread in lockstep, where a part costs a barrier rather than a hand-off; its own phases
    where it cannot describe itself again (``tag``'s ``redescribe``). A kernel's parts are independent (the
    element-wise passes, copies, rows of a norm, columns of a product): the same values, bit for bit, however
    its work is cut."""
    from .. import threads as cpu_threads

    redescribe = getattr(step, "rechain", None)
    if redescribe is None:
        return phases_of(step)
    if getattr(redescribe, "always", False):  # a kernel whose lockstep parts are its own choice (kernels/gguf.py)
        phases = tuple(tuple(phase) for phase in redescribe() if phase)
        return phases if phases and chainable(phases) else phases_of(step)
    # (described again even at ``MIN_PART``: the compiled element-wise passes' own minimum is larger,
    # ``elementwise.JIT_PART_ELEMS``, so a SiLU gate of 200k elements is one part as a step, two in lockstep)
    with cpu_threads.finer_parts(size):
        phases = tuple(tuple(phase) for phase in redescribe() if phase)
    return phases if phases and chainable(phases) else phases_of(step)


def combine(step: Callable, *parts: Callable) -> Callable:
    """Tag ``step`` with the phases of ``parts`` run in order, where every one of them is described."""
    described = [phases_of(p) for p in parts]
    if all(d is not None for d in described):
        redescribe = None
        if any(hasattr(p, "rechain") for p in parts):
            def redescribe():  # (called inside ``finer_parts``: each part described again at that size)
                return tuple(phase for p in parts for phase in (p.rechain() if hasattr(p, "rechain")
                                                                 else phases_of(p)))

            redescribe.always = any(getattr(getattr(p, "rechain", None), "always", False) for p in parts)
        return tag(step, *(phase for d in described for phase in d), redescribe=redescribe)
    return step


# ---- compiled helpers ------------------------------------------------------------------------------------------
_sched_yield = types.ExternalFunction("sched_yield", types.intc())
_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


@_kernel
def barrier(flags, threads, spins):
    """Wait until ``threads`` threads have arrived (a generation counter: reusable at once); False when another
    thread aborted (its call raised)."""
    gen = atomic_load(flags, GEN)
    while True:
        count = atomic_load(flags, COUNT)
        if compare_exchange(flags, COUNT, count, count + 1):
            break
    if count + 1 == threads:
        atomic_store(flags, COUNT, 0)
        atomic_store(flags, GEN, gen + 1)
        return True
    n = 0
    while atomic_load(flags, GEN) == gen:
        if atomic_load(flags, ABORT) != 0:
            return False
        if n < spins:
            n += 1
            pause()
        else:
            _sched_yield()
    return True


@_kernel
def scatter_rows(out, idx, src, rows):
    """``out[idx[j]] = src[j]`` for a few rows (a decoded token's keys and values into the KV cache); 1 (and
    nothing written from that row on) when an index is outside ``[0, rows)``."""
    for j in range(idx.shape[0]):
        i = idx[j]
        if i < 0 or i >= rows:
            return 1
        out[i] = src[j]
    return 0


@_kernel
def gather_rows(out, idx, table, rows):
    """``out[j] = table[idx[j]]`` (``out`` ``[n, width]``, ``table`` ``[rows, width]``): a ``Gather``'s rows;
    1 (and nothing written from that row on) when an index is outside ``[0, rows)``."""
    for j in range(idx.shape[0]):
        i = idx[j]
        if i < 0 or i >= rows:
            return 1
        out[j] = table[i]
    return 0


@_kernel
def copy_region(dst, region, src, fill):
    """A scratch operand's refresh (``views.gatherer``): ``dst`` zeroed where ``fill``, then ``region`` (a view
    of ``dst``) = ``src``."""
    if fill:
        dst[...] = 0
    region[...] = src


def region_copy(dst: np.ndarray, flat: np.ndarray, bv) -> Call | None:
    """The ``Call`` doing what ``views.gatherer(dst, flat, bv)`` does (the same box arithmetic), or None where
    that takes another path (reads past the buffer, an empty box) or the dtypes differ."""
    from luminal_recipes.graph.view import BoundView

    from ...views import strided

    box = []
    for axis, d in enumerate(bv.shape):
        lo, hi = (0, d) if bv.mask is None else bv.mask[axis]
        lo, hi = max(lo, 0), min(hi, d)
        if lo >= hi:
            return None
        box.append((lo, hi))
    offset = bv.offset + sum(lo * s for (lo, _), s in zip(box, bv.strides))
    src = strided(flat, BoundView(tuple(hi - lo for lo, hi in box), bv.strides, offset, None))
    if src is None or src.dtype != dst.dtype or dst.ndim == 0:
        return None
    region = dst[tuple(slice(lo, hi) for lo, hi in box)]
    fill = region.shape != dst.shape
    return Call(copy_region, (dst, region, src, fill), access=((src,), (dst if fill else region,)))


@intrinsic
def _view(typingctx, table, row, col, key):
    """The array whose address, shape and byte strides are ``table[row, col:]`` (int64), of the numba array type
    ``key`` names (a string literal, ``_array_key``): the kernels' arguments rebuilt inside a chain, so a call
    passes two tables rather than hundreds of arrays. No reference is counted: the chain keeps the arrays."""
    if not isinstance(key, types.StringLiteral):
        return None
    dtype, ndim, layout, readonly = key.literal_value.split(":")
    ndim = int(ndim)
    arrty = types.Array(numba.from_dtype(np.dtype(dtype)), ndim, layout, readonly=readonly == "ro")
    sig = arrty(table, row, col, key)

    def codegen(context, builder, signature, args):
        tab = context.make_array(signature.args[0])(context, builder, args[0])
        ncols = cgutils.unpack_tuple(builder, tab.shape, 2)[1]
        base = builder.add(builder.mul(args[1], ncols), args[2])

        def get(j):
            at = builder.add(base, context.get_constant(types.intp, j))
            return builder.load(builder.gep(tab.data, [at]))

        ary = context.make_array(arrty)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(arrty.dtype)))
        populate_array(ary, data=builder.inttoptr(get(0), ary.data.type),
                       shape=cgutils.pack_array(builder, [get(1 + i) for i in range(ndim)]),
                       strides=cgutils.pack_array(builder, [get(1 + ndim + i) for i in range(ndim)]),
                       itemsize=itemsize, meminfo=None)
        return ary._getvalue()

    return sig, codegen


def _array_key(a: np.ndarray) -> str | None:
    """The numba array type ``numba.typeof(a)`` gives, as ``dtype:ndim:layout:rw|ro`` (the same flags it reads,
    without its cost: a capture encodes thousands of arrays)."""
    if not a.flags.aligned or a.dtype.kind not in "biuf" or a.dtype.byteorder not in "=|":
        return None
    layout = "C" if a.flags.c_contiguous else "F" if a.flags.f_contiguous else "A"
    return f"{a.dtype.str[1:]}:{a.ndim}:{layout}:{'rw' if a.flags.writeable else 'ro'}"


_SCALARS = {"ti[0, {i}] != 0": types.boolean, "ti[0, {i}]": types.int64, "tf[0, {f}]": types.float64,
            "np.float32(tf[0, {f}])": types.float32}
_INTEGERS = {f"np.{name}(ti[0, {{i}}])": getattr(types, name) for name in ("int8", "int16", "int32", "uint8",
                                                                           "uint16", "uint32")}


def _encode(arg) -> tuple[str, list[int], list[float]] | None:
    """(the expression reading ``arg`` back inside a chain, with ``{i}``/``{f}`` its first int/float column - it
    names the argument's numba type too -; its int columns; its float columns), or None for an argument chains do
    not carry."""
    if isinstance(arg, np.ndarray):
        key = _array_key(arg)
        if key is None:
            return None
        ints = [arg.ctypes.data, *arg.shape, *arg.strides]
        return f"_view(ti, 0, {{i}}, '{key}')", ints, []
    if isinstance(arg, (bool, np.bool_)):
        return "ti[0, {i}] != 0", [int(bool(arg))], []
    if isinstance(arg, int):
        return ("ti[0, {i}]", [arg], []) if -(1 << 63) <= arg < 1 << 63 else None
    if isinstance(arg, np.integer):
        if arg.dtype == np.int64:
            return "ti[0, {i}]", [int(arg)], []
        template = f"np.{arg.dtype.name}(ti[0, {{i}}])"
        return (template, [int(arg)], []) if template in _INTEGERS else None
    if isinstance(arg, float) or isinstance(arg, np.floating) and arg.dtype == np.float64:
        return "tf[0, {f}]", [], [float(arg)]
    if isinstance(arg, np.floating) and arg.dtype == np.float32:
        return "np.float32(tf[0, {f}])", [], [float(arg)]
    return None


@functools.cache
def _numba_type(template: str):
    """The numba type of an argument ``_encode`` wrote as ``template``."""
    if template.startswith("_view("):
        dtype, ndim, layout, access = template.split("'")[1].split(":")
        return types.Array(numba.from_dtype(np.dtype(dtype)), int(ndim), layout, readonly=access == "ro")
    return _SCALARS.get(template) or _INTEGERS[template]


def describable(args: tuple) -> bool:
    return all(_encode(a) is not None for a in args)


FAILED = 1 << 40  # what ``_call`` returns when the kernel raised (its status is an error)
_RETURNS = {"none": types.none, "int64": types.int64, "int32": types.int32, "bool": types.boolean}


@intrinsic
def _call(typingctx, address, returns, args):
    """Call the compiled kernel at ``address`` (numba's own calling convention, the machine code its dispatcher
    runs: nothing is compiled or linked again) with the tuple ``args``, returning ``returns`` (a string literal,
    ``_RETURNS``); the result as int64 (0 for none), ``FAILED`` where the kernel raised."""
    if not isinstance(returns, types.StringLiteral) or not isinstance(args, types.BaseTuple):
        return None
    restype = _RETURNS[returns.literal_value]
    sig = types.int64(address, returns, args)

    def codegen(context, builder, signature, llargs):
        argtys = list(signature.args[2])
        values = cgutils.unpack_tuple(builder, llargs[2], len(argtys))
        fnty = context.call_conv.get_function_type(restype, argtys)
        callee = builder.inttoptr(llargs[0], fnty.as_pointer())
        retty = context.call_conv.get_return_type(restype).pointee
        ret = cgutils.alloca_once(builder, retty)
        builder.store(cgutils.get_null_value(retty), ret)
        excinfo = cgutils.alloca_once(builder, fnty.args[1].pointee, name="excinfo")
        packed = list(context.call_conv._get_arg_packer(argtys).as_arguments(builder, values))
        code = builder.call(callee, [ret, excinfo, *packed])
        status = context.call_conv._get_return_status(builder, code, builder.load(excinfo))
        if restype == types.none:
            value = context.get_constant(types.int64, 0)
        else:
            out = context.get_returned_value(builder, restype, builder.load(ret))
            value = context.cast(builder, out, restype, types.int64)
        return builder.select(status.is_error, context.get_constant(types.int64, FAILED), value)

    return sig, codegen


_ENTRIES: dict[tuple, tuple[int, str] | None] = {}


def _entry(fn, templates: tuple[str, ...]) -> tuple[int, str] | None:
    """(the address of ``fn``'s machine code for arguments of these types - ``_encode``'s templates -, its return
    type's name), compiling it (or loading it from numba's cache) where this signature has not run yet; None for a
    kernel that does not compile for them or returns another type."""
    key = (fn, templates)
    if key in _ENTRIES:
        return _ENTRIES[key]
    sig = tuple(_numba_type(t) for t in templates)
    cres = fn.overloads.get(sig)
    if cres is None:
        try:
            fn.compile(sig)
        except Exception:  # noqa: BLE001 - a kernel that does not compile for these types: not chained
            return None
        cres = fn.overloads.get(sig)
    entry = None
    if cres is not None:
        restype = types.unliteral(cres.signature.return_type)
        returns = next((name for name, ty in _RETURNS.items() if ty == restype), None)
        if returns is not None:
            entry = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name), returns
    _ENTRIES[key] = entry
    return entry


# ---- capture -----------------------------------------------------------------------------------------------------
def capture(steps: Sequence[Callable], threads: int, buffers: Sequence[tuple] | None = None
            ) -> Callable[[], None] | None:
    """One step replaying ``steps``: maximal runs of described steps as chains, the others called as they are;
    None when no run of two or more described steps is found (nothing to gain). ``buffers``: the arena's buffers
    ``(first byte, end byte, first step, last step)`` (steps as indices in ``steps``), whose temporaries a
    lockstep chain may move to private memory to run independent branches at once (``rename``)."""
    items: list = []  # a plain step, or a list of consecutive described steps
    first: dict[int, int] = {}  # id of a list of described steps -> the index of its first step in ``steps``
    for index, step in enumerate(steps):
        if phases_of(step) is not None:
            if items and isinstance(items[-1], list):
                items[-1].append(step)
            else:
                items.append([step])
                first[id(items[-1])] = index
        else:
            items.append(step)
    if not any(isinstance(it, list) and len(it) > 1 for it in items):
        return None
    program: list = []
    made: list[_Chain] = []
    chained: set[int] = set()  # indices in ``steps`` of the steps run inside chains
    for it in items:
        local = None
        if buffers and isinstance(it, list) and len(it) > 1:  # (steps as indices in the chain's own)
            at = first[id(it)]
            local = [(lo, hi, a - at, b - at) for lo, hi, a, b in buffers if b >= at and a < at + len(it)]
        chain = (None if not isinstance(it, list) or len(it) < 2 else _Chain(it, threads, local) if local
                 else _Chain(it, threads))
        if chain is not None and chain.ok:
            program.append(chain)
            made.append(chain)
            at = first[id(it)]
            chain.array_steps = chain.array_steps + at  # (indices in ``steps``, as ``Relocation`` asks)
            chain.held_steps = chain.held_steps + at
            chain.tables = [(table, step + at, writes) for table, step, writes in chain.tables]
            chained.update(range(at, at + len(it)))
        else:
            program.extend(it if isinstance(it, list) else [it])
    if not made:
        return None
    # one interpreter for all the chains of this capture, with the union of their opcodes: one numba compile
    # (~0.4 s each, cold) instead of one per distinct opcode set (the tiny FLUX.2 transformer's 10 chains had 8)
    union: dict[tuple, int] = {}
    for chain in made:
        for op in chain.opcodes:
            union.setdefault(op, len(union))
    run_fn = _interpreter(list(union))
    for chain in made:
        chain.finish(run_fn, union)
    chains, lockstep = len(made), sum(chain.threads > 1 for chain in made)
    program = [step.run if isinstance(step, _Chain) else step for step in program]
    program = tuple(program)

    def replay() -> None:
        with np.errstate(all="ignore"):
            for step in program:
                step()

    replay.chains, replay.lockstep, replay.launches = chains, lockstep, len(program)  # chains, those on every
    # thread, Python calls per replay
    replay.relocation = functools.partial(Relocation, tuple(made), frozenset(chained))  # (``Relocation``)
    return replay


_SCANNED = 1 << 20  # int64 array arguments up to this many elements are scanned for addresses (tables of them)


class Relocation:
    """Memory regions whose chained arrays a run re-points elsewhere: an executable reading an input where its
    caller holds it, or writing an output into fresh memory, instead of copying it through its slot.

    ``regions``: per region ``(first byte, end byte, steps, read_only)`` - a slot of the arena, and the indices
    (in the captured ``steps``) of every step that touches the value held there (while other steps may hold
    other values in the same bytes: those are left alone). Those steps' calls reach the region through their
    array arguments (addresses in the chain's int table) and through int64 arrays holding addresses (tables of
    operand origins: ``elementwise_tiles``); both are patched. A region is *relocatable* (``ok[k]``) when each of
    those steps runs inside a chain and every array of theirs that meets the region lies inside it; never when
    one of their calls is given an integer scalar inside it (an address passed as a number, which the tables do
    not hold apart from the other scalars) or when an address two regions claim (lifetimes that overlap); with
    ``read_only``, only when none of their calls says it writes there (``Call.access``; a call reaching the
    region through a table must say so). ``apply(deltas)`` adds ``deltas[k]`` bytes to region ``k``'s addresses
    (0: its slot, as captured) and ``restore()`` puts them back: the chains then run the very calls on the other
    memory, so the results are bit for bit those of the slot. The caller answers for the memory it points at
    (live, the size of the slot, not written by anything else during the run)."""

    def __init__(self, chains: tuple, chained: frozenset[int], regions: Sequence[tuple]):
        self.ok = [False] * len(regions)
        self.why: list[str | None] = [None] * len(regions)  # per region refused, why (diagnostics, tests)
        claims = []  # (int64 vector, indices in it, region): a chain's int table, or a table of addresses
        for k, (lo, hi, steps, read_only) in enumerate(regions):
            if not steps or not set(steps) <= chained:
                self.why[k] = "a step outside the chains"
                continue
            mine, fits = [], True
            wanted = np.array(sorted(steps), np.int64)
            for chain in chains:
                a_lo, a_hi = chain.array_lo, chain.array_hi
                held = chain.held_values[np.isin(chain.held_steps, wanted)]
                if ((held >= lo) & (held < hi)).any():  # an address passed as a number
                    fits, self.why[k] = False, "an address passed as a number"
                    break
                meets = np.isin(chain.array_steps, wanted) & (((a_lo < hi) & (lo < a_hi)) |
                                                              ((a_lo == a_hi) & (lo <= a_lo) & (a_lo < hi)))
                if meets.any():
                    if ((a_lo[meets] < lo) | (a_hi[meets] > hi)).any():
                        fits, self.why[k] = False, "an array reaching past it"
                        break
                    if read_only and chain.array_written[meets].any():
                        fits, self.why[k] = False, "a call writes into it"
                        break
                    mine += [(row, chain.array_columns[meets]) for row in chain.int_rows]
                for table, step, writes in chain.tables:
                    if step not in steps:
                        continue
                    at = np.flatnonzero((table >= lo) & (table < hi))
                    if len(at):
                        if read_only and (writes is None or _overlap(writes, ((lo, hi),))):
                            fits, self.why[k] = False, "a call reaching it through a table may write it"
                            break
                        mine.append((table, at))
                if not fits:
                    break
            if fits and not mine:
                self.why[k] = "no chained array in it"
            if fits and mine:
                self.ok[k] = True
                claims += [(vec, at, k) for vec, at in mine]
        owners: dict[tuple[int, int], set[int]] = {}
        for vec, at, k in claims:
            base = vec.__array_interface__["data"][0]
            for i in at.tolist():
                owners.setdefault((base, i), set()).add(k)
        for ks in owners.values():
            if len(ks) > 1:
                for k in ks:
                    self.ok[k], self.why[k] = False, "an address another region claims"
        grouped: dict[int, list] = {}
        for vec, at, k in claims:
            if self.ok[k]:
                grouped.setdefault(vec.__array_interface__["data"][0], []).append((vec, at, k))
        self.parts = []  # per vector: (it, the indices patched, their captured values, each one's region)
        for got in grouped.values():
            vec = got[0][0]
            at = np.concatenate([a for _, a, _ in got])
            which = np.concatenate([np.full(len(a), k, np.int64) for _, a, k in got])
            self.parts.append((vec, at, vec[at].copy(), which))

    def apply(self, deltas: np.ndarray) -> None:
        for vec, at, base, which in self.parts:
            vec[at] = base + deltas[which]

    def restore(self) -> None:
        for vec, at, base, _ in self.parts:
            vec[at] = base


def warm(steps: Sequence[Callable], threads: int) -> int:
    """Load now, under one hold of numba's compiler lock, what ``capture(steps, threads)`` will load when a
    decoding loop records its chains at its fifth run: the kernels' entries for the chains' argument types and
    the generated interpreters (``capture``'s work, its program thrown away; the later capture finds them loaded
    and loads nothing). Each load from numba's disk cache runs LLVM's loading code, whose pages (~10 MiB) stay
    resident until the lock is let go (``code_pages.py``): loaded before a model's first run has read its
    weights, they come and go below the process's peak instead of on top of it. Nothing runs; what later runs
    is unchanged, bit for bit. Returns how many kernel entries and interpreters were worked out."""
    from numba.core.compiler_lock import global_compiler_lock

    before = len(_MEMO) + len(_ENTRIES)
    with global_compiler_lock:  # one hold: LLVM's pages released once, after all of it
        capture(steps, threads)
    WARMED[0] += 1
    return len(_MEMO) + len(_ENTRIES) - before


WARMED = [0]  # calls of ``warm`` (tests)
BARRIER = -1
PROGRAM_COLUMNS = 5  # per row: opcode (BARRIER: a barrier), thread, first int column, first float column, checked


class _Chain:
    """A run of described steps as one program of a generated interpreter: per call a row (its opcode - which
    argument types it takes -, its thread, where its arguments start in the int and float tables, whether it is
    checked), barriers between phases where threads change hands."""

    def __init__(self, steps: list[Callable], threads: int, buffers: list[tuple] | None = None):
        described = [phases_of(s) for s in steps]
        if threads > 1:  # parts cut finer where the chain runs in lockstep (``finer``): no hand-off per kernel
            fine = [finer(s, _min_part()) for s in steps]
            if _split_phases(fine, threads) >= MIN_SPLIT_PHASES or _heavy_split(fine, threads):
                described = fine
            else:
                threads = 1  # too few split kernels to pay for the hand-off: every part on the calling thread
        flat = [(i, phase) for i, phases in enumerate(described) for phase in phases]
        self.steps, self.threads = steps, threads
        self.flags = np.zeros(4 * _STRIDE, np.int64)
        opcodes: dict[tuple, int] = {}
        ints, floats = [], []
        self.ok = False
        encoded_phases = []  # per phase: (step index, [(opcode, part, int col, float col, checked, spans, cost)])
        arrays = []  # per array argument: (its address column, step index, first byte, end byte, written)
        held = []  # integers the calls are given that cannot be patched (scalars, other 8-byte ints), with step
        tables = []  # int64 arrays the calls are given (flat), their step and the call's written spans (or None)
        per_call = []  # per call, for ``rename.Renamer``: [step, spans, arrays, tables, held, checked]
        for i, phase in flat:
            rows = []
            for call in phase:
                mine = [i, None, [], [], [], call.checked]
                per_call.append(mine)
                encoded = [_encode(arg) for arg in call.args]
                entry = _entry(call.fn, tuple(e[0] for e in encoded))
                if entry is None:
                    return
                address, returns = entry
                spans = _spans(call.access)
                exprs, vi, vf = [], [address], []
                for arg, (expr, ai, af) in zip(call.args, encoded):
                    if isinstance(arg, np.ndarray):
                        lo, hi = _extent(arg)
                        written = spans is not None and _overlap(spans[1], ((lo, max(hi, lo + 1)),))
                        arrays.append((len(ints) + len(vi), i, lo, hi, written))
                        mine[2].append((len(ints) + len(vi), lo, hi))
                        if (arg.dtype == np.int64 and arg.flags.c_contiguous and arg.flags.writeable
                                and arg.size <= _SCANNED):  # may hold addresses, patched in place if so
                            tables.append((arg.reshape(-1), i, None if spans is None else spans[1]))
                            mine[3].append((len(ints) + len(vi), arg.reshape(-1)))
                        elif arg.dtype.kind in "iu" and arg.itemsize == 8 and arg.size <= _SCANNED:
                            held.append((np.unique(arg.astype(np.int64)), i))  # may hold addresses
                            mine[4].append(held[-1][0])
                    elif isinstance(arg, (int, np.integer)) and not isinstance(arg, (bool, np.bool_)):
                        held.append((np.array([int(arg)], np.int64), i))
                        mine[4].append(held[-1][0])
                    exprs.append(expr.format(i=f"i + {len(vi)}", f=f"f + {len(vf)}"))
                    vi += ai
                    vf += af
                op = opcodes.setdefault((returns, tuple(exprs)), len(opcodes))
                rows.append((op, call.part, len(ints), len(floats), int(call.checked), spans, _work(call)))
                ints += vi
                floats += vf
            encoded_phases.append((i, rows))
        self.private: list[np.ndarray] = []  # temporaries moved out of the arena (``rename``), patched tables
        alone = None  # the int table and int64 tables the program on the calling thread alone runs with, where
        # temporaries moved (there no branch runs beside another: the arena's own bytes, warm in the caches)
        if threads > 1 and TASKS and buffers:
            before, before_tables = list(ints), tables
            encoded_phases, tables = self._rename(encoded_phases, per_call, ints, tables, buffers, threads)
            if self.private:
                alone = np.array(before, np.int64).reshape(1, -1)
                tables = tables + [t for t in before_tables if not any(t[0] is u[0] for u in tables)]
        # the program on ``threads`` threads (lockstep), and on the calling thread alone: the same calls in the
        # same order with the same parts (the same bits), for a machine whose other jobs leave too few cores
        self.layouts = {t: _layout(encoded_phases, t) for t in {1, threads}}
        self.ints = np.array(ints or [0], np.int64).reshape(1, -1)
        self.floats = np.array(floats or [0.0], np.float64).reshape(1, -1)
        self.keep = [c.args for _, phase in flat for c in phase]  # what the tables point into
        # the array arguments' address columns, for ``Relocation`` (columns; step index in ``steps``; extents)
        table = np.array(arrays or [(0, -1, 0, 0, 0)], np.int64).reshape(-1, 5)
        self.array_columns, self.array_steps = table[:, 0], table[:, 1]
        self.array_lo, self.array_hi, self.array_written = table[:, 2], table[:, 3], table[:, 4] != 0
        # integers a call is given that may be addresses (a kernel reaching memory through a table of addresses,
        # ``elementwise_tiles``, or an address passed as a number): memory they point into cannot be relocated
        self.held_values = np.concatenate([v for v, _ in held] or [np.zeros(0, np.int64)])
        self.tables = tables
        self.ints_row = self.ints.reshape(-1)  # (a view: what ``Relocation`` patches)
        self.ints_alone = self.ints if alone is None else alone
        self.int_rows = (self.ints_row,) if alone is None else (self.ints_row, alone.reshape(-1))
        self.held_steps = np.concatenate([np.full(len(v), i, np.int64) for v, i in held] or [np.zeros(0, np.int64)])
        self.blas = any(c.blas for _, phase in flat for c in phase)
        self.opcodes = sorted(opcodes, key=opcodes.get)  # this chain's argument layouts, by its programs' opcodes
        self.run_fn = None  # ``finish``: the capture's interpreter
        self.parts = [functools.partial(self._part, t) for t in range(threads)]
        self.used = 1  # the thread count of the last run (its program's rows name a failed call)
        self.jobs: dict[int, np.ndarray] | None = None  # per worker thread, its job (``lockstep.job_row``)
        self.hot = LOCKSTEP_WORKERS  # (read at capture: a benchmark's sides may differ)
        self.ok = True

    def _rename(self, phases: list, per_call: list, ints: list, tables: list, buffers: list, threads: int):
        """Temporaries that make independent branches of a run of single-thread calls touch (``rename``) moved
        to private memory; the phases with their calls' spans updated, and the tables with the patched copies."""
        from . import rename

        for g, (_, calls) in enumerate([(i, c) for i, cs in phases for c in cs]):
            per_call[g][1] = calls[5]
        renamer = rename.Renamer(per_call, ints, buffers)
        index = [(k, j) for k, (_, calls) in enumerate(phases) for j in range(len(calls))]
        start = 0
        k = 0
        while k < len(phases):
            n = len(phases[k][1])
            if not _movable(phases[k][1], threads):
                k, start = k + 1, start + n
                continue
            end, stop = k, start
            while end < len(phases) and _movable(phases[end][1], threads):
                stop += len(phases[end][1])
                end += 1
            before = list(range(start - len(phases[k - 1][1]), start)) if k else []  # the split phase before
            _untangle(renamer, list(range(start, stop)), index, before)
            k, start = end, stop
        if not renamer.moved:
            return phases, tables
        self.private = renamer.keep
        out = [(i, list(calls)) for i, calls in phases]
        for g, (k, j) in enumerate(index):
            call = out[k][1][j]
            out[k][1][j] = (*call[:5], per_call[g][1], call[6])
        # (the int64 tables ``move`` copied: ``Relocation`` patches the ones the chain runs with)
        now = [t for c in per_call for _, t in c[3]]
        tables = [(t, i, w) for t, (_, i, w) in zip(now, tables)]
        return out, tables

    def finish(self, run_fn, union: dict[tuple, int]) -> None:
        """Run by ``run_fn``, the interpreter of ``union`` (every opcode of the capture, numbered): the programs'
        opcodes renumbered to the union's, compiled (or loaded) for the programs' types now, not at a first run
        (``warm``)."""
        index = np.array([union[op] for op in self.opcodes] or [0], np.int64)
        for program, _ in self.layouts.values():
            ops = program[:, 0]
            calls = ops != BARRIER
            ops[calls] = index[ops[calls]]
        self.run_fn = run_fn
        self.args = {t: (program, self.ints if t > 1 else self.ints_alone, self.floats, self.flags, t, SPINS)
                     for t, (program, _) in self.layouts.items()}
        sig = tuple(numba.typeof(a) for a in (0, *self.args[1]))
        if sig not in run_fn.overloads:
            run_fn.compile(sig)

    def _part(self, t: int) -> int:
        try:
            return self.run_fn(t, *self.args[self.threads])
        except BaseException:
            from . import spin

            spin.store(self.flags, ABORT, 1)
            raise

    def run(self) -> None:
        if self.blas:
            from .. import threads as cpu_threads

            with cpu_threads.blas_single_threaded():
                self._run()
            return
        self._run()

    def _run(self) -> None:
        flags = self.flags
        if self.threads == 1 or crowded(self.threads):
            RUNS["crowded" if self.threads > 1 else "alone"] += 1
            self.used = 1
            if self.run_fn(0, *self.args[1]):
                self._failed()
            return
        RUNS["lockstep"] += 1
        self.used = self.threads
        flags[:] = 0
        if self.hot:
            self._lockstep()
        else:
            _lockstep_pool().run(self.parts)
        if flags[ERR]:
            self._failed()

    def _lockstep(self) -> None:
        """This thread runs thread 0's program; the kernels' pool workers the others, by their jobs, without the
        GIL (``lockstep.py``), where that pool is the spinning one; else ``_lockstep_pool()`` as Python parts."""
        from .. import threads as cpu_threads

        pool = cpu_threads.shared_pool()
        if self.jobs is None and hasattr(pool, "run_chain"):
            from . import lockstep

            args = self.args[self.threads]
            entry = _entry(self.run_fn, tuple(_encode(a)[0] for a in (0, *args)))
            self.jobs = {} if entry is None else {t: lockstep.job_row(entry[0], t, args)
                                                  for t in range(1, self.threads)}
        if not self.jobs:
            _lockstep_pool().run(self.parts)
            return
        args = self.args[self.threads]
        pool.run_chain([self.jobs[t] for t in range(1, self.threads)], lambda: self.run_fn(0, *args), self.flags)

    def _failed(self) -> None:
        """A checked call refused its input, or a kernel raised: run that step on its own (it raises its own
        error; steps before it have run, none after it)."""
        row = int(self.flags[ERR]) - 1
        self.flags[:] = 0
        with np.errstate(all="ignore"):
            self.steps[self.layouts[self.used][1][row]]()
        from luminal_recipes.errors import InputError

        raise InputError("a compiled kernel refused its input in a chained step, which then ran on its own without "
                         "error; run with LUMINAL_RECIPES_CHAIN=0 to see which kernel")


def _extent(a: np.ndarray) -> tuple[int, int]:
    """The bytes ``a`` spans, ``[first, end)``, whatever its strides (empty: ``(address, address)``)."""
    lo = hi = a.ctypes.data
    if a.size == 0:
        return lo, hi
    for n, st in zip(a.shape, a.strides):
        lo, hi = lo + min(0, (n - 1) * st), hi + max(0, (n - 1) * st)
    return lo, hi + a.itemsize


def _spans(access: tuple | None) -> tuple[tuple, tuple] | None:
    """``Call.access`` as byte ranges ``(reads, writes)``, each a tuple of ``(start, end)`` (an array's whole
    extent, whatever its strides); None where not given."""
    if access is None:
        return None
    out = []
    for arrays in access:
        ranges = []
        for a in arrays:
            if a is None or a.size == 0:
                continue
            lo = hi = a.ctypes.data
            for n, st in zip(a.shape, a.strides):
                lo, hi = lo + min(0, (n - 1) * st), hi + max(0, (n - 1) * st)
            ranges.append((lo, hi + a.itemsize))
        out.append(tuple(ranges))
    return out[0], out[1]


def _overlap(a: tuple, b: tuple) -> bool:
    return any(lo < e and s < hi for lo, hi in a for s, e in b)


def _conflicts(placed: list, since: dict) -> bool:
    """Whether a call of this phase (``placed``: its calls with their threads) must wait for what other threads
    did since the last barrier (``since``: thread -> the spans of its calls): unknown accesses on either side, or
    memory one writes and the other reads or writes."""
    for t, call in placed:
        spans = call[5]
        for u, done in since.items():
            if u == t:
                continue
            for other in done:
                if spans is None or other is None:
                    return True
                if _touches(spans, other):
                    return True
    return False


def _movable(calls: list, threads: int) -> bool:
    """Whether a phase's calls run on one thread (a single-part kernel, a whole call) and say what they touch
    (``Call.access``): then any thread may run them (``_assign_run``)."""
    return (len({0 if c[1] is None else c[1] % threads for c in calls}) == 1
            and all(c[5] is not None for c in calls))


def _cost(call: tuple) -> int:
    """An encoded call's work, roughly (``_work``)."""
    return call[6]


def _work(call: Call) -> int:
    """A call's work, roughly: the bytes of the arrays it writes (not their extents: a head of a token-major
    tensor spans all of it) plus its multiply-adds (``Call.work``)."""
    return call.work + (0 if call.access is None else sum(a.nbytes for a in call.access[1] if a is not None))


def _touches(a: tuple, b: tuple) -> bool:
    """Whether two calls' spans ``(reads, writes)`` meet where one of them writes."""
    return _overlap(a[1], b[0] + b[1]) or _overlap(a[0], b[1])


def _assign_run(run: list, since: dict, load: list, threads: int) -> list[list[int]]:
    """Threads for a run of movable phases (``run``: their calls; ``since``, ``load``: each thread's calls' spans
    and work since the last barrier), per phase each call's thread. The run is cut into groups that share no
    memory one of them writes (connected components of ``_touches``), and each group goes whole to one thread,
    largest first (``_cost``) to the thread with the least work, preferring one where it needs no barrier (it
    touches nothing another thread did since the last one). Independent branches (FLUX.2's q and k norms, RoPE
    and stacks) then fill the second core instead of waiting at the next barrier; a group's calls stay in program
    order on its thread, and ``_layout`` still puts a barrier wherever two threads' calls touch the same memory,
    so the bits are those of the calls one by one."""
    calls = [(k, j, c) for k, phase in enumerate(run) for j, c in enumerate(phase)]
    out = [[0] * len(phase) for phase in run]
    if sum(_cost(c) for _, _, c in calls) < SPREAD_BYTES:  # less than a barrier's worth: all on thread 0
        return out
    root = list(range(len(calls)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for b in range(len(calls)):
        for a in range(b):  # (calls of one phase may run at once: the kernel says so)
            if calls[a][0] != calls[b][0] and find(a) != find(b) and _touches(calls[a][2][5], calls[b][2][5]):
                root[find(b)] = find(a)
    groups: dict[int, list[int]] = {}
    for i in range(len(calls)):
        groups.setdefault(find(i), []).append(i)
    if len(groups) == 1:  # one branch: only a phase of several calls (a norm's heads) can be shared out
        for k, phase in enumerate(run):
            if len(phase) > 1 and sum(_cost(c) for c in phase) >= SPREAD_BYTES:
                shares = [0] * threads
                for j in sorted(range(len(phase)), key=lambda j: -_cost(phase[j])):
                    t = min(range(threads), key=lambda t: (shares[t], t))
                    shares[t] += _cost(phase[j])
                    out[k][j] = t
        return out
    load = list(load)
    for group in sorted(groups.values(), key=lambda g: -sum(_cost(calls[i][2]) for i in g)):
        def waits(t: int, group=group) -> bool:
            return any(o is None or _touches(calls[i][2][5], o)
                       for u, done in since.items() if u != t for o in done for i in group)

        t = min(range(threads), key=lambda t: (waits(t), load[t], t))
        load[t] += sum(_cost(calls[i][2]) for i in group)
        for i in group:
            k, j, _ = calls[i]
            out[k][j] = t
    return out


def _untangle(renamer, run: list[int], index: list, before: list[int]) -> None:
    """Within ``run`` (calls' indices, a run of single-thread phases), the branches that touch only through
    buffers reusing each other's bytes (``rename.false_touch``) pulled apart: one of the two buffers moved to
    private memory (``renamer.move``) where only one branch reaches it. Likewise a run's buffer reusing bytes
    that the phase ``before`` it (split over the threads) touches: else the run waits at a barrier for it."""
    from . import rename

    calls = renamer.calls
    root = {g: g for g in run}

    def find(g: int) -> int:
        while root[g] != g:
            root[g] = root[root[g]]
            g = root[g]
        return g

    false = []
    for b in run:
        for a in run:
            if a >= b or index[a][0] == index[b][0] or not _touches(calls[a][1], calls[b][1]):
                continue
            got = rename.false_touch(calls[a][1], calls[b][1], calls[a][0], calls[b][0], renamer.buffers)
            if got is None:
                root[find(b)] = find(a)
            else:
                false.append((a, b, got))
    members = set(run)
    for a, b, (ka, kb) in false:
        if find(a) == find(b) or not _touches(calls[a][1], calls[b][1]):
            continue  # one branch anyway, or pulled apart by an earlier move
        group_of = {g: find(g) for g in run}
        for side in (kb, ka):
            if all(renamer.movable(k, members, group_of) for k in side):
                for k in side:
                    renamer.move(k)
                break
        else:
            root[find(b)] = find(a)
    group_of = {g: find(g) for g in run}
    for b in run:
        for a in before:
            if calls[a][1] is None or not _touches(calls[a][1], calls[b][1]):
                continue
            got = rename.false_touch(calls[a][1], calls[b][1], calls[a][0], calls[b][0], renamer.buffers)
            if got is not None and all(renamer.movable(k, members, group_of) for k in got[1]):
                for k in got[1]:
                    renamer.move(k)


def _layout(phases: list, threads: int) -> tuple[np.ndarray, list[int]]:
    """The program rows of ``phases`` (``_Chain``'s encoded calls) on ``threads`` threads, and each row's step.
    A split kernel's part ``p`` runs on thread ``p % threads``; a run of phases on one thread each is spread over
    the threads by ``_assign_run`` (``TASKS``; else on thread 0). A barrier goes before a phase where one of its
    calls needs what another thread did since the last barrier (``_conflicts``: without ``Call.access``, wherever
    the thread changes hands; with it, only on shared memory that one of them writes: q/k/v or gate/up products
    reading the same x and writing their own outputs share one run between barriers), and one at the end."""
    rows, row_step = [], []
    since: dict[int, list] = {}  # per thread, the spans of its calls since the last barrier
    load = [0] * threads  # per thread, the work of its calls since the last barrier
    assigned: dict[int, list[int]] = {}  # phase index -> its calls' threads (``_assign_run``)
    for k, (i, calls) in enumerate(phases):
        if threads > 1 and TASKS and k not in assigned and _movable(calls, threads):
            end = k
            while end < len(phases) and _movable(phases[end][1], threads):
                end += 1
            if sum(len(c) for _, c in phases[k:end]) > 1:
                got = _assign_run([c for _, c in phases[k:end]], since, load, threads)
                assigned.update(zip(range(k, end), got))
        ts = assigned.get(k) or [0 if c[1] is None else c[1] % threads for c in calls]
        placed = list(zip(ts, calls))
        if threads > 1 and since and _conflicts(placed, since):
            rows.append([BARRIER, 0, 0, 0, 0])
            row_step.append(row_step[-1])
            since = {}
            load = [0] * threads
        for t, (op, _, at_int, at_float, checked, spans, cost) in placed:
            rows.append([op, t, at_int, at_float, checked])
            row_step.append(i)
            since.setdefault(t, []).append(spans)
            load[t] += cost
    if threads > 1 and phases:
        rows.append([BARRIER, 0, 0, 0, 0])
        row_step.append(phases[-1][0])
    return np.array(rows, np.int64).reshape(-1, PROGRAM_COLUMNS), row_step


# Lockstep needs every thread on a core at each barrier: with other jobs' threads ready to run, a descheduled
# thread holds the others up at every barrier (the Qwen3-shaped decode step measured 77 vs 48 ms min on two
# threads in lockstep vs one, load average 4 on 2 cores; at load 1.7, SmolLM2's lockstep chains were still the
# faster: docs/performance.md). ``crowded`` samples other processes' running threads (``threads.others_running``,
# as the kernels' pool does) every CROWD_EVERY_S, averaged; when they exceed the cores the chain's threads leave
# by more than CROWD_MARGIN, chains run on the calling thread alone until they are back within half of it.
CROWD_EVERY_S = 0.01
CROWD_MARGIN = 1.0
_CROWD = {"next": 0.0, "others": 0.0, "crowded": False}
# chains run so far: on every thread ("lockstep"), on the calling thread alone because ``crowded`` said so
# ("crowded"), or alone because they have one thread ("alone"); the benchmarks print it beside their figures
RUNS = {"lockstep": 0, "crowded": 0, "alone": 0}
# lockstep chains run on ``lockstep.py``'s workers, which wait for a chain in compiled code (a hand-off of ~1 us);
# LUMINAL_RECIPES_LOCKSTEP_WORKERS=0: on ``threads.blocking_pool()`` as before (a wake-up and two GIL trips each)
LOCKSTEP_WORKERS = os.environ.get("LUMINAL_RECIPES_LOCKSTEP_WORKERS", "1").strip().lower() not in (
    "0", "false", "no", "off")
ADAPTIVE = os.environ.get("LUMINAL_RECIPES_CHAIN_LOCKSTEP", "auto").strip().lower() == "auto"
# independent single-thread calls of a lockstep chain spread over its threads (``_assign_run``);
# LUMINAL_RECIPES_CHAIN_TASKS=0: every such call on thread 0, as before (read at capture)
SPREAD_BYTES = 1 << 17  # a phase of several single-thread calls writing this much is shared out (a barrier's worth)
TASKS = os.environ.get("LUMINAL_RECIPES_CHAIN_TASKS", "1").strip().lower() not in ("0", "false", "no", "off")


def crowded(threads: int) -> bool:
    """Whether other processes' threads ready to run leave fewer cores than ``threads`` (then a chain runs on the
    calling thread alone). ``LUMINAL_RECIPES_CHAIN_LOCKSTEP`` other than ``auto``: never."""
    if not ADAPTIVE:
        return False
    now = time.monotonic()
    state = _CROWD
    if now >= state["next"]:
        state["next"] = now + CROWD_EVERY_S
        running = cpu_threads._running_threads()
        if running is not None:
            pool = cpu_threads._POOL
            awake = 0  # the kernels' pool's workers still spinning after their last part: ours, not others'
            if isinstance(pool, cpu_threads._SpinningPool):
                awake = sum(1 for w in range(len(pool.wakes)) if not pool.flags[cpu_threads._STRIDE * w +
                                                                                cpu_threads.ASLEEP])
            others = cpu_threads.others_running(running, 1 + awake)
            state["others"] = 0.7 * state["others"] + 0.3 * others
            cpus = state.get("cpus") or state.setdefault("cpus", os.cpu_count() or 1)  # (each call reads /sys)
            room = cpus - threads
            if not state["crowded"] and state["others"] > room + CROWD_MARGIN:
                state["crowded"] = True
            elif state["crowded"] and state["others"] <= room + CROWD_MARGIN / 2:
                state["crowded"] = False
    return state["crowded"]


def _lockstep_pool():
    """The threads lockstep chains run on: ``threads.blocking_pool()`` (one wake-up per chain), not the kernels'
    shared pool, whose idle workers may spin (``LUMINAL_RECIPES_SPIN_US``) and whose adaptive hand-off measured
    2-3x slower for a chain's long parts (one decode step 27 vs 9.7 ms median, 2 threads)."""
    from .. import threads as cpu_threads

    return cpu_threads.blocking_pool()


def _threads_of(phase: tuple, threads: int) -> frozenset[int]:
    return frozenset(0 if c.part is None else c.part % threads for c in phase)


def _split_phases(described: list[tuple], threads: int) -> int:
    """How many phases of a chain's steps run on more than one thread."""
    return sum(len(_threads_of(phase, threads)) > 1 for phases in described for phase in phases)


def _heavy_split(described: list[tuple], threads: int) -> bool:
    """Whether a phase of a chain's steps runs on more than one thread with ``LOCKSTEP_WORK`` multiply-adds."""
    return any(len(_threads_of(phase, threads)) > 1 and sum(c.work for c in phase) >= LOCKSTEP_WORK
               for phases in described for phase in phases)


def _min_part() -> int:
    from .. import threads as cpu_threads

    return cpu_threads.CHAIN_MIN_PART


def _source(opcodes: list[tuple]) -> str:
    """The generated interpreter: ``run(t, program, ints, floats, flags, threads, spins)`` runs the program's rows
    of thread ``t`` (one branch per opcode: its kernel's argument types), waits at the barrier rows, and returns 0,
    1 (a call failed: its row + 1 in ``flags[ERR]``) or -1 (another thread aborted)."""
    lines = [
        "import numpy as np",
        "from numba import njit",
        "from luminal_recipes.runtimes.cpu.jit.chain import FAILED, _call, _view, barrier",
        "from luminal_recipes.runtimes.cpu.jit.spin import atomic_load, atomic_store",
        "",
        "",
        "@njit(nogil=True, cache=True, error_model='numpy')",
        "def run(t, program, ti, tf, flags, threads, spins):",
        "    failed = False",
        "    for r in range(program.shape[0]):",
        "        op = program[r, 0]",
        f"        if op == {BARRIER}:",
        "            if not barrier(flags, threads, spins):",
        "                return -1",
        f"            if atomic_load(flags, {ERR}) != 0:",
        "                return 1",
        "            continue",
        "        if failed or program[r, 1] != t:",
        "            continue",
        "        i = program[r, 2]",
        "        f = program[r, 3]",
        "        rc = 0",
    ]
    for n, (returns, exprs) in enumerate(opcodes):
        args = ", ".join(exprs) + ("," if len(exprs) == 1 else "")
        lines.append(f"        {'if' if n == 0 else 'elif'} op == {n}:")
        lines.append(f"            rc = _call(ti[0, i], '{returns}', ({args}))")
    lines += [
        "        if rc == FAILED or (rc != 0 and program[r, 4] != 0):",
        f"            atomic_store(flags, {ERR}, r + 1)",
        "            if threads == 1:",
        "                return 1",
        "            # on to the next barrier, where every thread stops: a thread that passed the last barrier after",
        "            # this one saw ERR leaves at once, so the abort releases whoever waits at the next one",
        f"            atomic_store(flags, {ABORT}, 1)",
        "            failed = True",
        "    return 0",
    ]
    return "\n".join(lines) + "\n"


@functools.cache
def _own_digest() -> str:
    """A digest of what generated code compiles in (this file, ``spin.py``) and numba's version: the kernels
    themselves are called at their addresses, never compiled in."""
    h = hashlib.sha256(numba.__version__.encode())
    for path in (Path(__file__), Path(__file__).with_name("spin.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _folder() -> Path:
    from luminal_recipes.compiler.cache import cache_dir

    return cache_dir() / "cpu-chains"


_MEMO: dict[str, Any] = {}
_LOCK = threading.Lock()


def _interpreter(opcodes: list[tuple]):
    source = _source(opcodes)
    key = hashlib.sha256((_own_digest() + source).encode()).hexdigest()[:24]
    with _LOCK:
        got = _MEMO.get(key)
        if got is None:
            got = _MEMO[key] = _load(key, source)
        return got


def _load(key: str, source: str):
    """The generated module from its file in the cache folder (written if missing or different), so numba caches
    its code; where the folder cannot be written, compiled from the text (no disk cache)."""
    name = f"luminal_chain_{key}"
    path = None
    try:
        folder = _folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.py"
        if not path.is_file() or path.read_text() != source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
    except OSError:
        path = None
    if path is not None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module.run
    namespace: dict = {"__name__": name}
    exec(compile(source.replace("cache=True", "cache=False"), f"<chain {key}>", "exec"), namespace)
    return namespace["run"]
