"""GGUF products with x rounded to 16-bit integers and integer dot products, in the manner of llama.cpp
(``ggml_vec_dot_q4_1_q8_1`` and kin, which round x to 8 bits): each block of 32 elements of x becomes ``d * q`` with
``q`` int16 (``d = max|x| / 32767``, ``q = round(x / d)``), and the products of a weight block's integer codes with
``q`` are summed in int32 (exact), then scaled once per (sub-)block. The integer dot products are written as LLVM
vector IR (load, widen, multiply, ``vector.reduce.add``), which LLVM lowers to the target's integer instructions
(``vpmaddwd``/``vpdpwssd`` on x86): 1.5-2.5x the f32 decoding of ``gguf_kernels.matmul_q4`` and kin here. 16 bits
rather than llama.cpp's 8: nearly the same speed here (x is a few KiB in L1; the weight's bytes dominate), 250x
smaller error (8 bits flipped greedy ids of a random-weight test model against the dense run).

Numerics (tests/TOLERANCES.md, family ``xint16``): the result is the product of the exactly dequantized weight with
x rounded to 16 bits per block of 32 (each element moved by at most ``max|x_block| / 65534``), up to f32 rounding of
the per-block scales; the offset / minimum terms (Q4_0's ``-8``, the ``m`` of Q4_1 and Q4_K) multiply the sum of the
rounded x, as llama.cpp's q8_1 blocks do.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

F = np.float32
I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
QMAX = 32767.0  # x codes are int16
KINDS = (0, 1, 4, 7, 9)  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K

_fast = numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True, error_model="numpy")


def _v(t, n):
    return ir.VectorType(t, n)


def _splat(builder, value, n):
    """<n x i8> of the integer ``value`` (truncated to 8 bits)."""
    v = builder.trunc(value, I8) if value.type.width > 8 else value
    vec = builder.insert_element(ir.Constant(_v(I8, n), ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_v(I8, n), ir.Undefined), ir.Constant(_v(I32, n), [0] * n))


def _load(context, builder, arr_type, arr, offset, n, t=I8):
    a = context.make_array(arr_type)(context, builder, arr)
    p = builder.gep(a.data, [offset])
    return builder.load(builder.bitcast(p, _v(t, n).as_pointer()), align=1)


def _loadx(context, builder, arr_type, arr, offset, n):
    return _load(context, builder, arr_type, arr, offset, n, I16)


def _sum(builder, prod):
    n = prod.type.count
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [prod.type]),
                                        f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [prod])


def _dot(builder, q, xv, q_signed):
    n = q.type.count
    wq = builder.sext(q, _v(I32, n)) if q_signed else builder.zext(q, _v(I32, n))
    return _sum(builder, builder.mul(wq, builder.sext(xv, _v(I32, n))))


@intrinsic
def dot_nibbles(typingctx, w, wo, xq, xo):
    """sum_j lo(w[wo + j]) xq[xo + j] + hi(w[wo + j]) xq[xo + 16 + j] over j < 16 (Q4_0 / Q4_1 codes 0..15)."""
    def codegen(context, builder, sig, args):
        wv = _load(context, builder, sig.args[0], args[0], args[1], 16)
        lo = builder.and_(wv, ir.Constant(_v(I8, 16), [15] * 16))
        hi = builder.lshr(wv, ir.Constant(_v(I8, 16), [4] * 16))
        q = builder.shuffle_vector(lo, hi, ir.Constant(_v(I32, 32), list(range(32))))
        return _dot(builder, q, _loadx(context, builder, sig.args[2], args[2], args[3], 32), False)
    return types.int32(w, wo, xq, xo), codegen


@intrinsic
def dot_int8(typingctx, w, wo, xq, xo):
    """sum_j int8(w[wo + j]) xq[xo + j] over j < 32 (Q8_0)."""
    def codegen(context, builder, sig, args):
        wv = _load(context, builder, sig.args[0], args[0], args[1], 32)
        return _dot(builder, wv, _loadx(context, builder, sig.args[2], args[2], args[3], 32), True)
    return types.int32(w, wo, xq, xo), codegen


@intrinsic
def dot_nibble32(typingctx, w, wo, shift, xq, xo):
    """sum_j ((w[wo + j] >> shift) & 15) xq[xo + j] over j < 32 (Q4_K: low nibbles, then high ones)."""
    def codegen(context, builder, sig, args):
        wv = _load(context, builder, sig.args[0], args[0], args[1], 32)
        q = builder.and_(builder.lshr(wv, _splat(builder, args[2], 32)), ir.Constant(_v(I8, 32), [15] * 32))
        return _dot(builder, q, _loadx(context, builder, sig.args[3], args[3], args[4], 32), False)
    return types.int32(w, wo, shift, xq, xo), codegen


@intrinsic
def dot_six16(typingctx, w, lo, ls, hi, hs, xq, xo):
    """sum_j (((w[lo + j] >> ls) & 15 | ((w[hi + j] >> hs) & 3) << 4) - 32) xq[xo + j] over j < 16 (Q6_K)."""
    def codegen(context, builder, sig, args):
        lv = _load(context, builder, sig.args[0], args[0], args[1], 16)
        hv = _load(context, builder, sig.args[0], args[0], args[3], 16)
        low = builder.and_(builder.lshr(lv, _splat(builder, args[2], 16)), ir.Constant(_v(I8, 16), [15] * 16))
        high = builder.and_(builder.lshr(hv, _splat(builder, args[4], 16)), ir.Constant(_v(I8, 16), [3] * 16))
        q = builder.sub(builder.or_(low, builder.shl(high, ir.Constant(_v(I8, 16), [4] * 16))),
                        ir.Constant(_v(I8, 16), [32] * 16))
        return _dot(builder, q, _loadx(context, builder, sig.args[5], args[5], args[6], 16), True)
    return types.int32(w, lo, ls, hi, hs, xq, xo), codegen


@_fast
def quantize(x, xq, xd, xs):
    """x (f32 [m, k], k a multiple of 32) -> xq int16 codes, xd f32 [m, k / 32] steps, xs = xd * sum(xq) per block."""
    for m in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = F(0.0)
            for j in range(32):
                v = x[m, b * 32 + j]
                amax = max(amax, abs(v))
            d = amax / F(QMAX)
            inv = F(1.0) / d if d > F(0.0) else F(0.0)
            t = 0
            for j in range(32):
                v = np.int16(np.round(x[m, b * 32 + j] * inv))
                xq[m, b * 32 + j] = v
                t += np.int64(v)
            xd[m, b] = d
            xs[m, b] = d * F(t)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _h(row, o, f16):
    return f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@_fast
def matmul_q8(packed, xq, xd, xs, out, n0, n1, kind, f16):
    """out[m, n] = x[m] @ dequant(packed[n]) for n0 <= n < n1, x given as ``quantize`` made it."""
    nb32 = xq.shape[1] // 32
    for n in range(n0, n1):
        row = packed[n]
        sc = row.view(np.int8)
        for m in range(xq.shape[0]):
            xm = xq[m]
            acc = F(0.0)
            if kind == 0 or kind == 1:  # Q4_0 (codes - 8), Q4_1 (d * code + m)
                ts = 18 if kind == 0 else 20
                p = 2 if kind == 0 else 4
                for blk in range(nb32):
                    o = blk * ts
                    s = dot_nibbles(row, o + p, xm, blk * 32)
                    dd = _h(row, o, f16) * xd[m, blk]
                    if kind == 0:
                        acc += dd * F(s) - F(8.0) * _h(row, o, f16) * xs[m, blk]
                    else:
                        acc += dd * F(s) + _h(row, o + 2, f16) * xs[m, blk]
            elif kind == 4:  # Q8_0
                for blk in range(nb32):
                    o = blk * 34
                    acc += (_h(row, o, f16) * xd[m, blk]) * F(dot_int8(row, o + 2, xm, blk * 32))
            elif kind == 7:  # Q4_K: 8 sub-blocks of 32 (one x block each), a * sum(x q) - dmin * mn * sum(x)
                for blk in range(nb32 // 8):
                    o = blk * 144
                    d = _h(row, o, f16)
                    dmin = _h(row, o + 2, f16)
                    for g in range(4):
                        for half in range(2):
                            j = 2 * g + half
                            if j < 4:
                                scj = np.int64(row[o + 4 + j]) & 63
                                mnj = np.int64(row[o + 8 + j]) & 63
                            else:
                                md = np.int64(row[o + 12 + j - 4])
                                scj = (md & 15) | ((np.int64(row[o + 4 + j - 4]) >> 2) & 0x30)
                                mnj = (md >> 4) | ((np.int64(row[o + 4 + j]) >> 2) & 0x30)
                            xb = blk * 8 + j
                            s = dot_nibble32(row, o + 16 + g * 32, 4 * half, xm, xb * 32)
                            acc += (d * F(scj)) * xd[m, xb] * F(s) - (dmin * F(mnj)) * xs[m, xb]
            else:  # Q6_K: 16 sub-blocks of 16 (two per x block), d * sc * sum(x (q - 32))
                for blk in range(nb32 // 8):
                    o = blk * 210
                    d = _h(row, o + 208, f16)
                    for h in range(2):
                        for t in range(4):  # the four 32-runs of this half: ql +0/+32, low/high nibble
                            xb = blk * 8 + h * 4 + t
                            lo_o = o + h * 64 + (32 if t % 2 == 1 else 0)
                            ls = 4 if t >= 2 else 0
                            tot = F(0.0)
                            for part in range(2):
                                s = dot_six16(row, lo_o + part * 16, ls, o + 128 + h * 32 + part * 16, 2 * t,
                                              xm, xb * 32 + part * 16)
                                tot += F(sc[o + 192 + h * 8 + 2 * t + part]) * F(s)
                            acc += (d * xd[m, xb]) * tot
            out[m, n] = acc
