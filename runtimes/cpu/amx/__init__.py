"""f32 products on the CPU's AMX tiles (``amx.gemm``: bf16x3, f32 accuracy) for the numpy runtime's MatMul and
attention kernels: whether they may run here, how a product is cut for the cores, and the step that runs it.

They may run when the selected instruction-set path is ``amx`` (``..isa``: the CPU has AMX tiles and bf16, numba
is installed, neither ``LUMINAL_RECIPES_ISA`` nor ``LUMINAL_RECIPES_AMX=0`` asks for less), Linux granted this
process the tile registers (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: a process must ask before
its first tile instruction, which would otherwise kill it with SIGILL; the grant covers every thread), and the
compiled kernels match numpy on a probe product (``ready``). Kernels choose at prepare time (``worth_it``); a
product with an inf or NaN operand is computed by BLAS.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import isa

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def reason_unavailable() -> str | None:
    """None when AMX products can run in this process, else why not (for tests' skip messages and logs)."""
    reason = isa.why_not("amx")  # the CPU's flags, numba, LUMINAL_RECIPES_ISA / _AMX / _JIT
    if reason is not None:
        return reason
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"Linux refused the AMX tile registers (arch_prctl: {os.strerror(ctypes.get_errno())})"
    return None


def available() -> bool:
    return reason_unavailable() is None


MIN_MACS = 1 << 23  # smaller products stay on BLAS (below 128 x 256 x 256 no gain was measured: 0.84-1.03x)
# MatMul's products: rows of A and columns of B at least (``worth_it(..., min_side=MIN_SIDE)``): splitting an
# element of one operand into bf16 parts (~0.5 ns) pays only when the other has this many rows (columns) to
# multiply it with; the VAE's 1x1 convolutions (16 x 32 x 65536, 32 x 64 x 16384) ran 1.6-2.6x slower on AMX
# than on BLAS
MIN_SIDE = 64


def worth_it(m: int, k: int, n: int, min_side: int = 16) -> bool:
    """Whether an f32 product ``[m, k] @ [k, n]`` goes to AMX: at least ``min_side`` rows and columns (a tile's
    16 by default), k at least a tile and ~8M multiply-adds, on a CPU (and process) where AMX runs and its
    kernels compiled (``ready``)."""
    return min(m, n) >= min_side and k >= 16 and m * k * n >= MIN_MACS and ready()


def checked_once(check: Callable[[], bool]) -> Callable[[], bool]:
    """``check()`` run once per process, under a lock: a caller that asks while another thread (usually the jit
    warm-up thread) is compiling and probing the kernels waits for its answer instead of doing it again."""
    lock = threading.Lock()
    cached = functools.cache(check)

    @functools.wraps(check)
    def once() -> bool:
        with lock:
            return cached()

    return once


def _check_kernels() -> bool:
    """AMX is available and its kernels are compiled (or loaded from numba's cache) and give numpy's product
    on a small odd-shaped one: checked once per process, so that a broken toolchain falls back to BLAS."""
    if not available():
        return False
    try:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((40, 70)).astype(np.float32)
        b = rng.standard_normal((70, 50)).astype(np.float32)
        out = np.empty((40, 50), np.float32)
        p = plan(40, 70, 50, 1)
        product(p, a, b, out, [[aligned_empty(s, d) for s, d in p.scratch_shapes]])()
        return bool(np.allclose(out, a @ b, rtol=1e-5, atol=1e-4))
    except Exception:  # noqa: BLE001 - any failure to compile or run means: use BLAS
        return False


ready = checked_once(_check_kernels)  # AMX runs here and its product kernels compiled and probed


# ---- the product, cut into parts for the cores --------------------------------------------------------------
BLOCK = 32
A_BLOCK_BYTES = 3 << 19  # a thread's packed rows of A (3 bf16 parts) at most 1.5 MiB: they stay in its 2 MiB L2


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclass(frozen=True)
class Plan:
    """How ``a [m, k] @ b [k, n]`` is cut: ``parts`` (rows, columns) ranges, one per thread, each with its own
    scratch (``scratch_shapes``), or, with ``chunks`` (columns) or ``row_chunks``, one part per thread taking
    chunks in turn. The operand with more elements is split between the threads; the other is packed whole by
    each part. K is taken ``kc`` at a time so that a part's packed rows of A stay in its core's L2 (the partial
    sums wait in the output)."""

    m: int
    k: int
    n: int
    parts: tuple[tuple[int, int, int, int], ...]
    a_rows: int  # rows of A packed at a time
    kc: int
    chunks: tuple[tuple[int, int], ...] = ()  # columns taken in turn by the parts (see plan), or fixed parts
    row_chunks: tuple[tuple[int, int], ...] = ()  # rows taken in turn, B packed whole by each part (gemm_rows)

    @property
    def scratch_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        b_shape = (3, self.kc // 2, BLOCK, 2)
        if self.row_chunks:  # every panel of B, packed once per part
            b_shape = (_round_up(self.n, BLOCK) // BLOCK, *b_shape)
        a_shape = (self.a_rows // BLOCK, self.kc // BLOCK, 3, BLOCK, BLOCK)  # see amx.gemm.pack_a
        return [(a_shape, np.dtype(np.uint16)), (b_shape, np.dtype(np.uint16)),
                ((BLOCK, BLOCK), np.dtype(np.float32)), ((64,), np.dtype(np.uint8))]


MACS_PER_PART = 1 << 22  # a part of fewer multiply-adds (~20 us) is not worth a thread hand-off
CHUNK_PANELS = 4  # 32-column panels per chunk taken in turn
CHUNK_ROWS = 128  # rows per chunk taken in turn (at most; at least 4 chunks per part where there are rows)
# products described for the CPU chains (``product``); False: the same compiled calls, each product a Python step
# of its own between the chains (``bench/torch_flux2_ab.py --off amxchain``)
CHAINED = True
B_WHOLE_BYTES = 5 << 18  # all of B packed per part (1.25 MiB) beside a chunk of A's rows: both stay in L2


def plan(m: int, k: int, n: int, threads: int) -> Plan:
    """Cut the product for ``threads`` cores. When B has more elements, the parts take chunks of columns in
    turn (``cpu_threads.claimed``: a core the OS gives less time does fewer), each part packing A once, where
    A's packed rows fit in L2 in one piece; when A has more, chunks of rows in turn, each part packing all of B
    once, where that fits in L2 beside a chunk of A; otherwise fixed parts (rows when A has more elements)."""
    threads = max(1, min(threads, m * k * n // MACS_PER_PART))
    kp = _round_up(max(k, 1), BLOCK)
    if threads > 1 and n < m and kp * _round_up(n, BLOCK) * 6 <= B_WHOLE_BYTES:
        blocks = _round_up(m, BLOCK) // BLOCK
        rows = BLOCK * max(1, min(CHUNK_ROWS // BLOCK, blocks // (4 * threads)))
        if rows * kp * 6 <= A_BLOCK_BYTES:
            row_chunks = tuple((r, min(m, r + rows)) for r in range(0, m, rows))
            parts = tuple((0, m, 0, n) for _ in range(min(threads, len(row_chunks))))
            return Plan(m, k, n, parts, rows, kp, row_chunks=row_chunks)
    if n >= m:  # B has more elements: each thread takes whole panels of columns
        cuts = _cuts(_round_up(n, BLOCK) // BLOCK, threads)
        parts = tuple((0, m, min(n, lo * BLOCK), min(n, hi * BLOCK)) for lo, hi in cuts)
    else:
        cuts = _cuts(_round_up(m, BLOCK) // BLOCK, threads)
        parts = tuple((min(m, lo * BLOCK), min(m, hi * BLOCK), 0, n) for lo, hi in cuts)
    a_rows = _round_up(max(r1 - r0 for r0, r1, _, _ in parts), BLOCK)
    kc_most = max(BLOCK, A_BLOCK_BYTES // (6 * a_rows) // BLOCK * BLOCK)
    if kc_most == BLOCK:  # so many rows that even 32 k of them overflow L2: fewer rows at a time
        a_rows = max(BLOCK, A_BLOCK_BYTES // (6 * BLOCK) // BLOCK * BLOCK)
    k_blocks = -(-max(k, 1) // kc_most)
    kc = _round_up(-(-max(k, 1) // k_blocks), BLOCK)
    chunks = ()
    if len(parts) > 1 and n >= m and a_rows >= m and kc >= k:  # A packed once per part, in one piece
        panels = _round_up(n, BLOCK) // BLOCK
        per_chunk = max(1, min(CHUNK_PANELS, panels // (4 * len(parts))))
        chunks = tuple((j * BLOCK, min(n, (j + per_chunk) * BLOCK)) for j in range(0, panels, per_chunk))
    return Plan(m, k, n, parts, a_rows, kc, chunks)


def _cuts(blocks: int, threads: int) -> list[tuple[int, int]]:
    parts = max(1, min(threads, blocks))
    bounds = [blocks * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def aligned_empty(shape, dtype) -> np.ndarray:
    """An array starting on a cache line (numpy aligns to 16 bytes; a tile row split across two lines halves
    the tile loads' speed)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def part_buffers(m: int, k: int, n: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The scratch arrays (shapes, dtypes) of ``multiply`` for products of up to ``m`` rows."""
    return plan(m, k, n, 1).scratch_shapes


def multiply(a: np.ndarray, b: np.ndarray, out: np.ndarray, buffers: list[np.ndarray]) -> None:
    """``out = a @ b`` on this thread (for kernels that run their own parts, e.g. attention's per-head
    products): f32 operands of any strides, ``buffers`` as ``part_buffers`` (for at least as many rows) gave;
    operands with a value that is not finite, or an ``out`` that is not C-contiguous, go to BLAS."""
    if not available():  # also asks Linux for the tiles, before any tile instruction
        raise RuntimeError(f"AMX products unavailable: {reason_unavailable()}")
    from . import gemm as amx_gemm

    m, k = a.shape
    # the compiled kernel takes one output layout (another would compile for seconds): any other goes to BLAS
    on_tiles = out.flags.c_contiguous
    args = (a.ctypes.data, *a.strides, b.ctypes.data, *b.strides, k, out, 0, m, 0, b.shape[1], *buffers, 0)
    if not on_tiles or amx_gemm.gemm(*args):
        np.matmul(a, b, out=out)


def product(p: Plan, a: np.ndarray, b: np.ndarray, out: np.ndarray, scratch: list[list[np.ndarray]]):
    """A step computing ``out = a @ b`` (f32; ``out`` C-contiguous; ``scratch[i]``: part i's arrays, shaped as
    ``p.scratch_shapes``): one compiled call per part, on the cores (``cpu_threads``), described for the CPU
    chains (``jit/chain.py``: then no Python step between the chains around it). Parts with chunks claim them in
    turn inside the call (``gemm.gemm_row_chunks``, ``gemm_col_chunks``: a core the OS gives less time does
    fewer); fixed parts compute their block (``gemm.gemm_part``). A chunk or block whose operands hold a value
    that is not finite is multiplied one f32 multiply and add at a time instead (``gemm.plain_product``: in bf16
    parts inf times a zero part would give NaN)."""
    reason = reason_unavailable()  # also asks Linux for the tiles, before any tile instruction
    if reason:
        raise RuntimeError(f"AMX products unavailable: {reason}")
    if a.dtype != np.float32 or b.dtype != np.float32 or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("AMX products take f32 operands and a C-contiguous f32 output")
    from .. import jit
    from .. import threads as cpu_threads
    from . import gemm as amx_gemm

    operands = (a.ctypes.data, *a.strides, b.ctypes.data, *b.strides, p.k, out)
    counter = None
    if p.chunks or p.row_chunks:  # chunks taken in turn; each part packs all of A (B) on its first
        chunks = np.array(p.row_chunks or p.chunks, np.int64).reshape(-1, 2)
        counter = np.zeros(8, np.int64)  # the next chunk (one cache line)
        if p.row_chunks:
            kernel = amx_gemm.gemm_row_chunks
            calls = [(*operands, chunks, counter, *buffers) for buffers in scratch[:len(p.parts)]]
        else:
            kernel = amx_gemm.gemm_col_chunks
            calls = [(*operands, p.m, chunks, counter, *buffers) for buffers in scratch[:len(p.parts)]]
    else:
        kernel = amx_gemm.gemm_part
        calls = [(*operands, *rows_cols, *buffers) for rows_cols, buffers in zip(p.parts, scratch)]
    parts = [functools.partial(kernel, *args) for args in calls]

    def step():
        if counter is not None:
            counter[0] = 0
        cpu_threads.run_parts(parts)

    step.keep = (a, b)  # what the addresses in ``calls`` point into
    if not (CHAINED and jit.AVAILABLE):
        return step
    from ..jit.chain import Call, tag

    first = [Call(amx_gemm.reset, (counter,))] if counter is not None else []
    work = p.m * p.k * p.n // len(calls)  # (``chain.LOCKSTEP_WORK``: a split product runs its chain in lockstep)
    return tag(step, first, [Call(kernel, args, i, work=work) for i, args in enumerate(calls)])
