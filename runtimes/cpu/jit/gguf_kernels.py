"""GGUF block decoding and fused dequant-products, compiled by numba (``runtimes/cpu/kernels/gguf.py`` binds them).

Each block is decoded into its integer codes (as f32) and one or two coefficients per sub-block: the value of
element ``e`` of sub-block ``s`` is ``a[s] * q[e]`` (``+ c[s]`` for the types with a minimum: Q4_1, Q5_1, Q2_K,
Q4_K, Q5_K, where ``c = m`` or ``-(dmin * m)``; IQ4_NL and IQ4_XS's codes are their table's values). ``a`` and
``c`` are computed with the products in ``graph.gguf_blocks``' order, so ``dequant_rows`` (compiled without
fast-math flags: no FMA contraction, no reordering) gives exactly ``gguf_blocks.dequantize``'s values (``x - y``
and ``x + (-y)`` are the same IEEE operation).

``matmul_rows`` reads every packed block once and uses it for all rows of x: per sub-block ``a * sum(x q) + c *
sum(x)`` (the sums of x per sub-block computed once per product), with the sums reassociated so that LLVM
vectorises them (a different order of additions than decoding then multiplying: within the f32 tolerance).
"""

from __future__ import annotations

import numba
import numpy as np

from .gguf_more import KVALUES_IQ4NL  # the IQ4 codes' values in f32

F = np.float32
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q2_K": 5, "Q3_K": 6, "Q4_K": 7, "Q5_K": 8,
         "Q6_K": 9, "F16": 10, "BF16": 11, "F32": 12, "IQ4_NL": 13, "IQ4_XS": 14}
FLOAT_BLOCK = 32  # float rows (F16, BF16, F32) are walked in blocks of this many elements when K allows
# kind -> (elements per sub-block, sub-blocks per block, has a minimum term)
LAYOUT = {0: (32, 1, False), 1: (32, 1, True), 2: (32, 1, False), 3: (32, 1, True), 4: (32, 1, False),
          5: (16, 16, True), 6: (16, 16, False), 7: (32, 8, True), 8: (32, 8, True), 9: (16, 16, False),
          10: (FLOAT_BLOCK, 1, False), 11: (FLOAT_BLOCK, 1, False), 12: (FLOAT_BLOCK, 1, False),
          13: (32, 1, False), 14: (32, 8, False)}

_exact = numba.njit(cache=True, nogil=True, error_model="numpy")
_inline = numba.njit(cache=True, inline="always", error_model="numpy")
_fast = numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True, error_model="numpy")


