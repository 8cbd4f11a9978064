"""GGUF products with x rounded to integers and integer dot products, in the manner of llama.cpp
(``ggml_vec_dot_q4_1_q8_1`` and kin): each block of 32 elements of x becomes ``d * v`` with integers |v| <= 16256
(``d = max|x| / 16256``), rounded ONCE per product (``quantize``) and reused by every weight row. ``v`` is stored as
two bytes, ``v = 128 hi + lo`` (hi in [-127, 127], lo in [0, 127]), so that a weight block's byte codes are
multiplied with it by two byte dot products (``vpdpbusd``, AVX512-VNNI: 4 pairs summed into each int32 lane; on
AVX2 ``pmaddubsw`` + ``pmaddwd``; generic vector IR elsewhere), ``128 * dot(q, hi) + dot(q, lo)``, exact in int32.
Signed codes (Q8_0, Q6_K) go through llama.cpp's trick: ``|q|`` times x carrying q's sign. The 8 int32 lanes are
converted to f32 and accumulated with one fused multiply-add by the block's scale ``d_w * d_x`` (a vector of scales
for Q6_K's sub-blocks of 16) into vector accumulators, several in turn (independent FMA chains); the minimum /
offset terms (Q4_0's ``-8``, the ``m`` of Q4_1 and Q4_K) multiply the sum of the rounded x of the block (``xs``),
as llama.cpp's q8_1 blocks do. The accumulators are summed once per output.

The block loops are LLVM IR (``_kernel``: one intrinsic per type; ``_units_*`` decode a block into byte codes and
scales). Each call computes one weight row against 1-4 rows of x (``MR``, 4 accumulators' worth); more rows of x (a
small batch: prefill) take the same row again, which is in L1 by then: the weight is read from memory once per
product and decoded once per 4 rows of x (compute-bound: ~45-55 GFLOP/s per Zen 4 core with 8-64 rows). One weight
row per pass: several rows at once (x loads shared) made several short streams that the hardware prefetchers
followed worse (measured 2x slower out of cache).

Why two bytes and not llama.cpp's one: 8-bit x flipped greedy ids of a random-weight test model against the dense
run; the second byte costs one more byte dot product per block (x stays in L1; the weight's bytes dominate).

Numerics (tests/TOLERANCES.md, family ``xint15``): the result is the product of the exactly dequantized weight with
x rounded per block of 32 (each element moved by at most ``max|x_block| / 32512``), up to f32 rounding of the
per-block scales and of the f32 accumulation.
"""

from __future__ import annotations

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
KINDS = (0, 1, 4, 7, 9)  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
NR = 1  # weight rows per pass: one sequential stream (several rows at once defeated the hardware prefetchers)
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
    """The f16 at byte ``off`` of ``base`` as f32 (through the exact table)."""
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


def _units_q8_0(builder, w, o, f16):
    d = _h(builder, w, o, f16)
    return [(0, _ld(builder, w, builder.add(o, ir.Constant(I64, 2)), _v(I8, 32)), True, d, None)]


def _units_q4_k(builder, w, o, f16):
    """8 sub-blocks of 32: d * sc_j * sum(x q) - dmin * mn_j * sum(x); 6-bit scales and mins packed in 12 bytes."""
    def byte(i):
        return builder.zext(_ld(builder, w, builder.add(o, ir.Constant(I64, i)), I8), I32)

    def k32(v):
        return ir.Constant(I32, v)

    d = _h(builder, w, o, f16)
    dmin = _h(builder, w, builder.add(o, ir.Constant(I64, 2)), f16)
    out = []
    for j in range(8):
        if j < 4:
            sc = builder.and_(byte(4 + j), k32(63))
            mn = builder.and_(byte(8 + j), k32(63))
        else:
            md = byte(12 + j - 4)
            sc = builder.or_(builder.and_(md, k32(15)), builder.and_(builder.lshr(byte(4 + j - 4), k32(2)), k32(0x30)))
            mn = builder.or_(builder.lshr(md, k32(4)), builder.and_(builder.lshr(byte(4 + j), k32(2)), k32(0x30)))
        g, half = divmod(j, 2)
        wv = _ld(builder, w, builder.add(o, ir.Constant(I64, 16 + 32 * g)), _v(I8, 32))
        q = builder.and_(builder.lshr(wv, _c(I8, 32, 4)), _c(I8, 32, 15)) if half else builder.and_(wv, _c(I8, 32, 15))
        a = builder.fmul(d, builder.uitofp(sc, FLT))
        c = builder.fneg(builder.fmul(dmin, builder.uitofp(mn, FLT)))
        out.append((j, q, False, a, c))
    return out


