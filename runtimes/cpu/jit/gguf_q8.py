"""GGUF products with x rounded to integers and integer dot products, in the manner of llama.cpp
(``ggml_vec_dot_q4_1_q8_1`` and kin): each block of 32 elements of x becomes ``d * v`` with integers |v| <= 16256
(``d = max|x| / 16256``), rounded ONCE per product (``quantize``) and reused by every weight row. ``v`` is stored as
two bytes, ``v = 128 hi + lo`` (hi in [-127, 127], lo in [0, 127]), so that a weight block's byte codes are
multiplied with it by two byte dot products (``vpdpbusd``, AVX512-VNNI: 4 pairs summed into each int32 lane; on
AVX2 ``pmaddubsw`` + ``pmaddwd``; generic vector IR elsewhere), ``128 * dot(q, hi) + dot(q, lo)``, exact in int32.
Q8_0's signed codes are flipped to unsigned (q + 128: one xor) and the 128 sum(v) that adds is taken off inside the
integer dot (section "Q8_0, two blocks per 512-bit vector"); the K-quants' codes are unsigned. The 8 int32 lanes are
converted to f32 and accumulated with one fused multiply-add by the block's scale ``d_w * d_x`` (a vector of scales
for Q6_K's sub-blocks of 16) into vector accumulators, several in turn (independent FMA chains); the minimum /
offset terms (Q4_0's ``-8``, the ``m`` of Q4_1 and Q4_K) multiply the sum of the rounded x of the block (``xs``),
as llama.cpp's q8_1 blocks do. The accumulators are summed once per output.

The block loops are LLVM IR. Q4_0 and Q4_1 (``_kernel``: one intrinsic per type; ``_units_*`` decode a block into
byte codes and scales; Q8_0 has its own loop, ``_q8_kernel``, two blocks per 512-bit vector): each call computes a
weight row against 1-4 rows of x (``MR``, 4 accumulators' worth); more rows of x (a small batch: prefill) take the
same row again, which is in L1 by then: the weight is read from memory once per product and decoded once per 4 rows
of x (compute-bound: ~45-55 GFLOP/s per Zen 4 core with 8-64 rows). The K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K
(``_kkernel``, ``_kunits_*``; section below) work 64 code bytes at a time on 512-bit vectors, with their scales
unpacked by vector integer operations, and take two weight rows per pass: rows ``n`` and ``n + h`` (h = half the
thread's range), two long sequential streams that share every load of x. Two ADJACENT rows at once made a short
back-and-forth pattern the hardware prefetchers lost (2.5x slower out of cache); the two far-apart streams measured
+16% (Q4_K) and +40% (Q6_K) over one row per pass.

The runtime calls ``quant_product``: each thread's part rounds x itself (the same codes on every thread) into its
own scratch - for a K-quant in the type's *pair order* (``KPAIRS``: the two x-blocks each 64-code vector pairs,
high bytes then low, contiguous, so each is one 64-byte load) - and computes its rows, one call: a product is one
phase of a chain (``chain.py``), with no barrier between the rounding and the product.

On hosts with AVX512-VNNI (512-bit) the runtime runs Q4_0, Q4_1 and Q8_0 on weights repacked into tiles of 16
rows instead (``gguf_tiles.py``: the same integers, no per-row reductions or scale broadcasts); the per-row loops
here take the rows past the last whole tile, writable weights and other hosts.

Why two bytes and not llama.cpp's one: 8-bit x flipped greedy ids of a random-weight test model against the dense
run; the second byte costs one more byte dot product per block (x stays in L1; the weight's bytes dominate).

Numerics (tests/TOLERANCES.md, family ``xint15``): the result is the product of the exactly dequantized weight with
x rounded per block of 32 (each element moved by at most ``max|x_block| / 32512``), up to f32 rounding of the
per-block scales and of the f32 accumulation.
"""

from __future__ import annotations

import os

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import isa

F = np.float32
I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
FLT = ir.FloatType()
QMAX = 16256.0  # x codes: 127 * 128, so that x = 128 hi + lo with hi in [-127, 127], lo in [0, 127]
KINDS = (0, 1, 4, 5, 6, 7, 8, 9)  # Q4_0, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
NR = 2  # weight rows per pass of Q4_0/Q4_1/Q8_0: n and n + half the range (as the K-quants' KNR)
MR = 4  # rows of x per pass (share each decoded weight block)


def _features() -> dict:
    """The features numba's code generator targets in this process, not the host's: a forced ``avx2`` path
    (``LUMINAL_RECIPES_ISA``, runtimes/cpu/isa.py) or ``NUMBA_CPU_NAME=generic`` must not get VNNI intrinsics that
    its target cannot select."""
    _, listed = isa.numba_codegen_target()
    return {flag[1:]: flag[0] == "+" for flag in listed.split(",") if flag[:1] in "+-" and len(flag) > 1}


def _vnni_form():
    """The argument type of LLVM's ``vpdpbusd`` (256-bit) on this host, or None: VNNI absent, or LLVM's
    declaration not one this code knows (the byte operands were <8 x i32> before LLVM 21, <32 x i8> since)."""
    f = _features()
    if not ((f.get("avx512vnni") and f.get("avx512vl")) or f.get("avxvnni")):
        return None
    for t in ("<32 x i8>", "<8 x i32>"):
        text = (f"declare <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32>, {t}, {t})\n"
                f"define <8 x i32> @f(<8 x i32> %a, {t} %b, {t} %c) {{\n"
                f"  %r = call <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32> %a, {t} %b, {t} %c)\n"
                f"  ret <8 x i32> %r\n}}\n")
        try:
            llvm_binding.parse_assembly(text).verify()
            return ir.VectorType(I8, 32) if "i8" in t else ir.VectorType(I32, 8)
        except Exception:
            continue
    return None


_VNNI = _vnni_form()
_AVX2 = bool(_features().get("avx2", False))
_F16C = bool(_features().get("f16c", False))

_fast = numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True, error_model="numpy")


def _v(t, n):
    return ir.VectorType(t, n)


def _c(t, n, value):
    return ir.Constant(_v(t, n), [value] * n)


def _splat(builder, value, n):
    vec = builder.insert_element(ir.Constant(_v(value.type, n), ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_v(value.type, n), ir.Undefined),
                                  ir.Constant(_v(I32, n), [0] * n))


def _at(builder, base, off, t):
    """A ``t*`` at byte ``off`` (i64) of the i8* ``base``."""
    return builder.bitcast(builder.gep(base, [off]), t.as_pointer())


def _ld(builder, base, off, t):
    return builder.load(_at(builder, base, off, t), align=1)


def _i64(builder, v):
    return builder.zext(v, I64) if v.type.width < 64 else v


def _h(builder, base, off, f16):
    """The f16 at byte ``off`` of ``base`` as f32 (exact): ``vcvtph2ps`` where F16C is present (the table's random
    lookups over 256 KiB, a few per block, measured ~12% of a pass over a real model's scales), else the table."""
    if _F16C:  # through a zero-extended i32 in a zeroed vector (``vmovd``): a ``vpinsrw`` into whatever register
        # held the last value would chain every block's conversion to the one before (a false dependency)
        v = builder.insert_element(ir.Constant(_v(I32, 4), [0] * 4), builder.zext(_ld(builder, base, off, I16), I32),
                                   ir.Constant(I32, 0))
        h = builder.fpext(builder.bitcast(v, _v(ir.HalfType(), 8)), _v(FLT, 8))
        return builder.extract_element(h, ir.Constant(I32, 0))
    bits = builder.zext(_ld(builder, base, off, I16), I64)
    return builder.load(builder.gep(f16, [bits]))


def _dpbusd(builder, acc, u, x):
    """<8 x i32> acc + (lane k: sum of u[4k + j] x[4k + j], j < 4), u <32 x i8> unsigned, x <32 x i8> signed;
    exact for the codes here (u <= 128, |x| <= 127: no pair sum reaches int16's limit)."""
    if _VNNI is not None:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v(I32, 8), [_v(I32, 8), _VNNI, _VNNI]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        if _VNNI.element.width == 32:
            u, x = builder.bitcast(u, _VNNI), builder.bitcast(x, _VNNI)
        return builder.call(fn, [acc, u, x])
    if _AVX2:  # pmaddubsw (pairs to int16, never saturating here) then pmaddwd with ones (pairs to int32)
        f1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v(I16, 16), [_v(I8, 32)] * 2),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        f2 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v(I32, 8), [_v(I16, 16)] * 2),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.add(acc, builder.call(f2, [builder.call(f1, [u, x]), _c(I16, 16, 1)]))
    p = builder.mul(builder.zext(u, _v(I32, 32)), builder.sext(x, _v(I32, 32)))
    und = ir.Constant(_v(I32, 32), ir.Undefined)
    for j in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, und, ir.Constant(_v(I32, 8), list(range(j, 32, 4)))))
    return acc


def _sign(builder, x, s):
    """x negated where s < 0, zeroed where s == 0 (``psignb``)."""
    if _AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v(I8, 32), [_v(I8, 32)] * 2),
                                            "llvm.x86.avx2.psign.b")
        return builder.call(fn, [x, s])
    zero = _c(I8, 32, 0)
    neg = builder.select(builder.icmp_signed("<", s, zero), builder.sub(zero, x), x)
    return builder.select(builder.icmp_signed("==", s, zero), zero, neg)


def _dot(builder, q, signed, xh, xl):
    """<8 x i32>: lane k = sum of q[4k + j] (128 xh + xl)[4k + j], j < 4 (x = 128 xh + xl)."""
    if signed:  # |q| times x carrying q's sign (llama.cpp's trick for signed bytes)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v(I8, 32), [_v(I8, 32), I1]),
                                            "llvm.abs.v32i8")
        q, xh, xl = builder.call(fn, [q, ir.Constant(I1, 0)]), _sign(builder, xh, q), _sign(builder, xl, q)
        # (the right-hand side is evaluated first: the signs come from the codes before abs)
    hi = _dpbusd(builder, ir.Constant(_v(I32, 8), [0] * 8), q, xh)
    return _dpbusd(builder, builder.shl(hi, _c(I32, 8, 7)), q, xl)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fma.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def _nibbles(builder, w16):
    """<16 x i8> -> <32 x i8>: the 16 low nibbles, then the 16 high ones."""
    lo = builder.and_(w16, _c(I8, 16, 15))
    hi = builder.lshr(w16, _c(I8, 16, 4))
    return builder.shuffle_vector(lo, hi, ir.Constant(_v(I32, 32), list(range(32))))


# ---- per type: a block's x-blocks of 32 as (index, codes <32 x i8>, signed, scale, minimum coefficient) -------
# ``scale`` is an f32 scalar or a <8 x float> (one per lane of 4 elements: Q6_K's two sub-blocks of 16); the
# minimum's coefficient (an f32, or None) multiplies sum(x) of the x-block.
def _units_q4(kind):
    def units(builder, w, o, f16):
        d = _h(builder, w, o, f16)
        p = builder.add(o, ir.Constant(I64, 2 if kind == 0 else 4))
        q = _nibbles(builder, _ld(builder, w, p, _v(I8, 16)))
        if kind == 0:  # (q - 8) d: the offset through sum(x)
            return [(0, q, False, d, builder.fmul(d, ir.Constant(FLT, -8.0)))]
        return [(0, q, False, d, _h(builder, w, builder.add(o, ir.Constant(I64, 2)), f16))]
    return units


# kind -> (bytes per block, x-blocks of 32 per block, units)
TYPES = {0: (18, 1, _units_q4(0)), 1: (20, 1, _units_q4(1))}  # Q8_0: ``_q8_kernel``


def _kernel(kind, nr=1):
    """An intrinsic ``(w, n, xq, xd, xs, m0, mr, out, f16) -> None``: out[m0 + i, n] = x[m0 + i] . W[n] for
    i < mr (1 to ``MR``), over the whole row (the x arrays given as ``quantize`` made them)."""
    ts, per, units = TYPES[kind]

    @intrinsic
    def kernel(typingctx, w, n, gap, xq, xd, xs, m0, mr_, out, f16):
        def codegen(context, builder, sig, args):
            wa, na, gapa, xqa, xda, xsa, m0a, mra, outa, f16a = args
            tw, _, _, txq, txd, txs, _, _, tout, tf16 = sig.args

            def arr(t, v):
                a = context.make_array(t)(context, builder, v)
                return builder.bitcast(a.data, I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides, t.ndim)

            wp, ws = arr(tw, wa)
            xqp, xqs = arr(txq, xqa)
            xdp, xds = arr(txd, xda)
            xsp, xss = arr(txs, xsa)
            outp, outs = arr(tout, outa)
            f16p = context.make_array(tf16)(context, builder, f16a).data
            nv, m0v = _i64(builder, na), _i64(builder, m0a)
            k_len = cgutils.unpack_tuple(builder, context.make_array(txq)(context, builder, xqa).shape, 2)[1]
            nbx = builder.sdiv(k_len, ir.Constant(I64, 64))  # xq holds 64 bytes per x-block
            nblk = builder.sdiv(nbx, ir.Constant(I64, per))
            done = builder.append_basic_block("done")
            cases = [builder.append_basic_block(f"mr{mr}") for mr in range(1, MR + 1)]
            switch = builder.switch(_i64(builder, mra), done)
            for mr, bb in zip(range(1, MR + 1), cases):
                switch.add_case(ir.Constant(I64, mr), bb)
                builder.position_at_end(bb)
                _body(builder, mr, nr, per, ts, units, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, xsp, xss, outp, outs,
                      f16p, _i64(builder, gapa))
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(w, n, gap, xq, xd, xs, m0, mr_, out, f16), codegen

    return kernel


def _body(builder, mr, nr, per, ts, units, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, xsp, xss, outp, outs, f16p,
          gap):
    """The IR of one pass: ``nr`` weight rows ``nv + r gap`` times ``mr`` rows of x from ``m0v``, stored in out."""
    wn = [builder.add(nv, builder.mul(gap, ir.Constant(I64, r))) for r in range(nr)]
    rows = [builder.gep(wp, [builder.mul(wn[r], ws[0])]) for r in range(nr)]
    xrow = [builder.gep(xqp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), xqs[0])]) for i in range(mr)]
    drow = [builder.gep(xdp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), xds[0])]) for i in range(mr)]
    srow = [builder.gep(xsp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), xss[0])]) for i in range(mr)]
    # ``slots`` accumulators per output, used in turn by successive x-blocks: independent chains of
    # fused multiply-adds (one chain would wait the FMA's latency every x-block)
    slots = max(1, 4 // mr)  # not by nr: a row's sums are the same whichever pass computes it
    unroll = slots if per == 1 else 1  # blocks per loop iteration
    zero = ir.Constant(_v(FLT, 8), [0.0] * 8)
    acc = [[[cgutils.alloca_once_value(builder, zero) for _ in range(mr)] for _ in range(nr)]
           for _ in range(slots)]
    macc = [[[cgutils.alloca_once_value(builder, ir.Constant(FLT, 0.0)) for _ in range(mr)]
             for _ in range(nr)] for _ in range(slots)]

    def block(b, first_slot):
        o = builder.mul(b, ir.Constant(I64, ts))
        xb0 = builder.mul(b, ir.Constant(I64, per))
        decoded = [units(builder, rows[r], o, f16p) for r in range(nr)]
        for u in range(len(decoded[0])):
            slot = (first_slot + u) % slots
            xb = builder.add(xb0, ir.Constant(I64, decoded[0][u][0]))
            xoff = builder.mul(xb, ir.Constant(I64, 64))
            foff = builder.mul(xb, ir.Constant(I64, 4))
            for i in range(mr):
                xh = _ld(builder, xrow[i], xoff, _v(I8, 32))
                xl = _ld(builder, xrow[i], builder.add(xoff, ir.Constant(I64, 32)), _v(I8, 32))
                dx = _ld(builder, drow[i], foff, FLT)
                sx = None
                for r in range(nr):
                    _, q, signed, scale, mn = decoded[r][u]
                    if isinstance(scale.type, ir.VectorType):
                        sv = builder.fmul(scale, _splat(builder, dx, 8))
                    else:
                        sv = _splat(builder, builder.fmul(scale, dx), 8)
                    prod = builder.sitofp(_dot(builder, q, signed, xh, xl), _v(FLT, 8))
                    a_ = acc[slot][r][i]
                    builder.store(_fma(builder, prod, sv, builder.load(a_)), a_)
                    if mn is not None:
                        if sx is None:
                            sx = _ld(builder, srow[i], foff, FLT)
                        m_ = macc[slot][r][i]
                        builder.store(builder.fadd(builder.load(m_), builder.fmul(mn, sx)), m_)

    full = builder.sdiv(nblk, ir.Constant(I64, unroll))
    with cgutils.for_range(builder, full) as loop:
        for u in range(unroll):
            block(builder.add(builder.mul(loop.index, ir.Constant(I64, unroll)), ir.Constant(I64, u)), u)
    if unroll > 1:
        with cgutils.for_range(builder, nblk, start=builder.mul(full, ir.Constant(I64, unroll))) as loop:
            block(loop.index, 0)
    red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLT, [FLT, _v(FLT, 8)]),
                                         "llvm.vector.reduce.fadd.v8f32")
    for i in range(mr):
        orow = builder.gep(outp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), outs[0])])
        for r in range(nr):
            vec = builder.load(acc[0][r][i])
            mins = builder.load(macc[0][r][i])
            for slot in range(1, slots):
                vec = builder.fadd(vec, builder.load(acc[slot][r][i]))
                mins = builder.fadd(mins, builder.load(macc[slot][r][i]))
            total = builder.call(red, [mins, vec], fastmath=("reassoc",))  # a tree: short latency
            builder.store(total, _at(builder, orow, builder.mul(wn[r], outs[1]), FLT))


