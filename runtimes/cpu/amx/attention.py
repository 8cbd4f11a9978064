"""The numpy runtime's Attention kernel with both products on the AMX tiles (bf16x3, f32 accuracy: ``amx.gemm``):
one compiled call per (head, query block) task, releasing the GIL, plus one per head to pack k and v.

``p v`` on AMX needs ``p`` cut into its three bf16 parts; done as a pass of its own over the block of ``p`` it
costs what the faster product saves (bench/README "MatMul and attention on AMX tiles"). Here the softmax pass
that computes ``p`` writes only the parts, in the same loop as the exp (``_exp_split_row``: p is never stored
as f32), straight into the tile-by-tile layout the tile loads read (``amx.gemm.pack_a_tiles``'), so the product
packs nothing of ``p``.

Per head, ``pack_kv`` splits k (as k^T: panels of 32 keys) and v (panels of 32 columns) once into VNNI panels
(``amx.gemm.pack_b``); a part keeps the packed head it last worked on, so the query blocks of a head that one
part takes in turn pack it once (the BLAS path reads k and v in place, but an AMX product must pack them).

Per task, ``task``: ``q * scale`` split into bf16 parts (as the BLAS path scales q), then the keys in blocks
(``key_block``: their panels of k and v stay in the core's 2 MiB L2) with an online softmax (running max and
sum, the accumulator rescaled, as ``AttentionBlocked``); per key block the query rows are taken 32 at a time:
their scores = q k^T on the tiles (32 x key block f32, still in L1 for the softmax pass), per row the max, then
``exp(x - max)``, its sum and p's parts in one pass, then ``acc (* rescale) + p v`` on the tiles; the output
rows are ``acc / sum``. Every tile product is of whole 32 x 32 blocks: the packed operands are zero past their
edges, and the scratch is padded.

Returns 0 when done, 1 when an operand or p holds a value that is not finite (in bf16 parts inf times a zero
part would give NaN: the caller computes that task on BLAS). ``runtimes/cpu/amx/`` says when AMX may run;
``kernels.attention`` decides per kernel at prepare time and keeps the BLAS path for every other case (a bias,
output that is not f32, no AMX, no numba).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .. import amx
from ..jit.disk_cache import install as _install_cache_locator
from ..jit.numba_kernels import EXP_LOW, MAGIC, _maxnum, _wide_vectors, exp_f32
from .gemm import (
    BLOCK,
    PARTS,
    _block_tiles,
    _load_f32,
    _release,
    _split,
    _split_bits,
    _store_u16,
    _top_halves,
    configure,
    ir_loop,
    pack_a_tiles,
    pack_b,
)

_install_cache_locator()  # before the kernels: their cache goes stale with amx.gemm's and numba_kernels's helpers

_FAST = {"contract"}  # as numba_kernels's row kernels: FMA contraction only, IEEE infinities and NaNs
KEY_BLOCK = 768  # keys per block of the online softmax (``key_block``)
ROWS = 256  # query rows per task at most
PANEL_STEP = 16 * BLOCK * 2 * 2  # bytes of a VNNI panel per 32 k: 16 pairs x 32 columns x 2 bf16


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def key_block(t: int) -> int:
    """Keys per block of ``task`` for ``t`` keys (a multiple of 32). Since a key block's scores and p's parts
    are only held for 32 query rows at a time (96 and 144 KiB at 768 keys), only k's and v's panels of the
    block need to stay in L2. Measured on one core in 256-row tasks, task time against 256 keys: 768 x 768 x
    64 0.92x (one block), 512 0.97x; 512 x 4608 x 128 about the same with 256, 512 or 768 (0.97-1.01x), 1.12x
    with 1024 (2 x 1.5 MiB of panels overflow L2)."""
    return min(_round_up(t, BLOCK), KEY_BLOCK)


def head_buffers(t: int, d: int, dv: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The scratch arrays of ``pack_kv`` (a part's packed head): k^T's and v's panels."""
    tp, dp, dvp = _round_up(t, BLOCK), _round_up(d, BLOCK), _round_up(dv, BLOCK)
    u16 = np.dtype(np.uint16)
    return [((tp // BLOCK, 3, dp // 2, BLOCK, 2), u16), ((dvp // BLOCK, 3, tp // 2, BLOCK, 2), u16)]


def task_buffers(rows: int, t: int, d: int, dv: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The scratch arrays of ``task`` after the packed head, for blocks of up to ``rows`` query rows: q * scale,
    its parts (``pack_a_tiles``' layout), one 32-row block's scores and p's parts (the same layout) for a key
    block, the accumulator, the running max, sum and rescale factor, the tile configuration."""
    r, dp, dvp, kb = _round_up(rows, BLOCK), _round_up(d, BLOCK), _round_up(dv, BLOCK), key_block(t)
    u16, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    return [((r, d), f32), ((r // BLOCK, dp // BLOCK, 3, BLOCK, BLOCK), u16), ((BLOCK, kb), f32),
            ((kb // BLOCK, 3, BLOCK, BLOCK), u16), ((r, dvp), f32), ((r,), f32), ((r,), f32), ((r,), f32),
            ((64,), np.dtype(np.uint8))]


@intrinsic
def _store_f32(typingctx, address, value):
    sig = types.none(types.intp, types.float32)

    def codegen(context, builder, signature, args):
        builder.store(args[1], builder.inttoptr(args[0], ir.FloatType().as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


_F32X16 = ir.VectorType(ir.FloatType(), 16)
_I64 = ir.IntType(64)


def _splat(value: float):
    return ir.Constant(_F32X16, [float(value)] * 16)


def _vector_call(builder, name: str, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * len(args)),
                                        f"{name}.v16f32")
    return builder.call(fn, list(args))


def _lanes(builder, x, op):
    """The 16 lanes of ``x`` reduced with ``op`` (a builder method), in a fixed order (halving)."""
    width = 16
    while width > 1:
        width //= 2
        lanes = ir.VectorType(ir.FloatType(), width)
        low = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(width))))
        high = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                        list(range(width, 2 * width))))
        x = op(low, high)
        assert x.type == lanes
    return builder.extract_element(x, ir.Constant(ir.IntType(32), 0))


@intrinsic
def _row_max(typingctx, src, n):
    """The max of ``n`` (a multiple of 64) f32 at ``src``, -inf if none: four running maxima of 16 lanes (one
    running maximum is bound by the max's latency). A NaN makes the result NaN or not; either way p turns NaN
    through exp on its row and the task goes to BLAS."""
    sig = types.float32(types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src, n = args
        start = [_splat(-np.inf)] * 4
        j, acc, close = ir_loop(builder, n, 64, start)
        new = []
        for h in range(4):
            at = builder.add(src, builder.mul(builder.add(j, ir.Constant(_I64, 16 * h)), ir.Constant(_I64, 4)))
            x = builder.load(builder.inttoptr(at, _F32X16.as_pointer()), align=4)
            new.append(builder.select(builder.fcmp_ordered(">", acc[h], x), acc[h], x))
        acc = close(new)

        def vmax(a, b):
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)

        return _lanes(builder, vmax(vmax(acc[0], acc[1]), vmax(acc[2], acc[3])), vmax)

    return sig, codegen


def _exp_vector(builder, x):
    """``numba_kernels.exp_f32`` on a <16 x float>: its range reduction and Cephes polynomial with explicit FMAs, the
    scaling by 2^n in one ``vscalefps`` (zero-masked where x is below ``EXP_LOW``, as exp_f32's select), where
    the integer conversion, shift, add and multiply took four instructions; the same values."""
    fma = functools.partial(_vector_call, builder, "llvm.fma")
    above = builder.fcmp_ordered(">", x, _splat(EXP_LOW))
    xc = builder.select(above, x, _splat(EXP_LOW))
    n = builder.fsub(fma(xc, _splat(1.4426950408889634), _splat(MAGIC)), _splat(MAGIC))
    r = fma(n, _splat(-0.693359375), xc)
    r = fma(n, _splat(2.12194440e-4), r)
    p = _splat(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fma(p, r, _splat(c))
    y = builder.fadd(fma(builder.fmul(p, r), r, r), _splat(1.0))
    i16 = ir.IntType(16)
    scalef = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F32X16, [_F32X16, _F32X16, _F32X16, i16, ir.IntType(32)]),
        "llvm.x86.avx512.mask.scalef.ps.512")
    mask = builder.bitcast(above, i16)
    return builder.call(scalef, [y, n, _splat(0.0), mask, ir.Constant(ir.IntType(32), 4)])  # 4: MXCSR's rounding


@intrinsic
def _exp_split_row(typingctx, src, n, m, dst, step, part):
    """p = exp(x - ``m``) for ``n`` (a multiple of 32) f32 at ``src``, written only as p's three bf16 parts in
    ``pack_a_tiles``' layout (32 keys of a row per tile row at ``dst``, k steps ``step`` bytes apart, parts
    ``part`` apart: one byte permutation and one 64-byte store per part); returns the sum of p (two running
    sums of 16 lanes, a fixed order). One pass: p is never stored as f32. A p that is not finite makes the sum
    not finite."""
    sig = types.float32(types.intp, types.intp, types.float32, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src, n, m, dst, step, part = args
        shift = builder.insert_element(ir.Constant(_F32X16, ir.Undefined), m, ir.Constant(ir.IntType(32), 0))
        shift = builder.shuffle_vector(shift, shift, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        j, acc, close = ir_loop(builder, n, BLOCK, [_splat(0.0)] * 2)
        halves, new = [], []
        for h in range(2):
            at = builder.add(src, builder.mul(builder.add(j, ir.Constant(_I64, 16 * h)), ir.Constant(_I64, 4)))
            x = builder.load(builder.inttoptr(at, _F32X16.as_pointer()), align=4)
            p = _exp_vector(builder, builder.fsub(x, shift))
            new.append(builder.fadd(acc[h], p))
            halves.append(_split_bits(builder, p)[0])
        out = builder.add(dst, builder.mul(builder.udiv(j, ir.Constant(_I64, BLOCK)), step))
        for q in range(PARTS):
            row = _top_halves(builder, halves[0][q], halves[1][q], list(range(32)))
            at = builder.add(out, builder.mul(part, ir.Constant(_I64, q)))
            builder.store(row, builder.inttoptr(at, row.type.as_pointer()), align=2)
        acc = close(new)
        return _lanes(builder, builder.fadd(acc[0], acc[1]), builder.fadd)

    return sig, codegen


def _scaled_16(divide: bool):
    def typer(typingctx, src, dst, f):
        sig = types.none(types.intp, types.intp, types.float32)

        def codegen(context, builder, signature, args):
            src, dst, f = args
            x = builder.load(builder.inttoptr(src, _F32X16.as_pointer()), align=4)
            fs = builder.insert_element(ir.Constant(_F32X16, ir.Undefined), f, ir.Constant(ir.IntType(32), 0))
            fs = builder.shuffle_vector(fs, fs, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
            y = builder.fdiv(x, fs) if divide else builder.fmul(x, fs)
            builder.store(y, builder.inttoptr(dst, _F32X16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


# 16 contiguous f32 at ``src`` times / divided by ``f``, stored to 16 contiguous f32 at ``dst`` (the strided
# element loops they replace in ``task`` ran scalar: inttoptr addresses keep LLVM from vectorising them)
_mul_16 = _scaled_16(False)
_div_16 = _scaled_16(True)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def pack_kv(k, k_rs, k_cs, v, v_rs, v_cs, t, d, dv, kp, vp):
    """k [T, D] (as k^T: panel j = keys 32j..) into ``kp`` and v [T, Dv] (panel j = columns 32j..) into ``vp``,
    f32 at addresses ``k`` and ``v`` (strides in bytes); zero past the edges. 1 if one holds a value that is not
    finite."""
    bad = 0
    for j in range(kp.shape[0]):
        bad |= pack_b(k, k_cs, k_rs, 0, d, j * BLOCK, min(t, j * BLOCK + BLOCK), kp[j])
    for j in range(vp.shape[0]):
        bad |= pack_b(v, v_rs, v_cs, 0, t, j * BLOCK, min(dv, j * BLOCK + BLOCK), vp[j])
    return bad


@numba.njit(fastmath=_FAST, cache=True, nogil=True, error_model="numpy")
def _softmax_parts(scores, rows, i0, n, running, sums, rescale, first, p_buf):
    """One key block (``n`` keys) of an online softmax over rows ``0:rows`` of ``scores`` (rows ``i0 + i`` of
    the running state), as ``numba_kernels.exp_rows_online``: ``new = max(running, max(row))`` (not below f32's
    lowest), the rescale factor ``exp(running - new)``, ``sums = sums * rescale + sum(p)``, with ``p = exp(x -
    new)`` written only as its three bf16 parts to ``p_buf`` [KB / 32, 3, 32, 32] (``pack_a_tiles``' layout;
    zero from ``n`` to the next multiple of 32), in the same pass as the exp. 1 if p holds a value that is not
    finite."""
    _wide_vectors()
    low = np.float32(np.finfo(np.float32).min)
    n64, n32 = n - n % 64, n - n % BLOCK
    step, part = p_buf.strides[0], p_buf.strides[1]
    bad = 0
    for i in range(rows):
        row = scores[i]
        src = row.ctypes.data
        m = _row_max(src, n64)
        for j in range(n64, n):
            m = _maxnum(m, row[j])
        m = max(m, low)
        r = i0 + i
        if not first:
            m = max(m, running[r])
            rescale[r] = exp_f32(running[r] - m)
        running[r] = m
        dst = p_buf.ctypes.data + i * (2 * BLOCK)
        total = _exp_split_row(src, n32, m, dst, step, part)
        for j in range(n32, (n + BLOCK - 1) // BLOCK * BLOCK):
            x = exp_f32(row[j] - m) if j < n else np.float32(0)
            total += x
            h, mid, lo, _ = _split(x)
            at = dst + (j // BLOCK) * step + (j % BLOCK) * 2
            _store_u16(at, h)
            _store_u16(at + part, mid)
            _store_u16(at + 2 * part, lo)
        sums[r] = total if first else sums[r] * rescale[r] + total
        if not np.isfinite(total):
            bad = 1
    return bad


@numba.njit(fastmath=_FAST, cache=True, nogil=True, error_model="numpy")
def task(q, q_rs, q_cs, rows, scale, t, out, o_rs, o_cs, dv, kp, vp, qs, q_buf, scores, p_buf, acc, running, sums,
         rescale, config):
    """``out = softmax((q * scale) k^T) v`` for ``rows`` query rows: ``q`` [rows, D] and ``out`` [rows, Dv] f32
    at addresses ``q`` and ``out`` (strides in bytes), k and v (``t`` keys) packed by ``pack_kv`` into ``kp``
    and ``vp``; the rest as ``task_buffers`` gave. 0, or 1 as the module says (``out`` then unfinished).
    Per key block, the query rows are taken 32 at a time through both products and the softmax pass, so that
    a row block's scores (32 x KB f32) are still in L1 when the softmax pass reads them, and p's parts when
    p v reads them; the key block's panels of k and v stay in L2 for all the row blocks."""
    _wide_vectors()
    d = qs.shape[1]
    d16 = d - d % 16 if q_cs == 4 else 0
    for i in range(rows):
        src = q + i * q_rs
        for j in range(0, d16, 16):
            _mul_16(src + j * 4, qs.ctypes.data + i * qs.strides[0] + j * 4, scale)
        for j in range(d16, d):
            qs[i, j] = _load_f32(src + j * q_cs) * scale
    if pack_a_tiles(qs.ctypes.data, qs.strides[0], qs.strides[1], 0, rows, 0, d, q_buf):
        return 1
    configure(config)
    kb = scores.shape[1]
    q_step, q_part, d_steps = q_buf.strides[1], q_buf.strides[2], q_buf.shape[1]
    p_step, p_part = p_buf.strides[0], p_buf.strides[1]
    s_row, acc_row = scores.strides[0], acc.strides[0]
    bad = 0
    for t0 in range(0, t, kb):
        n = min(kb, t - t0)
        panels = (n + BLOCK - 1) // BLOCK
        first = t0 == 0
        for ib in range(0, rows, BLOCK):
            nr = min(BLOCK, rows - ib)
            q_block = q_buf.ctypes.data + (ib // BLOCK) * q_buf.strides[0]
            for jp in range(panels):  # scores = (q * scale) k^T, 32 x 32 blocks
                panel = kp.ctypes.data + (t0 // BLOCK + jp) * kp.strides[0]
                _block_tiles(q_block, q_step, q_part, panel, kp.strides[1], d_steps,
                             scores.ctypes.data + jp * BLOCK * 4, s_row, 0)
            bad |= _softmax_parts(scores, nr, ib, n, running, sums, rescale, first, p_buf)
            if not first:
                for i in range(ib, ib + nr):
                    f = rescale[i]
                    for j in range(acc.shape[1]):
                        acc[i, j] *= f
            for jj in range(vp.shape[0]):  # acc (+)= p v
                panel = vp.ctypes.data + jj * vp.strides[0] + (t0 // BLOCK) * PANEL_STEP
                _block_tiles(p_buf.ctypes.data, p_step, p_part, panel, vp.strides[1], panels,
                             acc.ctypes.data + ib * acc_row + jj * BLOCK * 4, acc_row, 0 if first else 1)
    _release()
    if bad:
        return 1
    dv16 = dv - dv % 16 if o_cs == 4 else 0
    for i in range(rows):
        s = sums[i]
        row = acc[i]
        dst = out + i * o_rs
        for j in range(0, dv16, 16):
            _div_16(row.ctypes.data + j * 4, dst + j * 4, s)
        for j in range(dv16, dv):
            _store_f32(dst + j * o_cs, row[j] / s)
    return 0



def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, out: np.ndarray, rows: int = ROWS) -> int:
    """``out = softmax(q k^T * scale) v`` for one head (f32 arrays of any strides), in blocks of ``rows``
    query rows, on this thread: for tests and the probe. 0, or 1 as ``task``. The scratch starts on cache
    lines, as the runtime's arena places it (numpy's 16-byte alignment splits tile rows across two lines: a
    768 x 768 x 64 head took 1.2 instead of 0.86 ms on one core with main's kernel)."""
    (s, d), (t, dv) = q.shape, v.shape
    kp, vp = (amx.aligned_empty(shape, dtype) for shape, dtype in head_buffers(t, d, dv))
    scratch = [amx.aligned_empty(shape, dtype) for shape, dtype in task_buffers(rows, t, d, dv)]
    if pack_kv(k.ctypes.data, *k.strides, v.ctypes.data, *v.strides, t, d, dv, kp, vp):
        return 1
    for r0 in range(0, s, rows):
        r = min(rows, s - r0)
        qr, dst = q[r0:r0 + r], out[r0:r0 + r]
        if task(qr.ctypes.data, *qr.strides, r, np.float32(scale), t, dst.ctypes.data, *dst.strides, dv, kp, vp,
                *scratch):
            return 1
    return 0


def _check_kernels() -> bool:
    """AMX products run here (``amx.ready``) and these kernels compile (or load from numba's cache) and give the
    float64 reference on a small odd-shaped head, in one key block and in several: checked once per process
    (``ready``), so that a broken toolchain falls back to the BLAS path."""
    if not amx.ready():
        return False
    try:
        rng = np.random.default_rng(0)
        for s, t, d, dv in ((40, 70, 33, 20), (20, KEY_BLOCK + 40, 16, 40)):
            q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((s, d), (t, d), (t, dv)))
            out = np.empty((s, dv), np.float32)
            x = (q.astype(np.float64) @ k.T.astype(np.float64)) * 0.3
            p = np.exp(x - x.max(axis=1, keepdims=True))
            want = (p @ v.astype(np.float64)) / p.sum(axis=1, keepdims=True)
            if run(q, k, v, 0.3, out, rows=32) or not np.allclose(out, want, rtol=1e-5, atol=1e-5):
                return False
        return True
    except Exception:  # noqa: BLE001 - any failure to compile or run means: use BLAS
        return False


ready = amx.checked_once(_check_kernels)
