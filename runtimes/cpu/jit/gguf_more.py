"""Fused dequant + product loops (numba) for the GGUF types ``gguf_kernels``' own loops do not cover: Q5_0, Q5_1,
Q2_K, Q3_K, F16, BF16, IQ4_NL and IQ4_XS (Q5_K shares ``gguf_kernels``' Q4_K loop: a loop of its own here measured
no faster).

Same contract as ``gguf_kernels.SPECIALISED``: ``kernel(packed, x, xs, out, n0, n1, kind, f16)`` computes ``out[:,
n] = x @ dequant(packed[n])`` for the weight rows ``n0 .. n1-1`` (the caller splits the rows over the cores), with
``xs`` the sums of x per sub-block (``gguf_kernels._sums``, for the types with a minimum term). Each block is read
once per row of x and decoded inside the dot product: the codes are split with 32-bit (or 8-bit) integer operations
and constant shifts so that LLVM vectorises the inner loops; the sums are reassociated (``fastmath`` reassoc and
contract: within the f32 tolerance of decoding then multiplying). The float types are converted exactly: BF16 is
the high half of an f32; F16 is ``bits(h & 0x7fff) << 13`` read as an f32 and scaled by 2**112 (exact for normal
and subnormal halves; Inf/NaN get the f32 exponent), with no table lookup.
"""

from __future__ import annotations

import numba
import numpy as np

from luminal_recipes.graph import gguf_blocks

F = np.float32
U = np.uint32
_fast = numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True, error_model="numpy")
_inline = numba.njit(cache=True, inline="always", error_model="numpy")

TWO_112 = F(2.0 ** 112)


@_inline
def _half(row, o, f16):
    """The f16 at row[o:o+2] as f32 (exact; a block's scales: one table lookup per block)."""
    return f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@_fast
def matmul_q5(packed, x, xs, out, n0, n1, kind, f16):
    """Q5_0 (kind 2: d, qh, 16 bytes; q - 16) / Q5_1 (kind 3: d, m, qh, 16 bytes; d q + m): element j of a block
    is nibble j (low nibbles, then high) with bit j of the u32 qh above it."""
    ts = 22 if kind == 2 else 24
    h = 2 if kind == 2 else 4
    p = h + 4
    off = F(16.0) if kind == 2 else F(0.0)
    nb = x.shape[1] // 32
    lanes = np.zeros(32, np.float32)
    for n in range(n0, n1):
        row = packed[n]
        for m in range(x.shape[0]):
            xm = x[m]
            lanes[:] = 0.0
            acc = F(0.0)
            for blk in range(nb):
                o = blk * ts
                xb = blk * 32
                d = _half(row, o, f16)
                qh = U(row[o + h]) | (U(row[o + h + 1]) << U(8)) | (U(row[o + h + 2]) << U(16)) | \
                    (U(row[o + h + 3]) << U(24))
                for j in range(16):
                    b = np.int32(row[o + p + j])
                    lo = (b & np.int32(15)) | (np.int32((qh >> U(j)) & U(1)) << np.int32(4))
                    hi = (b >> np.int32(4)) | (np.int32((qh >> U(j + 16)) & U(1)) << np.int32(4))
                    lanes[j] += d * (xm[xb + j] * (F(lo) - off))
                    lanes[16 + j] += d * (xm[xb + 16 + j] * (F(hi) - off))
                if kind == 3:
                    acc += _half(row, o + 2, f16) * xs[m, blk]
            for j in range(32):
                acc += lanes[j]
            out[m, n] = acc


@_fast
def matmul_q2_k(packed, x, xs, out, n0, n1, kind, f16):
    """Q2_K: scales[16] (low nibble: scale, high: min) qs[64] d dmin; element h*128 + sh*32 + lo is bits 2sh of
    qs[h*32 + lo], in sub-block (h*128 + sh*32 + lo) // 16."""
    nb = x.shape[1] // 256
    for n in range(n0, n1):
        row = packed[n]
        for m in range(x.shape[0]):
            xm = x[m]
            acc = F(0.0)
            for blk in range(nb):
                o = blk * 84
                d = _half(row, o + 80, f16)
                dmin = _half(row, o + 82, f16)
                mins = F(0.0)
                for s in range(16):
                    mins += F(row[o + s] >> np.uint8(4)) * xs[m, blk * 16 + s]
                tot = F(0.0)
                for hh in range(2):
                    qo = o + 16 + hh * 32
                    for sh in range(4):
                        shift = np.int32(2 * sh)
                        xb = blk * 256 + hh * 128 + sh * 32
                        s0 = F(0.0)
                        s1 = F(0.0)
                        for j in range(16):
                            s0 += xm[xb + j] * F((np.int32(row[qo + j]) >> shift) & np.int32(3))
                            s1 += xm[xb + 16 + j] * F((np.int32(row[qo + 16 + j]) >> shift) & np.int32(3))
                        s = hh * 8 + sh * 2
                        tot += F(row[o + s] & np.uint8(15)) * s0 + F(row[o + s + 1] & np.uint8(15)) * s1
                acc += d * tot - dmin * mins
            out[m, n] = acc