def _units_q6_k(builder, w, o, f16):
    """16 sub-blocks of 16 (two per x-block of 32): d * sc * sum(x (q - 32)), q = low 4 bits | high 2 bits << 4."""
    d = _h(builder, w, builder.add(o, ir.Constant(I64, 208)), f16)
    out = []
    for h in range(2):
        hv = _ld(builder, w, builder.add(o, ir.Constant(I64, 128 + 32 * h)), _v(I8, 32))
        for t in range(4):  # the four 32-runs of this half: ql +0/+32, low/high nibble
            lv = _ld(builder, w, builder.add(o, ir.Constant(I64, 64 * h + (32 if t % 2 else 0))), _v(I8, 32))
            low = builder.and_(builder.lshr(lv, _c(I8, 32, 4 if t >= 2 else 0)), _c(I8, 32, 15))
            high = builder.and_(builder.lshr(hv, _c(I8, 32, 2 * t)), _c(I8, 32, 3))
            q = builder.sub(builder.or_(low, builder.shl(high, _c(I8, 32, 4))), _c(I8, 32, 32))
            scs = []
            for part in range(2):
                s = _ld(builder, w, builder.add(o, ir.Constant(I64, 192 + h * 8 + 2 * t + part)), I8)
                scs.append(_splat(builder, builder.fmul(d, builder.sitofp(s, FLT)), 4))
            scale = builder.shuffle_vector(scs[0], scs[1], ir.Constant(_v(I32, 8), list(range(8))))
            out.append((h * 4 + t, q, True, scale, None))
    return out


# kind -> (bytes per block, x-blocks of 32 per block, units)
TYPES = {0: (18, 1, _units_q4(0)), 1: (20, 1, _units_q4(1)), 4: (34, 1, _units_q8_0), 7: (144, 8, _units_q4_k),
         9: (210, 8, _units_q6_k)}


def _kernel(kind):
    """An intrinsic ``(w, n, xq, xd, xs, m0, mr, out, f16) -> None``: out[m0 + i, n] = x[m0 + i] . W[n] for
    i < mr (1 to ``MR``), over the whole row (the x arrays given as ``quantize`` made them)."""
    ts, per, units = TYPES[kind]
    nr = NR

    @intrinsic
    def kernel(typingctx, w, n, xq, xd, xs, m0, mr_, out, f16):
        def codegen(context, builder, sig, args):
            wa, na, xqa, xda, xsa, m0a, mra, outa, f16a = args
            tw, _, txq, txd, txs, _, _, tout, tf16 = sig.args

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
                      f16p)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(w, n, xq, xd, xs, m0, mr_, out, f16), codegen

    return kernel


def _body(builder, mr, nr, per, ts, units, nv, m0v, nblk, wp, ws, xqp, xqs, xdp, xds, xsp, xss, outp, outs, f16p):
    """The IR of one pass: ``nr`` weight rows from ``nv`` times ``mr`` rows of x from ``m0v``, stored in out."""
    rows = [builder.gep(wp, [builder.mul(builder.add(nv, ir.Constant(I64, r)), ws[0])]) for r in range(nr)]
    xrow = [builder.gep(xqp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), xqs[0])]) for i in range(mr)]
    drow = [builder.gep(xdp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), xds[0])]) for i in range(mr)]
    srow = [builder.gep(xsp, [builder.mul(builder.add(m0v, ir.Constant(I64, i)), xss[0])]) for i in range(mr)]
    # ``slots`` accumulators per output, used in turn by successive x-blocks: independent chains of
    # fused multiply-adds (one chain would wait the FMA's latency every x-block)
    slots = max(1, 4 // (nr * mr))
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
            off = builder.mul(builder.add(nv, ir.Constant(I64, r)), outs[1])
            builder.store(total, _at(builder, orow, off, FLT))


_K0, _K1, _K4, _K7, _K9 = (_kernel(k) for k in KINDS)


# one compiled product per type (module-level, so that numba caches them on disk): every weight row n0..n1-1
# once, ``MR`` rows of x at a time (the row stays in L1 between the passes)
@_fast
def product_q4_0(packed, xq, xd, xs, out, n0, n1, f16):
    for n in range(n0, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K0(packed, n, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


@_fast
def product_q4_1(packed, xq, xd, xs, out, n0, n1, f16):
    for n in range(n0, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K1(packed, n, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


@_fast
def product_q8_0(packed, xq, xd, xs, out, n0, n1, f16):
    for n in range(n0, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K4(packed, n, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


@_fast
def product_q4_k(packed, xq, xd, xs, out, n0, n1, f16):
    for n in range(n0, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K7(packed, n, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


@_fast
def product_q6_k(packed, xq, xd, xs, out, n0, n1, f16):
    for n in range(n0, n1):
        for m0 in range(0, xq.shape[0], MR):
            _K9(packed, n, xq, xd, xs, m0, min(MR, xq.shape[0] - m0), out, f16)


# kind (gguf_kernels.KINDS) -> its product ``(packed, xq, xd, xs, out, n0, n1, f16)``; a type added here needs
# its block layout in TYPES (``_units_*``) and an entry in KINDS
PRODUCTS = {0: product_q4_0, 1: product_q4_1, 4: product_q8_0, 7: product_q4_k, 9: product_q6_k}


def product(kind):
    """The compiled product of one type."""
    return PRODUCTS[kind]


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


def matmul_q8(packed, xq, xd, xs, out, n0, n1, kind, f16):
    """out[m, n] = x[m] @ dequant(packed[n]) for n0 <= n < n1, x given as ``quantize`` made it (C-contiguous
    arrays: xq int8 [m, 2 k], xd and xs f32 [m, k / 32])."""
    product(kind)(packed, xq, xd, xs, out, n0, n1, f16)
