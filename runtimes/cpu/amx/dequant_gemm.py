"""The kernels of ``runtimes/cpu/amx/dequant.py`` (numba, AMX intrinsics): the three-product tile block, the decoding
of a weight block into VNNI words, and the per-part product. Imported only where numba is installed and AMX runs
(``amx.dequant`` asks first)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..jit.disk_cache import install as _install_cache_locator
from .gemm import (
    _I64,
    _PTR,
    BLOCK,
    _amx,
    _kernel,
    _load_f32,
    _release,
    _tile,
    begin_k_loop,
    configure,
    end_k_loop,
    open_accumulators,
    pack_a,
)
from .gemm import _transpose16 as transpose16

_install_cache_locator()  # before the kernels: their cache goes stale with amx.gemm's helpers

# how the kernel reads the weight (``dequant_gemm``'s ``fmt``)
FP8, FP8_INF, NVFP4, NVFP4_TILED, FP8_E4M3 = 0, 1, 2, 3, 4


# ---- tile products ----------------------------------------------------------------------------------------
def _block_intrinsic(rows: int):
    def block(typingctx, a, a_row, a_part, b, steps, c, c_row, accumulate):
        """C[rows, 32] (f32, rows ``c_row`` bytes apart) = (C if ``accumulate`` else 0) + the sum over ``steps``
        k steps of 32 of A's three parts (tiles at ``a``: rows ``a_row`` bytes apart, parts ``a_part`` apart)
        times one VNNI panel of B at ``b`` (loaded once per step). ``rows``: 32, or 16 (half the products, for
        one short panel of x)."""
        sig = types.none(*([types.intp] * 8))

        def codegen(context, builder, signature, args):
            a, a_row, a_part, b, steps, c, c_row, accumulate = args
            c_tiles = open_accumulators(builder, c, c_row, accumulate, 4 if rows == 32 else 2)
            s, loop_state = begin_k_loop(builder, steps)
            a_s = builder.add(a, builder.mul(s, ir.Constant(_I64, 2 * BLOCK)))  # 32 bf16 along k
            b_s = builder.add(b, builder.mul(s, ir.Constant(_I64, 16 * BLOCK * 4)))  # 16 k pairs x 32 columns
            a_half = builder.mul(a_row, ir.Constant(_I64, 16))
            panel_row = ir.Constant(_I64, BLOCK * 4)
            _amx(builder, "tileloadd64", _tile(6), builder.inttoptr(b_s, _PTR), panel_row)
            _amx(builder, "tileloadd64", _tile(7), builder.inttoptr(builder.add(b_s, ir.Constant(_I64, 64)), _PTR),
                 panel_row)
            for part in range(3):
                a_p = builder.add(a_s, builder.mul(a_part, ir.Constant(_I64, part)))
                _amx(builder, "tileloadd64", _tile(4), builder.inttoptr(a_p, _PTR), a_row)
                pairs = ((4, 6), (4, 7))
                if rows == 32:
                    _amx(builder, "tileloadd64", _tile(5), builder.inttoptr(builder.add(a_p, a_half), _PTR), a_row)
                    pairs += ((5, 6), (5, 7))
                for t, (ta, tb) in enumerate(pairs):
                    _amx(builder, "tdpbf16ps", _tile(t), _tile(ta), _tile(tb))
            end_k_loop(builder, loop_state, c_tiles, c_row)
            return context.get_dummy_value()

        return sig, codegen

    block.__name__ = block.__qualname__ = f"_block3_rows{rows}"
    return intrinsic(block)


_block32 = _block_intrinsic(32)
_block16 = _block_intrinsic(16)


def _loader(bits: int):
    def load(typingctx, address):
        sig = types.intp(types.intp)

        def codegen(context, builder, signature, args):
            value = builder.load(builder.inttoptr(args[0], ir.IntType(bits).as_pointer()), align=1)
            return builder.zext(value, _I64)

        return sig, codegen

    load.__name__ = load.__qualname__ = f"_load_u{bits}"
    return intrinsic(load)


_load_u8 = _loader(8)
_load_u16 = _loader(16)
_load_u64 = _loader(64)


# ---- the kernel -------------------------------------------------------------------------------------------
@_kernel
def decode_block(fmt, table, w, w_rs, s, s_rs, s_cb, n_rows, k, k0, k1, j0, j1, out):
    """Columns ``j0:j1`` x k ``k0:k1`` of the weight decoded into ``out`` [panels, kc / 2, 32] (uint32 VNNI words,
    bf16 pairs): zero past ``k1`` and past the weight's ``n_rows`` rows. ``w``: the packed rows' address, ``w_rs``
    bytes apart (fp8: a byte per element; NVFP4: a byte per k pair); ``s``: NVFP4's scale bytes (``s_rs`` bytes a
    row, or in comfy's 128 x 4 tiles with ``s_cb`` tiles a row). Returns 1 if a weight is infinite (``FP8_INF``)."""
    bad = 0
    pairs = (k1 - k0 + 1) // 2
    p0 = k0 // 2
    half = out.shape[1]
    odd = k % 2 == 1 and k1 == k  # fp8 with an odd K: the last pair has one element
    whole = pairs - 1 if odd else pairs
    # fp8 e4m3fn: whole groups of 16 columns x 16 k pairs decoded and transposed in registers (``_e4m3_tile``)
    jv, pv = j0, 0
    if fmt == FP8_E4M3:
        jv = j0 + (min(j1, n_rows) - j0) // 16 * 16
        pv = whole // 16 * 16
        for jg in range(j0, jv, 16):
            at = out[(jg - j0) // BLOCK].ctypes.data + (jg - j0) % BLOCK * 4
            for pg in range(0, pv, 16):
                _e4m3_tile(w + jg * w_rs + k0 + 2 * pg, w_rs, at + pg * BLOCK * 4)
    for j in range(j0, j1):
        q, col = (j - j0) // BLOCK, (j - j0) % BLOCK
        panel = out[q]
        if j >= n_rows:
            for p in range(half):
                panel[p, col] = 0
            continue
        row = w + j * w_rs
        if fmt in (NVFP4, NVFP4_TILED):  # a block of 16 elements (8 bytes, one scale) at a time
            # (k0 is a multiple of 16); comfy: logical scale (row j, block b) in 128 x 4 tile (j >> 7, b >> 2),
            # at row j & 31, column ((j >> 5) & 3) * 4 + (b & 3)
            srow = s + j * s_rs
            stile = s + (j >> 7) * s_cb * 512 + (j & 31) * 16 + ((j >> 5) & 3) * 4
            for b in range(pairs >> 3):
                g = (p0 >> 3) + b
                at = srow + g if fmt == NVFP4 else stile + (g >> 2) * 512 + (g & 3)
                scale = _load_u8(at) << 8
                codes = _load_u64(row + p0 + 8 * b)
                for e in range(8):
                    panel[8 * b + e, col] = table[scale | ((codes >> (8 * e)) & 255)]
        else:
            start = pv if j < jv else 0  # pairs already decoded in registers
            for b in range(start >> 2, whole >> 2):  # 8 bytes at a time: four pairs
                codes = _load_u64(row + k0 + 8 * b)
                for e in range(4):
                    panel[4 * b + e, col] = table[(codes >> (16 * e)) & 255] | (
                        table[(codes >> (16 * e + 8)) & 255] << 16)
            for p in range(max(start, whole & ~3), whole):
                at = row + k0 + 2 * p
                panel[p, col] = table[_load_u8(at)] | (table[_load_u8(at + 1)] << 16)
            if odd:
                panel[whole, col] = table[_load_u8(row + k - 1)]
            if fmt == FP8_INF:
                for p in range(pairs):
                    word = panel[p, col]
                    if (word & 0x7FFF) == 0x7F80 or ((word >> 16) & 0x7FFF) == 0x7F80:
                        bad = 1
        for p in range(pairs, half):
            panel[p, col] = 0
    for j in range(j1, j0 + (j1 - j0 + BLOCK - 1) // BLOCK * BLOCK):  # past the last column, in its panel
        q, col = (j - j0) // BLOCK, (j - j0) % BLOCK
        for p in range(half):
            out[q, p, col] = 0
    return bad


@_kernel
def _finish(c, i0, rows, j0, cols, edge, mode, scale, col_scale, cs_stride):
    """Block ``c[i0:i0 + rows, j0:j0 + cols]``: ``mode`` 1 copies ``edge`` in, 2 adds it, 0 leaves it; then, with
    ``scale``, each column times its scale (read at ``col_scale + j * cs_stride``, bytes, into ``edge``'s last
    row). One tight loop per case, so that each is vectorised."""
    factors = edge[BLOCK]
    for j in range(cols):
        factors[j] = _load_f32(col_scale + (j0 + j) * cs_stride) if scale else 1.0
    for i in range(rows):
        dst = c[i0 + i, j0:j0 + cols]
        src = edge[i, :cols]
        if mode == 0:
            for j in range(cols):
                dst[j] = dst[j] * factors[j]
        elif mode == 1:
            for j in range(cols):
                dst[j] = src[j] * factors[j]
        else:
            for j in range(cols):
                dst[j] = (dst[j] + src[j]) * factors[j]


@_kernel
def dequant_gemm(fmt, table, a, a_rs, a_cs, k, w, w_rs, s, s_rs, s_cb, n_rows, col_scale, cs_stride,
                 c, r0, r1, c0, c1, a_buf, b_buf, edge, config):
    """``c[r0:r1, c0:c1] = (a[r0:r1] @ decoded(W)[c0:c1].T) * col_scale[c0:c1]``: A [M, k] f32 at address ``a``
    (strides in bytes), the weight as ``decode_block`` reads it, ``c`` f32 with contiguous rows. Scratch:
    ``a_buf`` [3, 1, 32, kc] uint16 (a panel of x in three parts), ``b_buf`` [nc / 32, kc / 2, 32] uint32 (a
    decoded block), ``edge`` [33, 32] f32 (a block, and its column scales), ``config`` [64] uint8. Returns 1,
    leaving ``c`` unfinished, as soon as it meets a value of A that is not finite or an infinite weight."""
    kc = a_buf.shape[3]
    nc = b_buf.shape[0] * BLOCK
    a_part = a_buf.strides[0]
    a_row = a_buf.strides[2]
    c_row = c.strides[0]
    configure(config)
    for n0 in range(c0, c1, nc):
        n1 = min(n0 + nc, c1)
        for k0 in range(0, max(k, 1), kc):
            k1 = min(k0 + kc, k)
            steps = (k1 - k0 + BLOCK - 1) // BLOCK
            last = k1 >= k
            if decode_block(fmt, table, w, w_rs, s, s_rs, s_cb, n_rows, k, k0, k1, n0, n1, b_buf):
                _release()
                return 1
            for i0 in range(r0, r1, BLOCK):
                i1 = min(i0 + BLOCK, r1)
                if pack_a(a, a_rs, a_cs, i0, i1, k0, k1, a_buf):
                    _release()
                    return 1
                for j0 in range(n0, n1, BLOCK):
                    j1 = min(j0 + BLOCK, n1)
                    b_addr = b_buf.ctypes.data + (j0 - n0) // BLOCK * b_buf.strides[0]
                    rows, cols = i1 - i0, j1 - j0
                    if k0 == 0 and rows == BLOCK and cols == BLOCK:  # straight into c
                        _block32(a_buf.ctypes.data, a_row, a_part, b_addr, steps,
                                 c.ctypes.data + i0 * c_row + j0 * 4, c_row, 0)
                        if last:
                            _finish(c, i0, rows, j0, cols, edge, 0, 1, col_scale, cs_stride)
                        continue
                    # a later k block (summed apart, then added: a sum of K / kc block sums rounds less than
                    # one running sum over all of K), or a block past the edge of c: computed in ``edge``
                    if rows <= 16:
                        _block16(a_buf.ctypes.data, a_row, a_part, b_addr, steps, edge.ctypes.data, BLOCK * 4, 0)
                    else:
                        _block32(a_buf.ctypes.data, a_row, a_part, b_addr, steps, edge.ctypes.data, BLOCK * 4, 0)
                    _finish(c, i0, rows, j0, cols, edge, 1 if k0 == 0 else 2, 1 if last else 0, col_scale,
                            cs_stride)
    _release()
    return 0


@intrinsic
def _e4m3_tile(typingctx, codes, codes_rs, out):
    """16 columns x 16 k pairs of an fp8 e4m3fn weight as VNNI words, decoded arithmetically (no lookups): column
    j's 32 bytes at ``codes + j * codes_rs``; transposed in registers and stored as 16 rows of 16 words at
    ``out``, ``BLOCK * 4`` bytes apart. A byte ``s eeee mmm``: normal (e > 0) -> bf16 ``s, e + 120, mmm0000``;
    subnormal ``m * 2^-9`` through f32 (normal there); 0x7F / 0xFF (NaN) -> bf16 NaN."""
    sig = types.none(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        codes, codes_rs, out = args
        i8, i32 = ir.IntType(8), ir.IntType(32)
        n = 32
        i32xn, f32xn = ir.VectorType(i32, n), ir.VectorType(ir.FloatType(), n)
        i16xn = ir.VectorType(ir.IntType(16), n)
        i32x16 = ir.VectorType(i32, 16)

        def splat(value):
            return ir.Constant(i32xn, [value] * n)

        columns = []
        for j in range(16):
            row = builder.add(codes, builder.mul(codes_rs, ir.Constant(_I64, j)))
            v = builder.zext(builder.load(builder.inttoptr(row, ir.VectorType(i8, n).as_pointer()), align=1), i32xn)
            mag = builder.and_(v, splat(0x7F))
            sign = builder.shl(builder.and_(v, splat(0x80)), splat(8))
            normal = builder.add(builder.shl(mag, splat(4)), splat(120 << 7))
            tiny = builder.fmul(builder.sitofp(builder.and_(mag, splat(7)), f32xn),
                                ir.Constant(f32xn, [2.0**-9] * n))
            tiny = builder.lshr(builder.bitcast(tiny, i32xn), splat(16))
            bits = builder.select(builder.icmp_unsigned("<", mag, splat(8)), tiny, normal)
            bits = builder.select(builder.icmp_unsigned("==", mag, splat(0x7F)), splat(0x7FC0), bits)
            bits = builder.trunc(builder.or_(bits, sign), i16xn)
            columns.append(builder.bitcast(bits, i32x16))  # element 2p in the low half of word p
        for p, row in enumerate(transpose16(builder, columns)):
            at = builder.add(out, ir.Constant(_I64, p * BLOCK * 4))
            builder.store(row, builder.inttoptr(at, i32x16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen
