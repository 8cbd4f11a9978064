"""Attention for heads of 16 dims, compiled (numba and LLVM IR): ``softmax((q * scale) k^T) v`` four query rows
at a time, the scores of a row never leaving the L1 cache.

With 16 dims per head (FLUX.2's tiny configurations, small encoders) BLAS runs both products poorly: ``q k^T`` has
an inner dimension of 16, so each score costs a load and a store of the output for 16 multiply-adds, and ``p v``
packs the whole ``(rows, T)`` score block before a product 16 columns wide (measured ~64 GFLOP/s, about what
PyTorch's CPU flash kernel reaches). Here a head's keys are transposed once into ``kt [16, T]`` and its values
copied into rows ``vr [T, 16]`` (70 KiB each at 1088 tokens: L2-resident), and then, per group of four query rows,
three passes over the group's ``sc [4, T]``:

- ``scores_max16x4``: the four rows' scores and their maxima, 64 keys per step on AVX-512 (a 4 x 4 tile of
  accumulators: 16 independent chains of fused multiply-adds), each key vector loaded once for the four rows;
- ``exp_rows_sum4``: per row, the exponentials in place (one vectorised pass, ``exp_shift``) and their sum;
- ``weighted16x4``: the four rows' 16 weighted sums, one 64-byte load per value row shared by the four rows, each
  row's exponential broadcast from memory into a fused multiply-add (a load, not a shuffle: on Intel's cores
  512-bit shuffles take the second FMA port); the output rows are the sums times the totals' inverses.

The weighted sums were one pass over ``vt [16, T]`` per row before (each exponential computed inside it, 16
loads of ``vt`` per 16 keys, every one a line from L2, and a maximum pass of its own). On the 2-core Intel Xeon
(AVX-512, AMX) at 4 heads x 1088 tokens, 1 thread, alternated in one process with scratch on cache lines:
4.41-4.45 ms a call against 5.8-6.1 before and PyTorch's flash kernel 4.41-4.52 (load 0.4-0.6); the passes alone,
one call's worth: scores and maxima ~1.85 ms, exponentials ~1.2, weighted sums ~1.15. On the Zen 4 the old kernel
was 5.79 ms vs PyTorch's 5.90 (not measured since: the new passes do the same multiply-adds and exponentials with
fewer loads; the AVX2 path, measured here, 6.64 vs 8.45 ms).

Since (2026-12-05) the scores are tiles of 4 rows x 64 keys (one chain per row, 16 keys at a time, was bound by
the FMA's latency: ~1 cycle a score), the exponential is a shift-rounded reduction with a degree-5 polynomial (13
vector operations a lane with the subtraction and the sum, against Cephes' ~19) and a group's four rows of
exponentials are one call: the passes alone, one call's worth, scores and maxima ~0.94 ms, exponentials ~0.71,
weighted sums ~1.08, the first and last about at the two FMA ports' throughput; the call ~3.06 ms against
PyTorch's flash kernel 4.50 (0.68x) and 4.41 before (load 3.8).

Results are those of softmax attention in f32 up to the order of the sums (fixed by the compiled code: the same
on every call, whatever the thread count or the task boundaries, since every row is computed on its own).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .. import isa
from .disk_cache import install as _install_cache_locator
from .numba_kernels import EXP_LOW, _f32_from_bits, _fma, _wide_vectors

_install_cache_locator()  # before the kernels: their cache goes stale with numba_kernels's helpers

F = np.float32
I8, I32, I64, FLT = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
V16 = ir.VectorType(FLT, 16)  # one value row
HEAD_DIM = 16
GROUP = 4  # query rows whose scores one pass over the keys computes
CHAINS = 2  # keys per step of the weighted pass (4 x 2 accumulators; 4 x 4 measured 1.00-1.02x)
_FLAGS = dict(cache=True, nogil=True, error_model="numpy")
_rows = numba.njit(fastmath={"contract"}, **_FLAGS)
# sums that LLVM may reorder, so that it vectorises them: a function of its own (flags are per function; the
# exponential inside is written in fused multiply-add intrinsics, which reassociation does not touch)
_sum = numba.njit(fastmath={"contract", "reassoc"}, **_FLAGS)
_inline = numba.njit(fastmath={"contract"}, inline="always", **_FLAGS)


@intrinsic
def _bits_from_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], I32)

    return types.int32(types.float32), codegen


# e^x = 2^n e^r, n = round(x log2 e), |r| <= ln(2)/2: adding the shift rounds x log2 e to an integer in z's low
# mantissa bits (the 127 there makes z's bits, shifted, 2^n's); e^r = 1 + r + r^2 (c2 + c3 r + c4 r^2 + c5 r^3), a
# minimax fit of e^r's relative error (7e-8 in float64; c1 came out 1 in f32). 11 vector operations a lane (13 with
# the subtraction and the sum) against Cephes' ~17 (its clamp, floor, conversion and longer polynomial): the
# pass is bound by them.
EXP_SHIFT = F(12582912.0 + 127.0)
EXP_C2, EXP_C3, EXP_C4, EXP_C5 = F(0.49999040365219116), F(0.16666938364505768), F(0.041908301413059235), F(
    0.008325801230967045)


@_inline
def exp_shift(x):
    """e^x for a score minus its row's maximum (x <= 0; e^0 = 1 exactly), relative error below 4e-7 (2e-7 for
    |x| < 1: the reduction's single f32 ln 2 costs n ulps of ln 2); 0 below -87.34, where f32's normal range ends,
    and for NaN. Fused multiply-add intrinsics, so that reassociation (the caller's flags) cannot change it."""
    z = _fma(x, F(1.4426950408889634), EXP_SHIFT)
    n = z - EXP_SHIFT
    r = _fma(n, F(-0.6931471805599453), x)
    p = _fma(_fma(_fma(EXP_C5, r, EXP_C4), r, EXP_C3), r, EXP_C2)
    y = _fma(p, r * r, r)
    scale = _f32_from_bits(_bits_from_f32(z) << np.int32(23))
    e = _fma(y, scale, scale)
    return e if x > EXP_LOW else F(0.0)


@_inline
def _exp_sum(p, m, t):
    total = F(0.0)
    for j in range(t):
        e = exp_shift(p[j] - m)
        p[j] = e
        total += e
    return total


@_sum
def exp_row_sum(p, m, t):
    """``p[j] = e^(p[j] - m)`` in place for ``j < t`` (one vectorised pass); returns their sum (reassociated: the
    order of the additions is the compiled code's, the same on every call)."""
    _wide_vectors()
    return _exp_sum(p, m, t)


@_sum
def exp_rows_sum4(sc, m0, m1, m2, m3, t):
    """``exp_row_sum`` of the 4 rows of ``sc`` against their maxima, in one compiled call: four calls a group cost
    ~7% of the kernel (measured 0.93x its time with one), each with its own set-up and tail."""
    _wide_vectors()
    return _exp_sum(sc[0], m0, t), _exp_sum(sc[1], m1, t), _exp_sum(sc[2], m2, t), _exp_sum(sc[3], m3, t)


def _splat(builder, value, n):
    vec = builder.insert_element(ir.Constant(ir.VectorType(value.type, n), ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(ir.VectorType(value.type, n), ir.Undefined),
                                  ir.Constant(ir.VectorType(I32, n), [0] * n))


def _base(context, builder, ty, value):
    """An array argument's data as ``i8*`` and its strides in bytes (i64)."""
    a = context.make_array(ty)(context, builder, value)
    return builder.bitcast(a.data, I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides, ty.ndim)


def _i64(builder, value):
    return value if value.type.width == 64 else builder.sext(value, I64)


def _declare(builder, name, ret, *args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)


def _score_tile() -> int:
    """Blocks of 16 keys per step of the scores pass: 4 (4 x 4 accumulators) where AVX-512's 32 registers hold
    them; 1 below (AVX2's 16 registers: 4 x 4 16-lane accumulators would be 32 of them, spilled: 1.27-1.33x
    the time)."""
    return 4 if isa.at_least("avx512") else 1


@intrinsic
def scores_max16x4(typingctx, qs, kt, sc, t):
    """``sc[r, :t] = qs[r] kt[:, :t]`` for the 4 rows of ``qs [4, 16]`` against ``kt [16, T]`` (the keys transposed,
    each row's stride 1), and the 4 rows' maxima (returned): LLVM IR over blocks of 16 keys, each of the 16 key vectors
    loaded once for the four rows, the maxima kept as vectors beside the scores (no pass of their own). A ``t`` not a
    multiple of 16 ends with the last 16 keys (overlapping the block before: those scores computed twice, the same; no
    masked loads), fewer than 16 keys go one at a time. Each score is the sum over d = 0..15 in that order (fused
    multiply-adds), whichever path computes it; the maxima ignore NaN scores as ``llvm.maxnum`` does (a NaN score still
    makes its row NaN through the exponential)."""
    def codegen(context, builder, sig, args):
        qp, qstr = _base(context, builder, sig.args[0], args[0])
        kp, kstr = _base(context, builder, sig.args[1], args[1])
        sp, sstr = _base(context, builder, sig.args[2], args[2])
        t_ = _i64(builder, args[3])
        fma = _declare(builder, "llvm.fma.v16f32", V16, V16, V16, V16)
        maxnum = _declare(builder, "llvm.maxnum.v16f32", V16, V16, V16)
        fma1 = _declare(builder, "llvm.fma.f32", FLT, FLT, FLT, FLT)
        maxnum1 = _declare(builder, "llvm.maxnum.f32", FLT, FLT, FLT)
        reduce_max = _declare(builder, "llvm.vector.reduce.fmax.v16f32", FLT, V16)
        qat = [[builder.bitcast(builder.gep(qp, [builder.add(builder.mul(qstr[0], ir.Constant(I64, r)), builder.mul(
            qstr[1], ir.Constant(I64, d)))]), FLT.as_pointer()) for d in range(HEAD_DIM)] for r in range(GROUP)]
        maxima = [cgutils.alloca_once_value(builder, ir.Constant(V16, [float("-inf")] * 16)) for _ in range(GROUP)]
        low = [cgutils.alloca_once_value(builder, ir.Constant(FLT, float("-inf"))) for _ in range(GROUP)]
        krow = [builder.gep(kp, [builder.mul(kstr[0], ir.Constant(I64, d))]) for d in range(HEAD_DIM)]
        srow = [builder.gep(sp, [builder.mul(sstr[0], ir.Constant(I64, r))]) for r in range(GROUP)]

        def keys(j, vectors):
            """Keys j.. of ``vectors`` blocks of 16 (0: the one key j, scalars): the 4 rows' scores as a tile of
            4 x ``vectors`` accumulators summed over d, so that 16 independent chains of fused multiply-adds hide
            their latency (one chain per row, 16 keys at a time, was latency-bound: ~1 cycle a score)."""
            at = builder.mul(j, ir.Constant(I64, 4))  # bytes
            ty, f, m, acc = (V16, fma, maxnum, maxima) if vectors else (FLT, fma1, maxnum1, low)
            n_ = max(vectors, 1)
            tile = [[None] * n_ for _ in range(GROUP)]
            for d in range(HEAD_DIM):
                ks = [builder.load(builder.bitcast(builder.gep(krow[d], [builder.add(at, ir.Constant(I64, 64 * n))]),
                                                   ty.as_pointer()), align=4) for n in range(n_)]
                for r in range(GROUP):
                    # the query values reloaded each step as 4-byte broadcasts: spilled as vectors (64-byte
                    # reloads) the pass ran slower
                    x = builder.load(qat[r][d])
                    if vectors:
                        x = _splat(builder, x, 16)
                    for n in range(n_):  # the sum over d = 0..15 in that order, on every path
                        tile[r][n] = (builder.fmul(x, ks[n]) if d == 0 else
                                      builder.call(f, [x, ks[n], tile[r][n]]))
            for r in range(GROUP):
                for n in range(n_):
                    out = builder.gep(srow[r], [builder.add(at, ir.Constant(I64, 64 * n))])
                    builder.store(tile[r][n], builder.bitcast(out, ty.as_pointer()), align=4)
                    builder.store(builder.call(m, [builder.load(acc[r]), tile[r][n]]), acc[r])

        tile = _score_tile()
        sixteen, wide = ir.Constant(I64, 16), ir.Constant(I64, 16 * tile)
        tiles = builder.sdiv(t_, wide)
        with cgutils.for_range(builder, tiles) as loop:
            keys(builder.mul(loop.index, wide), tile)
        done = builder.mul(tiles, wide)
        with cgutils.for_range(builder, builder.sdiv(builder.sub(t_, done), sixteen)) as loop:
            keys(builder.add(done, builder.mul(loop.index, sixteen)), 1)
        with builder.if_else(builder.icmp_signed(">=", t_, sixteen)) as (whole, short):
            with whole, builder.if_then(builder.icmp_signed("!=", builder.srem(t_, sixteen), ir.Constant(I64, 0))):
                keys(builder.sub(t_, sixteen), 1)  # the last 16 keys, overlapping the block before: computed again
            with short, cgutils.for_range(builder, t_) as loop:  # fewer than 16 keys: one at a time
                keys(loop.index, 0)
        return context.make_tuple(builder, sig.return_type, [
            builder.call(maxnum1, [builder.call(reduce_max, [builder.load(m)]), builder.load(lo)])
            for m, lo in zip(maxima, low)])

    return types.UniTuple(types.float32, GROUP)(qs, kt, sc, t), codegen


@intrinsic
def weighted16x4(typingctx, e, vr, t, sums):
    """``sums[r, :16] = sum_j e[r, j] vr[j, :16]`` over ``j < t`` for the 4 rows of ``e``, ``vr [T, 16]`` the values as
    rows (each contiguous: one 64-byte vector; ``sums``'s rows too): LLVM IR, one 16-lane vector per value row, loaded
    once for the four rows, times each row's weight broadcast, into 8 accumulators (4 rows x ``CHAINS`` keys:
    independent chains of fused multiply-adds, so that the FMA's latency does not bound the loop), added at the end.
    The strides are constants (4 and 64 bytes: ``e``'s and ``vr``'s rows contiguous): with the arrays' own, LLVM
    ran out of integer registers for the addresses and reloaded them in the loop (0.97-0.99x the kernel's time).
    The order of the additions is fixed by this code (the same on every call, on any CPU: 16 lanes are one AVX-512
    register, two AVX2 ones)."""
    def codegen(context, builder, sig, args):
        ep, es = _base(context, builder, sig.args[0], args[0])
        vp, _ = _base(context, builder, sig.args[1], args[1])
        sp, ss = _base(context, builder, sig.args[3], args[3])
        t_ = _i64(builder, args[2])
        fma = _declare(builder, "llvm.fma.v16f32", V16, V16, V16, V16)
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(V16, [0.0] * 16)) for _ in range(GROUP)]
               for _ in range(CHAINS)]
        rows = [builder.gep(ep, [builder.mul(es[0], ir.Constant(I64, r))]) for r in range(GROUP)]

        def key(j, chain):
            row = builder.gep(vp, [builder.mul(j, ir.Constant(I64, 64))])
            v = builder.load(builder.bitcast(row, V16.as_pointer()), align=4)
            for r in range(GROUP):
                at = builder.gep(rows[r], [builder.mul(j, ir.Constant(I64, 4))])
                w = _splat(builder, builder.load(builder.bitcast(at, FLT.as_pointer())), 16)
                builder.store(builder.call(fma, [w, v, builder.load(acc[chain][r])]), acc[chain][r])

        chains = ir.Constant(I64, CHAINS)
        steps = builder.sdiv(t_, chains)
        with cgutils.for_range(builder, steps) as loop:
            j = builder.mul(loop.index, chains)
            for c in range(CHAINS):
                key(builder.add(j, ir.Constant(I64, c)), c)
        with cgutils.for_range(builder, t_, start=builder.mul(steps, chains)) as loop:  # the last t % CHAINS keys
            key(loop.index, 0)
        for r in range(GROUP):
            parts = [builder.load(acc[c][r]) for c in range(CHAINS)]
            while len(parts) > 1:  # pairwise: ((0 + 1) + (2 + 3))
                parts = [builder.fadd(a, b) for a, b in zip(parts[::2], parts[1::2])]
            total = parts[0]
            at = builder.gep(sp, [builder.mul(ss[0], ir.Constant(I64, r))])
            builder.store(total, builder.bitcast(at, V16.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(e, vr, t, sums), codegen


@_rows
def attention16(q, k, v, out, head, first, end, pack, scale, kt, vr, sc, qs):
    """Rows ``first:end`` of head ``head``: ``out[head, i] = softmax((q[head, i] * scale) k[head]^T) v[head]`` for
    ``q [H, S, 16]``, ``k``, ``v [H, T, 16]``, ``out [H, S, 16]`` (any strides). ``kt [16, T]`` holds the head's
    keys transposed, ``vr [T, 16]`` its values as contiguous rows: written first when ``pack`` (a caller that ran
    the same head last, on the same scratch, passes False); ``sc [4, T]`` and ``qs [4, 16]`` are scratch (C order:
    the compiled passes take their rows as contiguous; on cache lines, as the runtime's scratch is, the 64-byte
    loads of ``kt`` and ``vr`` do not split)."""
    t = k.shape[1]
    if pack:
        for j in range(t):
            for d in range(HEAD_DIM):
                kt[d, j] = k[head, j, d]
                vr[j, d] = v[head, j, d]
    for r in range(first, end, GROUP):
        rows = min(GROUP, end - r)
        for i in range(GROUP):
            for d in range(HEAD_DIM):
                qs[i, d] = q[head, r + i, d] * scale if i < rows else F(0.0)
        m0, m1, m2, m3 = scores_max16x4(qs, kt, sc, t)
        t0, t1, t2, t3 = exp_rows_sum4(sc, m0, m1, m2, m3, t)
        weighted16x4(sc, vr, t, qs)  # the group's queries are no longer needed: qs takes its weighted sums
        for i in range(rows):
            inv = F(1.0) / (t0 if i == 0 else t1 if i == 1 else t2 if i == 2 else t3)
            for d in range(HEAD_DIM):
                out[head, r + i, d] = qs[i, d] * inv