_K = {k: (_kernel(k, 1), _kernel(k, NR)) for k in (0, 1)}
_K0, _K1 = (_K[k][0] for k in (0, 1))
_P0, _P1 = (_K[k][1] for k in (0, 1))


# one compiled product per type (module-level, so that numba caches them on disk): every weight row n0..n1-1
# once, ``MR`` rows of x at a time (the row stays in L1 between the passes), NR rows far apart per pass
@_fast
def product_q4_0(packed, xq, xd, xs, out, n0, n1, f16):
    h = (n1 - n0) // NR
    for j in range(h):
        for m0 in range(0, xq.shape[0], MR):
            _P0(packed, n0 + j, h, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)
    for n in range(n0 + h * NR, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K0(packed, n, 0, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


@_fast
def product_q4_1(packed, xq, xd, xs, out, n0, n1, f16):
    h = (n1 - n0) // NR
    for j in range(h):
        for m0 in range(0, xq.shape[0], MR):
            _P1(packed, n0 + j, h, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)
    for n in range(n0 + h * NR, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K1(packed, n, 0, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


@_fast
def product_q8_0(packed, xq, xd, xs, out, n0, n1, f16):  # on ``quantize``'s x: its pair order made here, per call
    xp, xi = _pairs_q8_0(xq)
    paired_q8_0(packed, xp, xd, xi.view(np.float32), out, n0, n1)


@_fast
def _quantize_into(x, xq, xd, xs, x16, dest, sums):
    """``quantize`` with the 32-byte chunks of each 512 bytes of xq (chunk 2 j: x-block j's high bytes, 2 j + 1 its
    low ones; 8 x-blocks) written at chunk ``dest[c]`` instead of c (a K-quant's pair order), and, where ``sums``,
    x16 (f32 [m, k / 16]) the step times the sum of the codes of each 16 (as ``sums16``). The same codes as
    ``quantize``; max|x| taken on the bits (|x| orders as its bits do), the codes recomputed per store loop (one
    store stream per loop: the loops vectorise; ~3 us for k = 2048)."""
    xi = x.view(np.int32)
    buf = np.empty(1, np.int32)
    fbuf = buf.view(np.float32)
    for m in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            bits = np.int32(0)
            for j in range(32):
                bits = max(bits, xi[m, b * 32 + j] & np.int32(0x7FFFFFFF))
            buf[0] = bits
            d = fbuf[0] / F(QMAX)
            inv = F(1.0) / d if d > F(0.0) else F(0.0)
            base = 512 * (b // 8)
            h0 = base + 32 * dest[2 * (b % 8)]
            l0 = base + 32 * dest[2 * (b % 8) + 1]
            hi = xq[m, h0:h0 + 32]
            lo = xq[m, l0:l0 + 32]
            xr = x[m, b * 32:b * 32 + 32]
            t0 = np.int32(0)
            t1 = np.int32(0)
            for j in range(16):  # x * (1 / d) may round a hair past QMAX: clamped
                t0 += min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256))
            for j in range(16, 32):
                t1 += min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256))
            for j in range(32):
                hi[j] = np.int8(min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256)) >> 7)
            for j in range(32):
                lo[j] = np.int8(min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256)) & 127)
            xd[m, b] = d
            xs[m, b] = d * F(t0 + t1)
            if sums:
                x16[m, 2 * b] = d * F(t0)
                x16[m, 2 * b + 1] = d * F(t1)


QMAX8 = 127.0  # x codes of the 8-bit option (``X_BITS == 8``): one byte, llama.cpp's precision (per 32 here)


@_fast
def _quantize_into8(x, xq, xd, xs, x16, dest, sums):
    """``_quantize_into`` with 8-bit codes: v = round(x / d), d = max|x| / 127, written where the high bytes go
    (chunk ``dest[2 j]``; the low bytes' chunks are left as they are: the 8-bit loops never read them)."""
    xi = x.view(np.int32)
    buf = np.empty(1, np.int32)
    fbuf = buf.view(np.float32)
    for m in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            bits = np.int32(0)
            for j in range(32):
                bits = max(bits, xi[m, b * 32 + j] & np.int32(0x7FFFFFFF))
            buf[0] = bits
            d = fbuf[0] / F(QMAX8)
            inv = F(1.0) / d if d > F(0.0) else F(0.0)
            h0 = 512 * (b // 8) + 32 * dest[2 * (b % 8)]
            hi = xq[m, h0:h0 + 32]
            xr = x[m, b * 32:b * 32 + 32]
            t0 = np.int32(0)
            t1 = np.int32(0)
            for j in range(16):
                t0 += min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-127)), np.int32(127))
            for j in range(16, 32):
                t1 += min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-127)), np.int32(127))
            for j in range(32):
                hi[j] = np.int8(min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-127)), np.int32(127)))
            xd[m, b] = d
            xs[m, b] = d * F(t0 + t1)
            if sums:
                x16[m, 2 * b] = d * F(t0)
                x16[m, 2 * b + 1] = d * F(t1)


@_fast
def quantize(x, xq, xd, xs):
    """x (f32 [m, k], k a multiple of 32) -> per block of 32: codes v = round(x / d) (|v| <= 16256) stored as
    32 bytes ``v >> 7`` then 32 bytes ``v & 127`` in xq (int8 [m, 2 k]); xd f32 [m, k / 32] the steps d =
    max|x| / 16256, xs = d * sum(v)."""
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
                v = np.int64(np.round(x[m, b * 32 + j] * inv))
                v = min(max(v, -16256), 16256)  # x * (1 / d) may round a hair past QMAX
                xq[m, b * 64 + j] = np.int8(v >> 7)
                xq[m, b * 64 + 32 + j] = np.int8(v & 127)
                t += v
            xd[m, b] = d
            xs[m, b] = d * F(t)


def codes(xq: np.ndarray) -> np.ndarray:
    """The int codes v of ``quantize``'s xq (int8 [m, 2 k]) as int64 [m, k] (for tests)."""
    b = xq.reshape(xq.shape[0], -1, 2, 32).astype(np.int64)
    return (b[:, :, 0] * 128 + b[:, :, 1]).reshape(xq.shape[0], -1)


def product(kind):
    """The compiled product of one type."""
    return PRODUCTS[kind]


def matmul_q8(packed, xq, xd, xs, out, n0, n1, kind, f16):
    """out[m, n] = x[m] @ dequant(packed[n]) for n0 <= n < n1, x given as ``quantize`` made it (C-contiguous
    arrays: xq int8 [m, 2 k], xd and xs f32 [m, k / 32])."""
    product(kind)(packed, xq, xd, xs, out, n0, n1, f16)


# ---- K-quants, 64 bytes at a time -------------------------------------------------------------------------------
# A super-block of 256 elements: the sub-blocks' scales are unpacked with vector integer operations into one f32
# vector per block (``nsub`` = 8 sub-blocks of 32 or 16 of 16), multiplied once per row of x by the 8 steps of its
# x-blocks (contiguous in xd); the codes are made unsigned (0 .. 2**bits - 1) and dotted 64 at a time, two x-blocks
# per <64 x i8> (``vpdpbusd`` on 512 bits; two 256-bit halves without AVX512-VNNI); each product's 16 int32 lanes
# take their sub-blocks' scales by one permutation of that vector. The constant offsets (Q3_K's -4, Q6_K's -32)
# and the minima (Q2_K, Q4_K, Q5_K) are one fused multiply-add per block and row of x: a vector of ``nsub``
# coefficients times the sums of x per sub-block (xs for sub-blocks of 32, per 16 computed once per product).
def _vnni512():
    f = _features()
    if _VNNI is None or not (f.get("avx512vnni") and f.get("avx512bw")):
        return None
    return ir.VectorType(I8, 64) if _VNNI.element.width == 8 else ir.VectorType(I32, 16)


_VNNI512 = _vnni512()
PREFETCH = 0  # bytes ahead of the K-quant block loops' software prefetch (0: none)


def _cat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(_v(I32, 2 * n), list(range(2 * n))))


def _half_of(builder, v, h):
    n = v.type.count // 2
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(_v(I32, n),
                                                                                     list(range(h * n, h * n + n))))