def f16_table() -> np.ndarray:
    """f32[65536]: the value of every f16 bit pattern (exact)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@_inline
def _h(row, o, f16):
    return f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@_inline
def _k_scale_min(row, o, j):
    """Q4_K / Q5_K: scale and min j (0..7) of the 12 bytes at row[o:]."""
    if j < 4:
        return np.int64(row[o + j]) & 63, np.int64(row[o + 4 + j]) & 63
    md = np.int64(row[o + 8 + j - 4])
    sc = (md & 15) | ((np.int64(row[o + j - 4]) >> 2) & 0x30)
    mn = (md >> 4) | ((np.int64(row[o + j]) >> 2) & 0x30)
    return sc, mn


@_inline
def decode_block(kind, row, o, fb, f16, q, a, c):
    """The block of ``row`` starting at byte ``o`` (``fb`` elements for float kinds): codes into q, coefficients
    into a (and c)."""
    if kind == 0 or kind == 1:  # Q4_0, Q4_1: d (f16) [m (f16)] 16 bytes of nibbles, low nibbles first
        d = _h(row, o, f16)
        p = o + 2
        if kind == 1:
            c[0] = _h(row, o + 2, f16)
            p = o + 4
        off = F(8.0) if kind == 0 else F(0.0)
        for j in range(16):
            b = row[p + j]
            q[j] = F(b & 15) - off
            q[j + 16] = F(b >> 4) - off
        a[0] = d
    elif kind == 2 or kind == 3:  # Q5_0, Q5_1: d [m] qh (u32) 16 bytes of nibbles
        d = _h(row, o, f16)
        h = o + 2
        if kind == 3:
            c[0] = _h(row, o + 2, f16)
            h = o + 4
        qh = np.int64(row[h]) | (np.int64(row[h + 1]) << 8) | (np.int64(row[h + 2]) << 16) | \
            (np.int64(row[h + 3]) << 24)
        p = h + 4
        off = F(16.0) if kind == 2 else F(0.0)
        for j in range(16):
            b = np.int64(row[p + j])
            q[j] = F((b & 15) | (((qh >> j) & 1) << 4)) - off
            q[j + 16] = F((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off
        a[0] = d
    elif kind == 4:  # Q8_0: d, 32 int8
        a[0] = _h(row, o, f16)
        for j in range(32):
            v = np.int64(row[o + 2 + j])
            q[j] = F(v - 256 if v > 127 else v)
    elif kind == 5:  # Q2_K: scales[16] qs[64] d dmin
        d = _h(row, o + 80, f16)
        dmin = _h(row, o + 82, f16)
        for s in range(16):
            sc = row[o + s]
            a[s] = d * F(sc & 15)
            c[s] = -(dmin * F(sc >> 4))
        for h in range(2):
            for sh in range(4):
                for lo in range(32):
                    q[h * 128 + sh * 32 + lo] = F((row[o + 16 + h * 32 + lo] >> (2 * sh)) & 3)
    elif kind == 6:  # Q3_K: hmask[32] qs[64] scales[12] d
        d = _h(row, o + 108, f16)
        for s in range(16):
            lo4 = (np.int64(row[o + 96 + s]) & 15) if s < 8 else (np.int64(row[o + 96 + s - 8]) >> 4)
            hi2 = (np.int64(row[o + 104 + (s % 4)]) >> (2 * (s // 4))) & 3
            a[s] = d * F((lo4 | (hi2 << 4)) - 32)
        for h in range(2):
            for sh in range(4):
                for lo in range(32):
                    e = h * 128 + sh * 32 + lo
                    ql = (np.int64(row[o + 32 + h * 32 + lo]) >> (2 * sh)) & 3
                    hb = (np.int64(row[o + lo]) >> (e // 32)) & 1
                    q[e] = F(ql - (0 if hb else 4))
    elif kind == 7 or kind == 8:  # Q4_K, Q5_K: d dmin scales[12] [qh[32]] qs[128]
        d = _h(row, o, f16)
        dmin = _h(row, o + 2, f16)
        for s in range(8):
            sc, mn = _k_scale_min(row, o + 4, s)
            a[s] = d * F(sc)
            c[s] = -(dmin * F(mn))
        p = o + 16 if kind == 7 else o + 48
        for g in range(4):
            for lo in range(32):
                b = np.int64(row[p + g * 32 + lo])
                q[g * 64 + lo] = F(b & 15)
                q[g * 64 + 32 + lo] = F(b >> 4)
        if kind == 8:
            for e in range(256):
                q[e] += F(((np.int64(row[o + 16 + (e % 32)]) >> (e // 32)) & 1) << 4)
    elif kind == 9:  # Q6_K: ql[128] qh[64] scales[16] (int8) d
        d = _h(row, o + 208, f16)
        for s in range(16):
            v = np.int64(row[o + 192 + s])
            a[s] = d * F(v - 256 if v > 127 else v)
        for h in range(2):
            for nib in range(2):
                for lo in range(64):
                    e = h * 128 + nib * 64 + lo
                    low = (np.int64(row[o + h * 64 + lo]) >> (4 * nib)) & 15
                    hi = (np.int64(row[o + 128 + h * 32 + (e % 32)]) >> (2 * ((e % 128) // 32))) & 3
                    q[e] = F((low | (hi << 4)) - 32)
    elif kind == 13:  # IQ4_NL: d, 16 bytes of table indices (low nibbles first)
        a[0] = _h(row, o, f16)
        for j in range(16):
            b = np.int64(row[o + 2 + j])
            q[j] = KVALUES_IQ4NL[b & 15]
            q[j + 16] = KVALUES_IQ4NL[b >> 4]
    elif kind == 14:  # IQ4_XS: d, scales_h (u16), scales_l[4], 8 sub-blocks of 16 bytes of table indices
        d = _h(row, o, f16)
        sh = np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)
        for s in range(8):
            lo = (np.int64(row[o + 4 + s // 2]) >> (4 * (s % 2))) & 15
            a[s] = d * F((lo | (((sh >> (2 * s)) & 3) << 4)) - 32)
            for j in range(16):
                b = np.int64(row[o + 8 + s * 16 + j])
                q[s * 32 + j] = KVALUES_IQ4NL[b & 15]
                q[s * 32 + 16 + j] = KVALUES_IQ4NL[b >> 4]
    elif kind == 10:  # F16
        a[0] = F(1.0)
        for j in range(fb):
            q[j] = f16[np.int64(row[o + 2 * j]) | (np.int64(row[o + 2 * j + 1]) << 8)]
    elif kind == 11:  # BF16: the 16 high bits of an f32
        a[0] = F(1.0)
        qi = q.view(np.uint32)
        for j in range(fb):
            qi[j] = (np.uint32(row[o + 2 * j]) << np.uint32(16)) | (np.uint32(row[o + 2 * j + 1]) << np.uint32(24))
    else:  # F32
        a[0] = F(1.0)
        qi = q.view(np.uint32)
        for j in range(fb):
            qi[j] = np.uint32(row[o + 4 * j]) | (np.uint32(row[o + 4 * j + 1]) << np.uint32(8)) | \
                (np.uint32(row[o + 4 * j + 2]) << np.uint32(16)) | (np.uint32(row[o + 4 * j + 3]) << np.uint32(24))


@_exact
def dequant_rows(packed, out, kind, bs, ts, sl, nsub, has_c, f16):
    """out[r] (f32 [K]) = the decoded row packed[r] (u8 [K / bs * ts]); exact."""
    q = np.empty(256, np.float32)
    a = np.empty(16, np.float32)
    c = np.zeros(16, np.float32)
    nb = out.shape[1] // bs
    for r in range(packed.shape[0]):
        row = packed[r]
        dst = out[r]
        for blk in range(nb):
            decode_block(kind, row, blk * ts, bs, f16, q, a, c)
            base = blk * bs
            if 10 <= kind <= 12:  # floats: the values themselves (1 * v would turn a signalling NaN quiet)
                for j in range(bs):
                    dst[base + j] = q[j]
            elif has_c:
                for s in range(nsub):
                    for j in range(sl):
                        dst[base + s * sl + j] = a[s] * q[s * sl + j] + c[s]
            else:
                for s in range(nsub):
                    for j in range(sl):
                        dst[base + s * sl + j] = a[s] * q[s * sl + j]


@_fast
def _dot(x, xo, q, qo, n):
    acc = F(0.0)
    for j in range(n):
        acc += x[xo + j] * q[qo + j]
    return acc


@_fast
def _sums(x, xs, sl):
    """xs[m, s] = the sum of x[m] over sub-block s (elements s*sl .. s*sl+sl-1)."""
    for m in range(x.shape[0]):
        for s in range(xs.shape[1]):
            acc = F(0.0)
            for j in range(sl):
                acc += x[m, s * sl + j]
            xs[m, s] = acc


@_fast
def matmul_rows(packed, x, xs, out, n0, n1, kind, bs, ts, sl, nsub, has_c, f16):
    """out[:, n] = x @ dequant(packed[n]) for n in n0..n1-1: each packed block read once for every row of x."""
    q = np.empty(256, np.float32)
    a = np.empty(16, np.float32)
    c = np.zeros(16, np.float32)
    m_rows = x.shape[0]
    acc = np.zeros(m_rows, np.float32)
    nb = x.shape[1] // bs
    for n in range(n0, n1):
        row = packed[n]
        acc[:] = 0.0
        for blk in range(nb):
            decode_block(kind, row, blk * ts, bs, f16, q, a, c)
            base = blk * bs
            for m in range(m_rows):
                xm = x[m]
                tot = F(0.0)
                for s in range(nsub):
                    tot += a[s] * _dot(xm, base + s * sl, q, s * sl, sl)
                    if has_c:
                        tot += c[s] * xs[m, blk * nsub + s]
                acc[m] += tot
        for m in range(m_rows):
            out[m, n] = acc[m]


# ---- specialised fused products (one per type family): the packed bytes read once, no scratch, loops simple
# enough for LLVM to vectorise (x's sums per block come from ``_sums``) -----------------------------------------
@_fast
def matmul_q4(packed, x, xs, out, n0, n1, kind, f16):
    """Q4_0 (kind 0) / Q4_1 (kind 1): per element d * x * q into 16 lanes (vectorised), plus m * sum(x) per
    block (Q4_1; Q4_0: q - 8)."""
    ts = 18 if kind == 0 else 20
    p = 2 if kind == 0 else 4
    nb = x.shape[1] // 32
    lanes = np.zeros(32, np.float32)
    off = F(8.0) if kind == 0 else F(0.0)
    for n in range(n0, n1):
        row = packed[n]
        for m in range(x.shape[0]):
            xm = x[m]
            lanes[:] = 0.0
            acc = F(0.0)
            for blk in range(nb):
                o = blk * ts
                xb = blk * 32
                d = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
                for j in range(16):  # the nibbles in f32 arithmetic (exact), which LLVM vectorises
                    fb = F(row[o + p + j])
                    hi = np.floor(fb * F(0.0625))
                    lanes[j] += d * (xm[xb + j] * (fb - F(16.0) * hi - off))
                    lanes[16 + j] += d * (xm[xb + 16 + j] * (hi - off))
                if kind == 1:
                    acc += f16[np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)] * xs[m, blk]
            for j in range(32):
                acc += lanes[j]
            out[m, n] = acc


@_fast
def matmul_q8_0(packed, x, xs, out, n0, n1, kind, f16):
    nb = x.shape[1] // 32
    lanes = np.zeros(32, np.float32)
    for n in range(n0, n1):
        row = packed[n]
        q = row.view(np.int8)
        for m in range(x.shape[0]):
            xm = x[m]
            lanes[:] = 0.0
            for blk in range(nb):
                o = blk * 34
                xb = blk * 32
                d = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
                for j in range(32):
                    lanes[j] += d * (xm[xb + j] * F(q[o + 2 + j]))
            acc = F(0.0)
            for j in range(32):
                acc += lanes[j]
            out[m, n] = acc


@_fast
def matmul_q4_k(packed, x, xs, out, n0, n1, kind, f16):
    """Q4_K (kind 7) / Q5_K (kind 8): 8 sub-blocks of 32, each a * sum(x q) - (dmin m) * sum(x)."""
    ts = 144 if kind == 7 else 176
    p = 16 if kind == 7 else 48
    nb = x.shape[1] // 256
    for n in range(n0, n1):
        row = packed[n]
        for m in range(x.shape[0]):
            xm = x[m]
            acc = F(0.0)
            for blk in range(nb):
                o = blk * ts
                d = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
                dmin = f16[np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)]
                for g in range(4):
                    xb = blk * 256 + g * 64
                    qo = o + p + g * 32
                    s0 = F(0.0)
                    s1 = F(0.0)
                    if kind == 7:
                        for j in range(32):
                            b = row[qo + j]
                            s0 += xm[xb + j] * F(b & 15)
                            s1 += xm[xb + 32 + j] * F(b >> 4)
                    else:
                        for j in range(32):
                            b = np.int64(row[qo + j])
                            h = np.int64(row[o + 16 + j]) >> (2 * g)
                            s0 += xm[xb + j] * F((b & 15) | ((h & 1) << 4))
                            s1 += xm[xb + 32 + j] * F((b >> 4) | ((h & 2) << 3))
                    sc0, mn0 = _k_scale_min(row, o + 4, 2 * g)
                    sc1, mn1 = _k_scale_min(row, o + 4, 2 * g + 1)
                    sub = blk * 8 + 2 * g
                    acc += (d * F(sc0)) * s0 - (dmin * F(mn0)) * xs[m, sub]
                    acc += (d * F(sc1)) * s1 - (dmin * F(mn1)) * xs[m, sub + 1]
            out[m, n] = acc


@_fast
def matmul_q6_k(packed, x, xs, out, n0, n1, kind, f16):
    """Q6_K: 16 sub-blocks of 16, each d * sc * sum(x q), q = (low | high << 4) - 32."""
    nb = x.shape[1] // 256
    for n in range(n0, n1):
        row = packed[n]
        sc = row.view(np.int8)
        for m in range(x.shape[0]):
            xm = x[m]
            acc = F(0.0)
            for blk in range(nb):
                o = blk * 210
                d = f16[np.int64(row[o + 208]) | (np.int64(row[o + 209]) << 8)]
                for h in range(2):
                    xb = blk * 256 + h * 128
                    lo_o = o + h * 64
                    hi_o = o + 128 + h * 32
                    for part in range(2):  # elements part*16 .. part*16+15 of each 32-run
                        s0 = F(0.0)
                        s1 = F(0.0)
                        s2 = F(0.0)
                        s3 = F(0.0)
                        for jj in range(16):
                            j = part * 16 + jj
                            a = np.int64(row[lo_o + j])
                            b = np.int64(row[lo_o + 32 + j])
                            hh = np.int64(row[hi_o + j])
                            s0 += xm[xb + j] * F(((a & 15) | ((hh & 3) << 4)) - 32)
                            s1 += xm[xb + 32 + j] * F(((b & 15) | (((hh >> 2) & 3) << 4)) - 32)
                            s2 += xm[xb + 64 + j] * F(((a >> 4) | (((hh >> 4) & 3) << 4)) - 32)
                            s3 += xm[xb + 96 + j] * F(((b >> 4) | (((hh >> 6) & 3) << 4)) - 32)
                        base = o + 192 + h * 8 + part
                        acc += d * (F(sc[base]) * s0 + F(sc[base + 2]) * s1 + F(sc[base + 4]) * s2
                                    + F(sc[base + 6]) * s3)
            out[m, n] = acc


SPECIALISED = {0: matmul_q4, 1: matmul_q4, 4: matmul_q8_0, 7: matmul_q4_k, 8: matmul_q4_k, 9: matmul_q6_k}


# ---- specialised exact decoding (the prompt's bands, Dequant, GatherDequant): the same IEEE operations as
# ``dequant_rows`` (no fast-math flags), nibbles split with u8 operations (an i64 one keeps LLVM from vectorising)
@_exact
def _dequant_q4(packed, out, kind, f16):
    ts = 18 if kind == 0 else 20
    p = 2 if kind == 0 else 4
    nb = out.shape[1] // 32
    low, four = np.uint8(15), np.uint8(4)
    for r in range(packed.shape[0]):
        row = packed[r]
        dst = out[r]
        for blk in range(nb):
            o = blk * ts
            d = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            if kind == 0:
                for j in range(16):
                    b = row[o + p + j]
                    dst[blk * 32 + j] = d * (F(b & low) - F(8.0))
                    dst[blk * 32 + 16 + j] = d * (F(b >> four) - F(8.0))
            else:
                m = f16[np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)]
                for j in range(16):
                    b = row[o + p + j]
                    dst[blk * 32 + j] = d * F(b & low) + m
                    dst[blk * 32 + 16 + j] = d * F(b >> four) + m


@_exact
def _dequant_q8_0(packed, out, f16):
    nb = out.shape[1] // 32
    for r in range(packed.shape[0]):
        row = packed[r]
        q = row.view(np.int8)
        dst = out[r]
        for blk in range(nb):
            o = blk * 34
            d = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            for j in range(32):
                dst[blk * 32 + j] = F(q[o + 2 + j]) * d


@_exact
def _dequant_q4_k(packed, out, f16):
    nb = out.shape[1] // 256
    low, four = np.uint8(15), np.uint8(4)
    for r in range(packed.shape[0]):
        row = packed[r]
        dst = out[r]
        for blk in range(nb):
            o = blk * 144
            d = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            dmin = f16[np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)]
            for g in range(4):
                sc0, mn0 = _k_scale_min(row, o + 4, 2 * g)
                sc1, mn1 = _k_scale_min(row, o + 4, 2 * g + 1)
                a0 = d * F(sc0)
                c0 = dmin * F(mn0)
                a1 = d * F(sc1)
                c1 = dmin * F(mn1)
                base = blk * 256 + g * 64
                for j in range(32):
                    b = row[o + 16 + g * 32 + j]
                    dst[base + j] = a0 * F(b & low) - c0
                    dst[base + 32 + j] = a1 * F(b >> four) - c1


def dequant_any(packed, out, kind, bs, ts, sl, nsub, has_c, f16):
    """``dequant_rows`` through a type's own loops where it has some (Q4_0, Q4_1, Q8_0, Q4_K): the same bits."""
    if kind == 0 or kind == 1:
        _dequant_q4(packed, out, kind, f16)
    elif kind == 4:
        _dequant_q8_0(packed, out, f16)
    elif kind == 7:
        _dequant_q4_k(packed, out, f16)
    else:
        dequant_rows(packed, out, kind, bs, ts, sl, nsub, has_c, f16)


# the other types' fused products (Q5_0, Q5_1, Q2_K, Q3_K, F16, BF16): runtimes/cpu/jit/gguf_more.py
from .gguf_more import SPECIALISED as _MORE  # noqa: E402

SPECIALISED.update({kind: loop for kind, loop in _MORE.items() if kind not in SPECIALISED})