@_fast
def matmul_q3_k(packed, x, xs, out, n0, n1, kind, f16):
    """Q3_K: hmask[32] qs[64] scales[12] d; element e = h*128 + sh*32 + lo is ((qs[h*32 + lo] >> 2sh) & 3) - 4,
    plus 4 where bit e // 32 of hmask[lo] is set; 16 six-bit scales (minus 32), one per 16 elements."""
    nb = x.shape[1] // 256
    sc = np.empty(16, np.float32)
    for n in range(n0, n1):
        row = packed[n]
        for m in range(x.shape[0]):
            xm = x[m]
            acc = F(0.0)
            for blk in range(nb):
                o = blk * 110
                d = _half(row, o + 108, f16)
                for s in range(16):
                    lo4 = (np.int64(row[o + 96 + s]) & 15) if s < 8 else (np.int64(row[o + 96 + s - 8]) >> 4)
                    hi2 = (np.int64(row[o + 104 + (s % 4)]) >> (2 * (s // 4))) & 3
                    sc[s] = F((lo4 | (hi2 << 4)) - 32)
                tot = F(0.0)
                for hh in range(2):
                    qo = o + 32 + hh * 32
                    for sh in range(4):
                        shift = np.int32(2 * sh)
                        bit = np.int32(hh * 4 + sh)
                        xb = blk * 256 + hh * 128 + sh * 32
                        s0 = F(0.0)
                        s1 = F(0.0)
                        for j in range(16):
                            q0 = ((np.int32(row[qo + j]) >> shift) & np.int32(3)) | \
                                (((np.int32(row[o + j]) >> bit) & np.int32(1)) << np.int32(2))
                            q1 = ((np.int32(row[qo + 16 + j]) >> shift) & np.int32(3)) | \
                                (((np.int32(row[o + 16 + j]) >> bit) & np.int32(1)) << np.int32(2))
                            s0 += xm[xb + j] * (F(q0) - F(4.0))
                            s1 += xm[xb + 16 + j] * (F(q1) - F(4.0))
                        s = hh * 8 + sh * 2
                        tot += sc[s] * s0 + sc[s + 1] * s1
                acc += d * tot
            out[m, n] = acc


@_fast
def matmul_f16(packed, x, xs, out, n0, n1, kind, f16):
    """F16 (kind 10) / BF16 (kind 11) rows: each row converted into an f32 scratch with 32-bit integer operations
    (exact), then one vectorised dot product per row of x."""
    k = x.shape[1]
    bits = np.empty(k, np.int32)
    vals = bits.view(np.float32)
    I = np.int32
    for n in range(n0, n1):
        h16 = packed[n].view(np.uint16)
        if kind == 11:
            for j in range(k):
                bits[j] = I(h16[j]) << I(16)
        else:
            for j in range(k):
                h = I(h16[j])
                v = ((h & I(0x7FFF)) << I(13)) | ((h & I(0x8000)) << I(16))
                bits[j] = v | ((((h & I(0x7C00)) + I(0x400)) >> I(15)) * I(0x7F800000))  # Inf/NaN: all ones
        scale = TWO_112 if kind == 10 else F(1.0)
        for m in range(x.shape[0]):
            xm = x[m]
            s = F(0.0)
            for j in range(k):
                s += xm[j] * (vals[j] * scale)
            out[m, n] = s


KVALUES_IQ4NL = gguf_blocks.KVALUES_IQ4NL.astype(np.float32)  # the IQ4 codes' values (exact in f32)


@_fast
def matmul_iq4(packed, x, xs, out, n0, n1, kind, f16):
    """IQ4_NL (kind 13: d, 16 bytes per 32) / IQ4_XS (kind 14: d, scales_h, scales_l[4], 128 bytes per 256; 8
    sub-blocks of 32 with 6-bit scales minus 32): each weight row decoded once into an f32 scratch (the table's
    value times the sub-block's d or d * scale: ``gguf_blocks``' values), then one vectorised dot per row of x."""
    k = x.shape[1]
    vals = np.empty(k, np.float32)
    nb = k // (32 if kind == 13 else 256)
    low, four = np.uint8(15), np.uint8(4)
    for n in range(n0, n1):
        row = packed[n]
        for blk in range(nb):
            if kind == 13:
                o = blk * 18
                d = _half(row, o, f16)
                for j in range(16):
                    b = row[o + 2 + j]
                    vals[blk * 32 + j] = d * KVALUES_IQ4NL[b & low]
                    vals[blk * 32 + 16 + j] = d * KVALUES_IQ4NL[b >> four]
            else:
                o = blk * 136
                d = _half(row, o, f16)
                sh = np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)
                for s in range(8):
                    lo = (np.int64(row[o + 4 + s // 2]) >> (4 * (s % 2))) & 15
                    dl = d * F((lo | (((sh >> (2 * s)) & 3) << 4)) - 32)
                    base = blk * 256 + s * 32
                    for j in range(16):
                        b = row[o + 8 + s * 16 + j]
                        vals[base + j] = dl * KVALUES_IQ4NL[b & low]
                        vals[base + 16 + j] = dl * KVALUES_IQ4NL[b >> four]
        for m in range(x.shape[0]):
            xm = x[m]
            acc = F(0.0)
            for j in range(k):
                acc += xm[j] * vals[j]
            out[m, n] = acc


# kind (gguf_kernels.KINDS) -> loop; registered into gguf_kernels.SPECIALISED
SPECIALISED = {2: matmul_q5, 3: matmul_q5, 5: matmul_q2_k, 6: matmul_q3_k, 10: matmul_f16, 11: matmul_f16,
               13: matmul_iq4, 14: matmul_iq4}