def _dpbusd64(builder, acc, u, x):
    """<16 x i32> acc + (lane k: sum of u[4k + j] x[4k + j]), u <64 x i8> unsigned, x <64 x i8> signed."""
    if _VNNI512 is not None:
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(_v(I32, 16), [_v(I32, 16), _VNNI512, _VNNI512]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        if _VNNI512.element.width == 32:
            u, x = builder.bitcast(u, _VNNI512), builder.bitcast(x, _VNNI512)
        return builder.call(fn, [acc, u, x])
    parts = [_dpbusd(builder, _half_of(builder, acc, h), _half_of(builder, u, h), _half_of(builder, x, h))
             for h in range(2)]
    return _cat(builder, parts[0], parts[1])


def _b64(builder, v, op, n):
    """<64 x i8> ``v op n`` (op: 'and', 'shr', 'shl', 'or')."""
    c = _c(I8, 64, n) if isinstance(n, int) else n
    return {"and": builder.and_, "shr": builder.lshr, "shl": builder.shl, "or": builder.or_}[op](v, c)


def _words(builder, ws, n8):
    """i32 or i64 words -> <n8 x i8> (little-endian bytes, in order)."""
    w = ws[0].type
    vec = ir.Constant(_v(w, len(ws)), ir.Undefined)
    for i, x in enumerate(ws):
        vec = builder.insert_element(vec, x, ir.Constant(I32, i))
    return builder.bitcast(vec, _v(I8, n8))


def _k_scales_4_5(builder, w, o, f16):
    """Q4_K / Q5_K: the 16 bytes at o (d, dmin, 12 bytes of 6-bit scales and minima) -> (<8 x float> d sc,
    <8 x float> -dmin mn): llama.cpp's kmask unpacking (the upper four's high bits in the top bits of the first
    eight bytes) done on one 16-byte vector by two byte shuffles, shifts and masks - the scalar form cost ~30
    instructions per block, a third of the Q4_K loop -, d and dmin converted together (F16C)."""
    v = _ld(builder, w, o, _v(I8, 16))
    und = ir.Constant(_v(I8, 16), ir.Undefined)

    def shuffle(idx):
        return builder.shuffle_vector(v, und, ir.Constant(_v(I32, 16), idx))

    def mask(*groups):
        return ir.Constant(_v(I8, 16), [g for g in groups for _ in range(4)])

    # bytes 4 + j hold s[j]: sc 0..3 = s0..3 & 63, sc 4..7 = s8..11 & 15 | (s0..3 >> 6) << 4,
    # mn 0..3 = s4..7 & 63, mn 4..7 = s8..11 >> 4 | (s4..7 >> 6) << 4
    a = shuffle([4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15])
    b = shuffle([4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11])
    low = builder.or_(builder.and_(a, mask(63, 15, 63, 0)), builder.and_(builder.lshr(a, _c(I8, 16, 4)),
                                                                           mask(0, 0, 0, 15)))
    u = builder.or_(low, builder.and_(builder.lshr(b, _c(I8, 16, 2)), mask(0, 48, 0, 48)))
    f = builder.uitofp(u, _v(FLT, 16))
    if _F16C:
        pair = builder.fpext(builder.bitcast(_ld(builder, w, o, _v(I16, 2)), _v(ir.HalfType(), 2)), _v(FLT, 2))
        dm = builder.shuffle_vector(pair, ir.Constant(pair.type, ir.Undefined),
                                    ir.Constant(_v(I32, 16), [0] * 8 + [1] * 8))
    else:
        d, dmin = _h(builder, w, o, f16), _h(builder, w, builder.add(o, ir.Constant(I64, 2)), f16)
        dm = builder.shuffle_vector(_splat(builder, d, 8), _splat(builder, dmin, 8),
                                    ir.Constant(_v(I32, 16), list(range(16))))
    s = builder.fmul(dm, f)  # d sc, dmin mn: the products the scalar form made, bit for bit
    return _half_of(builder, s, 0), builder.fneg(_half_of(builder, s, 1))


def _kunits_q4_k(builder, w, o, f16):
    """Q4_K (d, dmin, 12 bytes of scales, 128 bytes of nibbles: bytes 32 g .. 32 g + 31 hold sub-block 2 g in their
    low nibbles, 2 g + 1 in their high ones)."""
    scale, coef = _k_scales_4_5(builder, w, o, f16)
    a = _ld(builder, w, builder.add(o, ir.Constant(I64, 16)), _v(I8, 64))
    b = _ld(builder, w, builder.add(o, ir.Constant(I64, 80)), _v(I8, 64))
    pairs = [(0, 2, _b64(builder, a, "and", 15)), (1, 3, _b64(builder, _b64(builder, a, "shr", 4), "and", 15)),
             (4, 6, _b64(builder, b, "and", 15)), (5, 7, _b64(builder, _b64(builder, b, "shr", 4), "and", 15))]
    return scale, coef, pairs


def _kunits_q5_k(builder, w, o, f16):
    """Q5_K: Q4_K's layout with 32 bytes of high bits (bit j of byte l: element l of sub-block j) before the
    nibbles."""
    scale, coef = _k_scales_4_5(builder, w, o, f16)
    qh = _ld(builder, w, builder.add(o, ir.Constant(I64, 16)), _v(I8, 32))
    h = _cat(builder, qh, builder.lshr(qh, _c(I8, 32, 2)))  # bits j (first half) and j + 2 (second)
    a = _ld(builder, w, builder.add(o, ir.Constant(I64, 48)), _v(I8, 64))
    b = _ld(builder, w, builder.add(o, ir.Constant(I64, 112)), _v(I8, 64))

    def high(op, s):  # bit s of h at bit 4
        return _b64(builder, _b64(builder, h, op, s) if s else h, "and", 16)

    pairs = [(0, 2, _b64(builder, _b64(builder, a, "and", 15), "or", high("shl", 4))),
             (1, 3, _b64(builder, _b64(builder, _b64(builder, a, "shr", 4), "and", 15), "or", high("shl", 3))),
             (4, 6, _b64(builder, _b64(builder, b, "and", 15), "or", high("shl", 0))),
             (5, 7, _b64(builder, _b64(builder, _b64(builder, b, "shr", 4), "and", 15), "or", high("shr", 1)))]
    return scale, coef, pairs


def _kunits_q6_k(builder, w, o, f16):
    """Q6_K (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d): codes q in 0..63, value
    d sc (q - 32); the -32 through the sums of x per 16."""
    d = _h(builder, w, builder.add(o, ir.Constant(I64, 208)), f16)
    sc = builder.sitofp(_ld(builder, w, builder.add(o, ir.Constant(I64, 192)), _v(I8, 16)), _v(FLT, 16))
    s = builder.fmul(_splat(builder, d, 16), sc)
    pairs = []
    for h in range(2):
        lv = _ld(builder, w, builder.add(o, ir.Constant(I64, 64 * h)), _v(I8, 64))
        qh = _ld(builder, w, builder.add(o, ir.Constant(I64, 128 + 32 * h)), _v(I8, 32))
        hc = _cat(builder, qh, builder.lshr(qh, _c(I8, 32, 2)))  # x-block 4h + t: bits 2t of qh
        pairs.append((4 * h, 4 * h + 1, _b64(builder, _b64(builder, lv, "and", 15), "or",
                                             _b64(builder, _b64(builder, hc, "shl", 4), "and", 48))))
        pairs.append((4 * h + 2, 4 * h + 3, _b64(builder, _b64(builder, _b64(builder, lv, "shr", 4), "and", 15),
                                                 "or", _b64(builder, hc, "and", 48))))
    return s, builder.fmul(s, _c(FLT, 16, -32.0)), pairs


def _kunits_q3_k(builder, w, o, f16):
    """Q3_K (32 bytes of high bits, 64 of 2-bit codes, 12 bytes of 6-bit scales - 32, d): element h 128 + t 32 + l
    is bits 2t of qs[32 h + l] with bit 4 h + t of hmask[l] above them, value d sc (q - 4); the -4 through the sums
    of x per 16."""
    d = _h(builder, w, builder.add(o, ir.Constant(I64, 108)), f16)
    a = _ld(builder, w, builder.add(o, ir.Constant(I64, 96)), I64)
    c = _ld(builder, w, builder.add(o, ir.Constant(I64, 104)), I32)
    m4, m2 = ir.Constant(I64, 0x0F0F0F0F0F0F0F0F), ir.Constant(I32, 0x03030303)
    hi = [builder.zext(builder.and_(builder.lshr(c, ir.Constant(I32, 2 * i)), m2), I64) for i in range(4)]
    words = []
    for j in range(2):  # scales 0..7: low nibbles of a; 8..15: high nibbles; bits 4, 5 from c
        lo = builder.and_(builder.lshr(a, ir.Constant(I64, 4 * j)), m4)
        top = builder.or_(hi[2 * j], builder.shl(hi[2 * j + 1], ir.Constant(I64, 32)))
        words.append(builder.or_(lo, builder.shl(top, ir.Constant(I64, 4))))
    sc = builder.sitofp(builder.sub(_words(builder, words, 16), _c(I8, 16, 32)), _v(FLT, 16))
    s = builder.fmul(_splat(builder, d, 16), sc)
    qs = _ld(builder, w, builder.add(o, ir.Constant(I64, 32)), _v(I8, 64))
    hm = _ld(builder, w, o, _v(I8, 32))
    hm = _cat(builder, hm, builder.lshr(hm, _c(I8, 32, 4)))
    pairs = []
    for t in range(4):
        low = _b64(builder, _b64(builder, qs, "shr", 2 * t) if t else qs, "and", 3)
        hb = _b64(builder, _b64(builder, hm, "shr", t) if t else hm, "and", 1)
        pairs.append((t, 4 + t, _b64(builder, low, "or", _b64(builder, hb, "shl", 2))))
    return s, builder.fmul(s, _c(FLT, 16, -4.0)), pairs


def _kunits_q2_k(builder, w, o, f16):
    """Q2_K (16 bytes: scale | min << 4, 64 bytes of 2-bit codes, d, dmin): element h 128 + t 32 + l is bits 2t of
    qs[32 h + l], value d sc q - dmin mn."""
    d = _h(builder, w, builder.add(o, ir.Constant(I64, 80)), f16)
    dmin = _h(builder, w, builder.add(o, ir.Constant(I64, 82)), f16)
    b = _ld(builder, w, o, _v(I8, 16))
    sc = builder.uitofp(builder.and_(b, _c(I8, 16, 15)), _v(FLT, 16))
    mn = builder.uitofp(builder.lshr(b, _c(I8, 16, 4)), _v(FLT, 16))
    qs = _ld(builder, w, builder.add(o, ir.Constant(I64, 16)), _v(I8, 64))
    pairs = [(t, 4 + t, _b64(builder, _b64(builder, qs, "shr", 2 * t) if t else qs, "and", 3)) for t in range(4)]
    return (builder.fmul(_splat(builder, d, 16), sc), builder.fmul(_splat(builder, builder.fneg(dmin), 16), mn),
            pairs)


# kind -> (bytes per block, sub-blocks per block, units)
KTYPES = {5: (84, 16, _kunits_q2_k), 6: (110, 16, _kunits_q3_k), 7: (144, 8, _kunits_q4_k), 8: (176, 8, _kunits_q5_k),
          9: (210, 16, _kunits_q6_k)}


def _kkernel(kind, nr=1, x8=False):
    """An intrinsic ``(w, n, gap, xq, xd, xs, x16, m0, mr, out, f16) -> None`` of a K-quant: out[m0 + i, n + r gap]
    = x[m0 + i] . W[n + r gap] for i < mr (1 to ``MR``), r < nr; ``x16`` the sums of x per 16 (``sums16``; read by
    the types of 16 sub-blocks). ``x8``: x's codes are 8-bit (``_quantize_into8``: the high bytes only, one byte dot
    product per 64 codes instead of two and a shift)."""
    ts, nsub, units = KTYPES[kind]

    @intrinsic
    def kernel(typingctx, w, n, gap, xq, xd, xs, x16, m0, mr_, out, f16):
        def codegen(context, builder, sig, args):
            wa, na, gapa, xqa, xda, xsa, x16a, m0a, mra, outa, f16a = args
            tw, _, _, txq, txd, txs, tx16, _, _, tout, tf16 = sig.args

            def arr(t, v):
                a = context.make_array(t)(context, builder, v)
                return builder.bitcast(a.data, I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides, t.ndim)

            wp, ws = arr(tw, wa)
            xqp, xqs = arr(txq, xqa)
            xdp, xds = arr(txd, xda)
            sums = arr(tx16, x16a) if nsub == 16 else arr(txs, xsa)
            outp, outs = arr(tout, outa)
            f16p = context.make_array(tf16)(context, builder, f16a).data
            nv, m0v = _i64(builder, na), _i64(builder, m0a)
            k_len = cgutils.unpack_tuple(builder, context.make_array(txq)(context, builder, xqa).shape, 2)[1]
            nblk = builder.sdiv(k_len, ir.Constant(I64, 512))  # xq holds 64 bytes per x-block, 8 per block
            done = builder.append_basic_block("done")
            cases = [builder.append_basic_block(f"mr{mr}") for mr in range(1, MR + 1)]
            switch = builder.switch(_i64(builder, mra), done)
            for mr, bb in zip(range(1, MR + 1), cases):
                switch.add_case(ir.Constant(I64, mr), bb)
                builder.position_at_end(bb)
                _kbody(builder, mr, ts, nsub, units, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, sums, outp, outs,
                       f16p, nr, _i64(builder, gapa), kind, x8)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(w, n, gap, xq, xd, xs, x16, m0, mr_, out, f16), codegen

    return kernel


def _kbody(builder, mr, ts, nsub, units, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, sums, outp, outs, f16p, nr, gap,
           kind, x8=False):
    """The IR of ``nr`` weight rows ``nv + r gap`` times ``mr`` rows of x of a K-quant (the x loads shared); x's
    codes in the type's pair order (``pair_layout``)."""
    sp, ss = sums
    wn = [builder.add(nv, builder.mul(gap, ir.Constant(I64, r))) for r in range(nr)]
    wrows = [builder.gep(wp, [builder.mul(wn[r], ws[0])]) for r in range(nr)]

    def rows_of(p, s):
        return [builder.gep(p, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), s[0])]) for i in range(mr)]

    xrow, drow, srow = rows_of(xqp, xqs), rows_of(xdp, xds), rows_of(sp, ss)
    slots = 4 if mr == 1 else 2  # independent FMA chains per output (4 products per block); not by nr: a row's
    # sums are the same whichever pass computes it (the threads' row ranges change which rows pair up)
    acc = [[[cgutils.alloca_once_value(builder, _c(FLT, 16, 0.0)) for _ in range(slots)] for _ in range(mr)]
           for _ in range(nr)]
    macc = [[cgutils.alloca_once_value(builder, _c(FLT, nsub, 0.0)) for _ in range(mr)] for _ in range(nr)]
    spread = ir.Constant(_v(I32, 16), [j // 2 for j in range(16)])  # the 8 steps of x onto 16 sub-blocks
    with cgutils.for_range(builder, nblk) as loop:
        b = loop.index
        o = builder.mul(b, ir.Constant(I64, ts))
        if PREFETCH:  # software prefetch of the block PREFETCH bytes ahead (every cache line of it)
            pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32,
                                                                                                 I32, I32]),
                                                "llvm.prefetch.p0")
            for r in range(nr):
                for line in range(0, ts, 64):
                    builder.call(pf, [builder.gep(wrows[r], [builder.add(o, ir.Constant(I64, PREFETCH + line))]),
                                      ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
        decoded = [units(builder, wrows[r], o, f16p) for r in range(nr)]
        xo = builder.mul(b, ir.Constant(I64, 512))
        for i in range(mr):
            dx = _ld(builder, drow[i], builder.mul(b, ir.Constant(I64, 32)), _v(FLT, 8))
            if nsub == 16:
                dx = builder.shuffle_vector(dx, ir.Constant(dx.type, ir.Undefined), spread)
            xsum = _ld(builder, srow[i], builder.mul(b, ir.Constant(I64, 4 * nsub)), _v(FLT, nsub))
            sx = []
            for r in range(nr):
                scale, coef, _ = decoded[r]
                sx.append(builder.fmul(scale, dx))
                builder.store(_fma(builder, coef, xsum, builder.load(macc[r][i])), macc[r][i])
            for p, (xa, xb, _) in enumerate(decoded[0][2]):
                assert (xa, xb) == KPAIRS[kind][p], (kind, p)  # the order ``pair_layout`` wrote x in
                # x in pair order (``pair_layout``): pair p's high bytes, then its low ones, 64 each
                xh = _ld(builder, xrow[i], builder.add(xo, ir.Constant(I64, 128 * p)), _v(I8, 64))
                xl = None if x8 else _ld(builder, xrow[i], builder.add(xo, ir.Constant(I64, 128 * p + 64)), _v(I8, 64))
                if nsub == 8:
                    idx = [xa] * 8 + [xb] * 8
                else:
                    idx = [2 * xa] * 4 + [2 * xa + 1] * 4 + [2 * xb] * 4 + [2 * xb + 1] * 4
                for r in range(nr):
                    q = decoded[r][2][p][2]
                    hi = _dpbusd64(builder, _c(I32, 16, 0), q, xh)
                    dot = hi if x8 else _dpbusd64(builder, builder.shl(hi, _c(I32, 16, 7)), q, xl)
                    sv = builder.shuffle_vector(sx[r], ir.Constant(sx[r].type, ir.Undefined),
                                                ir.Constant(_v(I32, 16), idx))
                    a_ = acc[r][i][p % slots]
                    builder.store(_fma(builder, builder.sitofp(dot, _v(FLT, 16)), sv, builder.load(a_)), a_)
    red16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLT, [FLT, _v(FLT, 16)]),
                                           "llvm.vector.reduce.fadd.v16f32")
    redm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLT, [FLT, _v(FLT, nsub)]),
                                          f"llvm.vector.reduce.fadd.v{nsub}f32")
    for i in range(mr):
        orow = builder.gep(outp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), outs[0])])
        for r in range(nr):
            vec = builder.load(acc[r][i][0])
            for slot in range(1, slots):
                vec = builder.fadd(vec, builder.load(acc[r][i][slot]))
            mins = builder.call(redm, [ir.Constant(FLT, 0.0), builder.load(macc[r][i])], fastmath=("reassoc",))
            total = builder.call(red16, [mins, vec], fastmath=("reassoc",))
            builder.store(total, _at(builder, orow, builder.mul(wn[r], outs[1]), FLT))


@_fast
def sums16(xq, xd, x16):
    """x16 (f32 [m, k / 16]): the step times the sum of the codes of each 16 elements of x (``quantize``'s xq)."""
    for m in range(xq.shape[0]):
        for s in range(xq.shape[1] // 32):
            b, h = divmod(s, 2)
            t = 0
            for j in range(16):
                t += np.int64(xq[m, b * 64 + h * 16 + j]) * 128 + np.int64(xq[m, b * 64 + 32 + h * 16 + j])
            x16[m, s] = xd[m, b] * F(t)


# kind -> the x-blocks (of 32) each 64-code vector of a super-block pairs, in the order the ``_kunits_*`` give them
KPAIRS = {5: ((0, 4), (1, 5), (2, 6), (3, 7)), 6: ((0, 4), (1, 5), (2, 6), (3, 7)),
          7: ((0, 2), (1, 3), (4, 6), (5, 7)), 8: ((0, 2), (1, 3), (4, 6), (5, 7)),
          9: ((0, 1), (2, 3), (4, 5), (6, 7))}


def _chunks(pairs) -> np.ndarray:
    """The 32-byte chunks of ``quantize``'s super-block (chunk 2 j: x-block j's high bytes, 2 j + 1 its low ones)
    in pair order: pair p's high bytes of both x-blocks, then their low bytes."""
    return np.array([c for a, b in pairs for c in (2 * a, 2 * b, 2 * a + 1, 2 * b + 1)], np.int64)


_ORDER5, _ORDER6, _ORDER7, _ORDER8, _ORDER9 = (_chunks(KPAIRS[k]) for k in (5, 6, 7, 8, 9))
_DEST5, _DEST6, _DEST7, _DEST8, _DEST9 = (np.argsort(o).astype(np.int64) for o in (_ORDER5, _ORDER6, _ORDER7,
                                                                                     _ORDER8, _ORDER9))


@_fast
def pair_layout(xq, order):
    """``quantize``'s xq with each super-block's 32-byte chunks in ``order`` (a K-quant's pair order), so that the
    64 high (or low) bytes of x its 64-code vectors take are one contiguous load, not two halves put together
    (16 instructions of ~130 per pass of the Q4_K loop). The runtime's products quantize into this order directly
    (``quant_product``)."""
    xp = np.empty_like(xq)
    for m in range(xq.shape[0]):
        for b in range(xq.shape[1] // 512):
            for c in range(16):
                src, dst = 512 * b + 32 * order[c], 512 * b + 32 * c
                for j in range(32):
                    xp[m, dst + j] = xq[m, src + j]
    return xp


KNR = 2  # weight rows per pass of the K-quant loops: rows n and n + half of the range (two long sequential streams,
# the x loads shared); adjacent rows (n, n + 1) made a short-stride pattern the prefetchers lost (2.5x slower)
_KK = {k: (_kkernel(k, 1), _kkernel(k, KNR)) for k in (5, 6, 7, 8, 9)}
_KK5, _KK6, _KK7, _KK8, _KK9 = (_KK[k][0] for k in (5, 6, 7, 8, 9))
_KP5, _KP6, _KP7, _KP8, _KP9 = (_KK[k][1] for k in (5, 6, 7, 8, 9))


# the K-quant loops on x in pair order (xp) with its sums per 16 (x16, read by the types of 16 sub-blocks; any
# f32 array for the others)
@_fast
def paired_q2_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KP5(packed, n0 + j, h, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KK5(packed, n, 0, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired_q3_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KP6(packed, n0 + j, h, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KK6(packed, n, 0, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired_q4_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KP7(packed, n0 + j, h, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KK7(packed, n, 0, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired_q5_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KP8(packed, n0 + j, h, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KK8(packed, n, 0, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired_q6_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KP9(packed, n0 + j, h, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KK9(packed, n, 0, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)


_KX = {k: (_kkernel(k, 1, True), _kkernel(k, KNR, True)) for k in (5, 6, 7, 8, 9)}  # 8-bit x (``X_BITS == 8``)
_KX5, _KX6, _KX7, _KX8, _KX9 = (_KX[k][0] for k in (5, 6, 7, 8, 9))
_KY5, _KY6, _KY7, _KY8, _KY9 = (_KX[k][1] for k in (5, 6, 7, 8, 9))


# the K-quant loops on 8-bit x (``_quantize_into8``)
@_fast
def paired8_q2_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KY5(packed, n0 + j, h, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KX5(packed, n, 0, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired8_q3_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KY6(packed, n0 + j, h, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KX6(packed, n, 0, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired8_q4_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KY7(packed, n0 + j, h, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KX7(packed, n, 0, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired8_q5_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KY8(packed, n0 + j, h, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KX8(packed, n, 0, xp, xd, xs, xs, m0, min(MR, xp.shape[0] - m0), out, f16)


@_fast
def paired8_q6_k(packed, xp, xd, xs, x16, out, n0, n1, f16):
    h = (n1 - n0) // KNR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _KY9(packed, n0 + j, h, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)
    for n in range(n0 + h * KNR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _KX9(packed, n, 0, xp, xd, xs, x16, m0, min(MR, xp.shape[0] - m0), out, f16)


# the products on ``quantize``'s x (tests, benchmarks): its sums per 16 and its pair order made here, per call
@_fast
def product_q2_k(packed, xq, xd, xs, out, n0, n1, f16):
    x16 = np.empty((xq.shape[0], xq.shape[1] // 32), np.float32)
    sums16(xq, xd, x16)
    paired_q2_k(packed, pair_layout(xq, _ORDER5), xd, xs, x16, out, n0, n1, f16)


@_fast
def product_q3_k(packed, xq, xd, xs, out, n0, n1, f16):
    x16 = np.empty((xq.shape[0], xq.shape[1] // 32), np.float32)
    sums16(xq, xd, x16)
    paired_q3_k(packed, pair_layout(xq, _ORDER6), xd, xs, x16, out, n0, n1, f16)


@_fast
def product_q4_k(packed, xq, xd, xs, out, n0, n1, f16):
    paired_q4_k(packed, pair_layout(xq, _ORDER7), xd, xs, xs, out, n0, n1, f16)


@_fast
def product_q5_k(packed, xq, xd, xs, out, n0, n1, f16):
    paired_q5_k(packed, pair_layout(xq, _ORDER8), xd, xs, xs, out, n0, n1, f16)


@_fast
def product_q6_k(packed, xq, xd, xs, out, n0, n1, f16):
    x16 = np.empty((xq.shape[0], xq.shape[1] // 32), np.float32)
    sums16(xq, xd, x16)
    paired_q6_k(packed, pair_layout(xq, _ORDER9), xd, xs, x16, out, n0, n1, f16)


# ---- Q8_0, two blocks per 512-bit vector -------------------------------------------------------------------------
# A Q8_0 block is 34 bytes (f16 d, 32 int8 codes): two blocks' codes are one <64 x i8> (two unaligned 32-byte loads)
# and are made unsigned by flipping their top bit (q + 128, one xor; llama.cpp's |q| and sign trick took three
# operations per 32 codes); x is in pair order (``_quantize_q8_0``: the high bytes of x-blocks 2 j and 2 j + 1, then
# their low bytes, 64 each), and the 128 sum(v) the flip adds is taken off inside the integer dot: its high-byte
# part starts from -sum(v) of each x-block (xs holds -sum(v) as int32; lane 0 of each block's 8 lanes, the others 0),
# so (init + (q + 128) . xh) 128 + (q + 128) . xl = q . v exactly in int32 (|.| < 2**28). Each block's f16 d is
# loaded as an i32 (no merge into a register: a ``vpinsrw`` chain through one register serialised the old loop's
# scale conversions across blocks). An odd last block takes the same steps on 256 bits.
def _q8_kernel(nr):
    """An intrinsic ``(w, n, gap, xp, xd, xi, m0, mr, out) -> None``: out[m0 + i, n + r gap] = x[m0 + i] .
    W[n + r gap] for i < mr (1 to ``MR``), r < nr, x as ``_quantize_q8_0`` wrote it (xi: xs viewed as int32)."""

    @intrinsic
    def kernel(typingctx, w, n, gap, xp, xd, xi, m0, mr_, out):
        def codegen(context, builder, sig, args):
            wa, na, gapa, xpa, xda, xia, m0a, mra, outa = args
            tw, _, _, txp, txd, txi, _, _, tout = sig.args

            def arr(t, v):
                a = context.make_array(t)(context, builder, v)
                return builder.bitcast(a.data, I8.as_pointer()), cgutils.unpack_tuple(builder, a.strides, t.ndim)

            wp, ws = arr(tw, wa)
            xqp, xqs = arr(txp, xpa)
            xdp, xds = arr(txd, xda)
            xip, xis = arr(txi, xia)
            outp, outs = arr(tout, outa)
            nv, m0v = _i64(builder, na), _i64(builder, m0a)
            k_len = cgutils.unpack_tuple(builder, context.make_array(txp)(context, builder, xpa).shape, 2)[1]
            nblk = builder.sdiv(k_len, ir.Constant(I64, 64))  # 64 bytes of xp per block
            done = builder.append_basic_block("done")
            cases = [builder.append_basic_block(f"mr{mr}") for mr in range(1, MR + 1)]
            switch = builder.switch(_i64(builder, mra), done)
            for mr, bb in zip(range(1, MR + 1), cases):
                switch.add_case(ir.Constant(I64, mr), bb)
                builder.position_at_end(bb)
                _q8_body(builder, mr, nr, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, xip, xis, outp, outs,
                         _i64(builder, gapa))
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(w, n, gap, xp, xd, xi, m0, mr_, out), codegen

    return kernel


def _f16s(builder, w, offs):
    """The f16 at each byte offset of ``offs`` in w, as a <len x float> (each loaded as the low half of an i32 -
    the byte after a block's d is its first code: never past the row - and converted together, ``vcvtph2ps``)."""
    n = len(offs)
    vec = ir.Constant(_v(I32, n), [0] * n)
    for j, off in enumerate(offs):
        vec = builder.insert_element(vec, _ld(builder, w, off, I32), ir.Constant(I32, j))
    halves = builder.shuffle_vector(builder.bitcast(vec, _v(I16, 2 * n)), ir.Constant(_v(I16, 2 * n), ir.Undefined),
                                    ir.Constant(_v(I32, n), list(range(0, 2 * n, 2))))
    return builder.fpext(builder.bitcast(halves, _v(ir.HalfType(), n)), _v(FLT, n))


def _q8_body(builder, mr, nr, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, xip, xis, outp, outs, gap):
    wn = [builder.add(nv, builder.mul(gap, ir.Constant(I64, r))) for r in range(nr)]
    wrows = [builder.gep(wp, [builder.mul(wn[r], ws[0])]) for r in range(nr)]

    def rows_of(p, s):
        return [builder.gep(p, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), s[0])]) for i in range(mr)]

    xrow, drow, irow = rows_of(xqp, xqs), rows_of(xdp, xds), rows_of(xip, xis)
    slots = 2 if mr == 1 else 1  # independent FMA chains per output (two pairs of blocks per loop iteration)
    acc = [[[cgutils.alloca_once_value(builder, _c(FLT, 16, 0.0)) for _ in range(slots)] for _ in range(mr)]
           for _ in range(nr)]
    tail = [[cgutils.alloca_once_value(builder, _c(FLT, 8, 0.0)) for _ in range(mr)] for _ in range(nr)]
    flip64, flip32 = _c(I8, 64, -128), _c(I8, 32, -128)
    spread = ir.Constant(_v(I32, 16), [0] * 8 + [1] * 8)
    init_at = ir.Constant(_v(I32, 16), [0] + [2] * 7 + [1] + [2] * 7)  # element 2: the zero vector's

    def pairs(j, slot):  # blocks 2 j and 2 j + 1
        o = builder.mul(j, ir.Constant(I64, 68))
        q, sc = [], []
        for r in range(nr):
            a = _ld(builder, wrows[r], builder.add(o, ir.Constant(I64, 2)), _v(I8, 32))
            b = _ld(builder, wrows[r], builder.add(o, ir.Constant(I64, 36)), _v(I8, 32))
            q.append(builder.xor(_cat(builder, a, b), flip64) if _Q8_FLIP else _cat(builder, a, b))
            sc.append(_f16s(builder, wrows[r], [o, builder.add(o, ir.Constant(I64, 34))]))
        xo = builder.mul(j, ir.Constant(I64, 128))
        for i in range(mr):
            xh = _ld(builder, xrow[i], xo, _v(I8, 64))
            xl = _ld(builder, xrow[i], builder.add(xo, ir.Constant(I64, 64)), _v(I8, 64))
            dx = _ld(builder, drow[i], builder.mul(j, ir.Constant(I64, 8)), _v(FLT, 2))
            init = builder.shuffle_vector(_ld(builder, irow[i], builder.mul(j, ir.Constant(I64, 8)), _v(I32, 2)),
                                          ir.Constant(_v(I32, 2), [0, 0]), init_at)
            for r in range(nr):
                if _Q8_FLIP:
                    hi = _dpbusd64(builder, init, q[r], xh)
                    dot = _dpbusd64(builder, builder.shl(hi, _c(I32, 16, 7)), q[r], xl)
                else:  # AVX2's pmaddubsw (int16 pair sums): the sign trick per 256-bit half
                    dot = _cat(builder, *(_dot(builder, _half_of(builder, q[r], h), True, _half_of(builder, xh, h),
                                               _half_of(builder, xl, h)) for h in range(2)))
                sv = builder.shuffle_vector(builder.fmul(sc[r], dx), ir.Constant(_v(FLT, 2), ir.Undefined), spread)
                a_ = acc[r][i][slot]
                builder.store(_fma(builder, builder.sitofp(dot, _v(FLT, 16)), sv, builder.load(a_)), a_)

    npair = builder.sdiv(nblk, ir.Constant(I64, 2))
    two = builder.sdiv(npair, ir.Constant(I64, slots))
    with cgutils.for_range(builder, two) as loop:
        for s in range(slots):
            pairs(builder.add(builder.mul(loop.index, ir.Constant(I64, slots)), ir.Constant(I64, s)), s)
    if slots > 1:
        with cgutils.for_range(builder, npair, start=builder.mul(two, ir.Constant(I64, slots))) as loop:
            pairs(loop.index, 0)
    with cgutils.for_range(builder, nblk, start=builder.mul(npair, ir.Constant(I64, 2))) as loop:  # odd last block
        b = loop.index
        o = builder.mul(b, ir.Constant(I64, 34))
        xo = builder.mul(b, ir.Constant(I64, 64))
        for i in range(mr):
            xh = _ld(builder, xrow[i], xo, _v(I8, 32))
            xl = _ld(builder, xrow[i], builder.add(xo, ir.Constant(I64, 32)), _v(I8, 32))
            dx = _ld(builder, drow[i], builder.mul(b, ir.Constant(I64, 4)), FLT)
            s0 = _ld(builder, irow[i], builder.mul(b, ir.Constant(I64, 4)), I32)
            init = builder.insert_element(ir.Constant(_v(I32, 8), [0] * 8), s0, ir.Constant(I32, 0))
            for r in range(nr):
                q = _ld(builder, wrows[r], builder.add(o, ir.Constant(I64, 2)), _v(I8, 32))
                d = builder.extract_element(_f16s(builder, wrows[r], [o]), ir.Constant(I32, 0))
                if _Q8_FLIP:
                    hi = _dpbusd(builder, init, builder.xor(q, flip32), xh)
                    dot = _dpbusd(builder, builder.shl(hi, _c(I32, 8, 7)), builder.xor(q, flip32), xl)
                else:
                    dot = _dot(builder, q, True, xh, xl)
                t_ = tail[r][i]
                builder.store(_fma(builder, builder.sitofp(dot, _v(FLT, 8)), _splat(builder, builder.fmul(d, dx), 8),
                                   builder.load(t_)), t_)
    red16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLT, [FLT, _v(FLT, 16)]),
                                           "llvm.vector.reduce.fadd.v16f32")
    red8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLT, [FLT, _v(FLT, 8)]),
                                          "llvm.vector.reduce.fadd.v8f32")
    for i in range(mr):
        orow = builder.gep(outp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), outs[0])])
        for r in range(nr):
            vec = builder.load(acc[r][i][0])
            for slot in range(1, slots):
                vec = builder.fadd(vec, builder.load(acc[r][i][slot]))
            t = builder.call(red8, [ir.Constant(FLT, 0.0), builder.load(tail[r][i])], fastmath=("reassoc",))
            total = builder.call(red16, [t, vec], fastmath=("reassoc",))
            builder.store(total, _at(builder, orow, builder.mul(wn[r], outs[1]), FLT))


_Q8_1, _Q8_2 = _q8_kernel(1), _q8_kernel(NR)
_Q8_FLIP = _VNNI is not None or not _AVX2  # the flipped codes reach 255: exact in vpdpbusd (int32 sums) and the
# generic IR, not in AVX2's pmaddubsw (pairs summed to int16 with saturation: 2 * 255 * 127 > 32767), which keeps
# llama.cpp's |q| and sign-of-x trick (|q| <= 128: 2 * 128 * 127 fits)


@_fast
def _quantize_q8_0(x, xq, xd, xs):
    """``quantize`` for the Q8_0 loops: the same codes, in pair order (x-blocks 2 j and 2 j + 1: their high bytes,
    then their low bytes, 64 each, at 128 j; an odd last block as ``quantize`` writes it), xd the steps, and xs
    (f32 [m, k / 32], written as int32) -sum(v) per x-block."""
    xi = x.view(np.int32)
    xsi = xs.view(np.int32)
    buf = np.empty(1, np.int32)
    fbuf = buf.view(np.float32)
    nb = x.shape[1] // 32
    full = nb - nb % 2
    for m in range(x.shape[0]):
        for b in range(nb):
            bits = np.int32(0)
            for j in range(32):
                bits = max(bits, xi[m, b * 32 + j] & np.int32(0x7FFFFFFF))
            buf[0] = bits
            d = fbuf[0] / F(QMAX)
            inv = F(1.0) / d if d > F(0.0) else F(0.0)
            if b < full:
                h0 = 128 * (b // 2) + 32 * (b % 2)
                l0 = h0 + 64
            else:
                h0 = 64 * b
                l0 = h0 + 32
            hi = xq[m, h0:h0 + 32]
            lo = xq[m, l0:l0 + 32]
            xr = x[m, b * 32:b * 32 + 32]
            t = np.int32(0)
            for j in range(32):
                t += min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256))
            for j in range(32):
                hi[j] = np.int8(min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256)) >> 7)
            for j in range(32):
                lo[j] = np.int8(min(max(np.int32(np.rint(xr[j] * inv)), np.int32(-16256)), np.int32(16256)) & 127)
            xd[m, b] = d
            xsi[m, b] = -t


@_fast
def paired_q8_0(packed, xp, xd, xs, out, n0, n1):
    """Q8_0 rows n0..n1 - 1 on ``_quantize_q8_0``'s x: NR rows far apart per pass, ``MR`` rows of x per call."""
    xi = xs.view(np.int32)
    h = (n1 - n0) // NR
    for j in range(h):
        for m0 in range(0, xp.shape[0], MR):
            _Q8_2(packed, n0 + j, h, xp, xd, xi, m0, min(MR, xp.shape[0] - m0), out)
    for n in range(n0 + h * NR, n1):
        for m0 in range(0, xp.shape[0], MR):
            _Q8_1(packed, n, 0, xp, xd, xi, m0, min(MR, xp.shape[0] - m0), out)


@_fast
def _pairs_q8_0(xq):
    """``quantize``'s xq in ``_quantize_q8_0``'s order, and -sum(v) per x-block (int32)."""
    m, nb = xq.shape[0], xq.shape[1] // 64
    xp = np.empty_like(xq)
    xi = np.empty((m, nb), np.int32)
    full = nb - nb % 2
    for i in range(m):
        for b in range(nb):
            h0 = 128 * (b // 2) + 32 * (b % 2) if b < full else 64 * b
            l0 = h0 + 64 if b < full else h0 + 32
            t = np.int32(0)
            for j in range(32):
                hv, lv = xq[i, 64 * b + j], xq[i, 64 * b + 32 + j]
                xp[i, h0 + j] = hv
                xp[i, l0 + j] = lv
                t += np.int32(hv) * np.int32(128) + np.int32(lv)
            xi[i, b] = -t
    return xp, xi



@_fast
def quant_product(x, xq, xd, xs, x16, packed, out, n0, n1, kind, f16):
    """What the runtime's product step calls on every thread: x rounded into this part's own xq, xd, xs (and
    x16 - f32 [m, k / 16] - for the K-quants of 16 sub-blocks), in the type's order, then output rows n0..n1 - 1.
    Each thread rounding x itself (the same codes on every thread: a few microseconds) makes a product one phase
    of a chain: no barrier between the rounding and the product, none waiting on one thread's rounding."""
    if kind == 7:
        _quantize_into(x, xq, xd, xs, x16, _DEST7, False)
        paired_q4_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 9:
        _quantize_into(x, xq, xd, xs, x16, _DEST9, True)
        paired_q6_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 8:
        _quantize_into(x, xq, xd, xs, x16, _DEST8, False)
        paired_q5_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 6:
        _quantize_into(x, xq, xd, xs, x16, _DEST6, True)
        paired_q3_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 5:
        _quantize_into(x, xq, xd, xs, x16, _DEST5, True)
        paired_q2_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 4:
        _quantize_q8_0(x, xq, xd, xs)
        paired_q8_0(packed, xq, xd, xs, out, n0, n1)
    else:
        quantize(x, xq, xd, xs)
        if kind == 0:
            product_q4_0(packed, xq, xd, xs, out, n0, n1, f16)
        else:
            product_q4_1(packed, xq, xd, xs, out, n0, n1, f16)


@_fast
def quant_product_x8(x, xq, xd, xs, x16, packed, out, n0, n1, kind, f16):
    """``quant_product`` with the K-quants' x rounded to 8 bits per block of 32 (``X_BITS == 8``: one byte dot
    product per 64 codes, ~15% faster loops; x moved by up to max|x_block| / 254 per element instead of / 32512,
    llama.cpp's precision); the other types as ``quant_product``."""
    if kind == 7:
        _quantize_into8(x, xq, xd, xs, x16, _DEST7, False)
        paired8_q4_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 9:
        _quantize_into8(x, xq, xd, xs, x16, _DEST9, True)
        paired8_q6_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 8:
        _quantize_into8(x, xq, xd, xs, x16, _DEST8, False)
        paired8_q5_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 6:
        _quantize_into8(x, xq, xd, xs, x16, _DEST6, True)
        paired8_q3_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    elif kind == 5:
        _quantize_into8(x, xq, xd, xs, x16, _DEST5, True)
        paired8_q2_k(packed, xq, xd, xs, x16, out, n0, n1, f16)
    else:
        quant_product15(x, xq, xd, xs, x16, packed, out, n0, n1, kind, f16)


X_BITS_ENV = "LUMINAL_RECIPES_GGUF_X_BITS"


def x_bits() -> int:
    """The bits x is rounded to in the K-quants' products: 15 (default: within 1/32512 of each block's max) or 8
    (``LUMINAL_RECIPES_GGUF_X_BITS=8``: faster, llama.cpp's precision; the greedy ids of a random-weight model may
    flip against the dense run)."""
    from luminal_recipes.errors import QuantizationError

    value = os.environ.get(X_BITS_ENV, "").strip() or "15"
    if value not in ("8", "15"):
        raise QuantizationError(f"{X_BITS_ENV}={value!r}: the bits x is rounded to in the GGUF K-quant products "
                                f"are 15 (the default) or 8; set one of these or unset it")
    return int(value)


quant_product15 = quant_product  # the runtime calls ``quant_product``: the one ``x_bits()`` chose at import
quant_product = quant_product_x8 if x_bits() == 8 else quant_product15


# kind (gguf_kernels.KINDS) -> its product ``(packed, xq, xd, xs, out, n0, n1, f16)``; a type added here needs
# its block layout in TYPES (``_units_*``) or KTYPES (``_kunits_*``) and an entry in KINDS
PRODUCTS = {0: product_q4_0, 1: product_q4_1, 4: product_q8_0, 5: product_q2_k, 6: product_q3_k, 7: product_q4_k,
            8: product_q5_k, 9: product_q6_k}
