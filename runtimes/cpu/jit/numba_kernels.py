"""Row kernels of the numpy backend compiled by numba: one pass per row instead of one numpy pass per operation,
run on every core (numpy's element-wise passes are single-threaded): ``jit.by_rows`` cuts the rows into one part
per core at bind time and ``cpu_threads`` runs the parts (the compiled functions release the GIL).

What they fuse is what costs in attention and the norms: per score row, max then ``exp(x - max)`` in place
(numpy: three passes, one thread); per row of a norm, the statistics and the normalisation. Rows are
independent and each is computed in a fixed order, so results do not depend on the thread count or schedule.

``exp_f32`` is Cephes' ``expf`` (Cody-Waite reduction, degree-6 polynomial, 2^n from the exponent bits): written
out so that LLVM vectorises it (numba would call libm's scalar ``expf`` per element); relative error < 3e-7, as
numpy's own vectorised ``exp``. It returns 0 below -87.34 (where f32's normal range ends; e^x is then < 1.2e-38).

Compiled once and cached on disk (numba's cache: ``__pycache__`` beside this file, else numba's user cache
folder); imported through ``jit`` (lazily, warmed up in the background), never directly by a kernel.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from llvmlite.ir import values as ir_values
from numba.core import types
from numba.extending import intrinsic

from .spin import fetch_add as _fetch_add

F = np.float32
EXP_LOW = F(-87.33654)  # below this e^x is not a normal f32

# only FMA contraction: infinities and NaNs keep their IEEE meaning (masked scores are -inf); division by zero
# gives inf/NaN as in numpy (numba's default raises ZeroDivisionError, e.g. for a fully masked softmax row)
_FAST = {"contract"}
_rows = numba.njit(fastmath=_FAST, cache=True, nogil=True, error_model="numpy")
_inline = numba.njit(fastmath=_FAST, cache=True, inline="always", error_model="numpy")
# sums that LLVM may reorder, so that it vectorises them: a separate (not numba-inlined) function, since flags
# are per function and a polynomial or a rounding trick must never be reassociated
_sum = numba.njit(fastmath=_FAST | {"reassoc"}, cache=True, nogil=True, error_model="numpy")
MAGIC = F(12582912.0)  # 1.5 * 2^23: adding then subtracting it rounds an f32 below 2^22 to the nearest integer


@intrinsic
def _f32_from_bits(typingctx, bits):
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _maxnum(typingctx, a, b):
    """``llvm.maxnum``: the larger of two f32, ignoring a NaN operand (a NaN score still turns its own row
    into NaN through exp); unlike a compare-and-select, a loop of it vectorises."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """``llvm.fma``: a * b + c rounded once, whatever the function's fastmath flags (a loop of it vectorises)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


class _WideVectorAttributes(ir_values.FunctionAttributes):
    """A function's attributes plus ``"prefer-vector-width"="512"`` (llvmlite knows only flag attributes)."""

    def __bool__(self) -> bool:
        return True  # always printed, even with no flag attribute

    def _to_list(self, ret_type):
        return [*super()._to_list(ret_type), '"prefer-vector-width"="512"']


@intrinsic
def _wide_vectors(typingctx):
    """Let LLVM vectorise the calling function with the CPU's widest registers: on AVX-512 CPUs its default tuning
    keeps 256-bit vectors (measured: the compiled exp 0.40 -> 0.27 ns per element with 512). A no-op elsewhere
    (the width is capped at what the CPU has). Call it first thing in a compiled (not inlined) kernel."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        fn = builder.function
        if not isinstance(fn.attributes, _WideVectorAttributes):
            wide = _WideVectorAttributes()
            for flag in fn.attributes:
                wide.add(flag)
            wide.alignstack, wide.personality = fn.attributes.alignstack, fn.attributes.personality
            fn.attributes = wide
        return context.get_dummy_value()

    return sig, codegen


@_inline
def _exp_poly(r):
    """e^r for |r| <= ln(2)/2 (Cephes' expf polynomial), shared by both exp kernels."""
    p = F(1.9875691500e-4)
    p = p * r + F(1.3981999507e-3)
    p = p * r + F(8.3334519073e-3)
    p = p * r + F(4.1665795894e-2)
    p = p * r + F(1.6666665459e-1)
    p = p * r + F(5.0000001201e-1)
    return p * r * r + r + F(1.0)


@_inline
def exp_f32(x):
    xc = x if x > EXP_LOW else EXP_LOW
    n = (xc * F(1.4426950408889634) + MAGIC) - MAGIC  # round to nearest (a libm floor call would not vectorise)
    r = xc - n * F(0.693359375)
    r = r - n * F(-2.12194440e-4)
    p = _exp_poly(r)
    y = p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return y if x > EXP_LOW else F(0.0)


@_inline
def row_max(row):
    # eight running maxima, so that LLVM vectorises the reduction
    n = row.size
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = F(-np.inf)
    n8 = n - n % 8
    for j in range(0, n8, 8):
        m0 = max(m0, row[j])
        m1 = max(m1, row[j + 1])
        m2 = max(m2, row[j + 2])
        m3 = max(m3, row[j + 3])
        m4 = max(m4, row[j + 4])
        m5 = max(m5, row[j + 5])
        m6 = max(m6, row[j + 6])
        m7 = max(m7, row[j + 7])
    for j in range(n8, n):
        m0 = max(m0, row[j])
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@_inline
def row_max_vec(row):
    # one running maximum that LLVM vectorises (exact: the order of maxima does not matter)
    m = F(-np.inf)
    for j in range(row.size):
        m = _maxnum(m, row[j])
    return m


@_inline
def row_sum(row):
    # eight running sums (a fixed order whatever the vector width)
    n = row.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F(0.0)
    n8 = n - n % 8
    for j in range(0, n8, 8):
        s0 += row[j]
        s1 += row[j + 1]
        s2 += row[j + 2]
        s3 += row[j + 3]
        s4 += row[j + 4]
        s5 += row[j + 5]
        s6 += row[j + 6]
        s7 += row[j + 7]
    for j in range(n8, n):
        s0 += row[j]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@_sum
def row_sum_vec(row):
    # vectorised (the order of the additions is the compiled code's, the same on every call)
    s = F(0.0)
    for j in range(row.size):
        s += row[j]
    return s


@_inline
def exp_shifted(row, m):
    for j in range(row.size):
        row[j] = exp_f32(row[j] - m)


@_rows
def exp_rows(scores, maxima):
    """``scores[i] = exp(scores[i] - max(scores[i]))`` in place; ``maxima[i]`` = that max."""
    for i in range(scores.shape[0]):
        row = scores[i]
        m = row_max(row)
        maxima[i] = m
        exp_shifted(row, m)


@_rows
def exp_rows_sum(scores, sums):
    """``scores[i] = exp(scores[i] - max(scores[i]))`` in place; ``sums[i]`` = the row's sum."""
    _wide_vectors()
    for i in range(scores.shape[0]):
        row = scores[i]
        exp_shifted(row, row_max_vec(row))
        sums[i] = row_sum_vec(row)  # a second pass over a row still in cache: all three loops vectorise


@_sum
def dot_vec(a, b):
    # vectorised (the order of the additions is the compiled code's, the same on every call)
    s = F(0.0)
    for j in range(a.size):
        s += a[j] * b[j]
    return s


@_inline
def _key_span(bias, at, t, masked, keep):
    """The keys ``lo:hi`` of a bias row (``bias[at:at + t]``) less its masked keys (``<= masked``) at either end,
    where some key of the span has a bias of at least ``keep`` (then a masked key's weight is exactly 0); else
    every key, ``0:t`` (a fully masked row's softmax is over its masked scores)."""
    hi = t
    while hi > 0 and bias[at + hi - 1] <= masked:
        hi -= 1
    lo = 0
    while lo < hi and bias[at + lo] <= masked:
        lo += 1
    for i in range(lo, hi):
        if bias[at + i] >= keep:
            return lo, hi
    return 0, t


@_rows
def attention_rows(q, k, v, bias, out, geometry, has_bias, scale, qs, sc, masked, keep):
    """Attention of a few query rows per group in one call (decoding: each kv head's query heads, one row each):
    ``out[g, r] = softmax((q[g, r] * scale) k[g]^T + bias[g, r]) v[g]``. Every operand is a flat run of memory
    whose rows are contiguous (so the loops vectorise whatever the views' other strides): ``geometry`` holds
    ``G, R, T, D, Dv`` and, per operand (q, k, v, bias, out), the element strides of its two outer axes (row ``[g,
    r]`` of q starts at ``g * q0 + r * q1``; k's and v's rows are indexed by key), then the range ``u0:u1`` of
    query rows ``u = g * R + r`` this call computes (a part: the rows are independent, so the parts' results are
    the whole call's, bit for bit). ``bias`` is read when ``has_bias``; ``qs [D]`` and ``sc [T]`` are scratch. The
    same steps as the BLAS path (q scaled once, scores, bias, max, exp, sum, p v, divide), each sum in the compiled
    code's fixed order.

    Masked keys at either end of a row (bias <= ``masked``: a KV cache's unfilled rows past the decoded position)
    are neither read nor multiplied where the row has a key with a bias of at least ``keep`` (``_key_span``): their
    score is the bias itself, whose weight ``exp(bias - max)`` is exactly 0 as ``exp(score + bias - max)`` was, so
    the sum and the output are the same bits (for finite v) while the cache rows past the position stay unread."""
    _wide_vectors()
    rows, t, d, dv = geometry[1], geometry[2], geometry[3], geometry[4]
    q0, q1, k0, k1, v0, v1 = geometry[5], geometry[6], geometry[7], geometry[8], geometry[9], geometry[10]
    b0, b1, o0, o1 = geometry[11], geometry[12], geometry[13], geometry[14]
    for u in range(geometry[15], geometry[16]):
        g = u // rows
        r = u - g * rows
        at = g * q0 + r * q1
        for j in range(d):
            qs[j] = q[at + j] * scale
        bb = g * b0 + r * b1
        lo, hi = _key_span(bias, bb, t, masked, keep) if has_bias else (0, t)
        for i in range(lo):
            sc[i] = bias[bb + i]
        for i in range(lo, hi):
            at = g * k0 + i * k1
            score = dot_vec(qs, k[at:at + d])
            sc[i] = score + bias[bb + i] if has_bias else score
        for i in range(hi, t):
            sc[i] = bias[bb + i]
        scores = sc[:t]
        exp_shifted(scores, row_max_vec(scores))
        total = row_sum_vec(scores)
        at = g * o0 + r * o1
        o = out[at:at + dv]
        for j in range(dv):
            o[j] = F(0.0)
        for i in range(lo, hi):
            p = sc[i]
            at = g * v0 + i * v1
            vi = v[at:at + dv]
            for j in range(dv):
                o[j] += p * vi[j]
        for j in range(dv):
            o[j] = o[j] / total


@_inline
def _masked_run(flat, at, step, n, masked):
    """Whether all ``n`` values ``flat[at + c * step]`` are at or below ``masked`` (a NaN is not): counted, not
    tested one by one, so that the loop vectorises."""
    count = 0
    for c in range(n):
        count += flat[at + c * step] <= masked
    return count == n


@_rows
def mask_spans(flat, rows, cols, s0, s1, lo, hi, keep, masked, level):
    """Attention's masked keys (``kernels/attention._mask_spans``): for row ``i`` of the bias ``[rows, cols]``
    read from ``flat`` (element ``[i, j]`` at ``i * s0 + j * s1``), ``lo[i]``/``hi[i]`` the first and one past
    the last key whose bias is not at or below ``masked`` (a NaN is not masked), ``keep[i]`` whether some bias of
    the row is at least ``level``. Runs of 16 keys at a time from either end, so a causal row costs about its
    masked keys / 16."""
    _wide_vectors()
    for i in range(rows):
        at = i * s0
        j = 0
        while j + 16 <= cols and _masked_run(flat, at + j * s1, s1, 16, masked):
            j += 16
        while j < cols and flat[at + j * s1] <= masked:
            j += 1
        e = cols
        while e - 16 >= j and _masked_run(flat, at + (e - 16) * s1, s1, 16, masked):
            e -= 16
        while e > j and flat[at + (e - 1) * s1] <= masked:
            e -= 1
        lo[i] = j
        hi[i] = e
        found = False
        for c in range(j, e):  # the first key not masked is usually at least level (0: a key that is seen)
            if flat[at + c * s1] >= level:
                found = True
                break
        keep[i] = found


@_rows
def exp_rows_online(scores, running, sums, rescale, first):
    """One key block of an online softmax, in place: ``new = max(running[i], max(scores[i]))`` (not below
    the most negative finite f32, so fully masked blocks never give ``-inf - -inf``), ``rescale[i] =
    exp(running[i] - new)`` (the factor for what was accumulated so far), ``scores[i] = exp(scores[i] - new)``,
    ``sums[i] = sums[i] * rescale[i] + sum(scores[i])``, ``running[i] = new``; when ``first``, ``running``
    and ``sums`` are only written and ``rescale`` is not touched."""
    _wide_vectors()
    low = F(np.finfo(np.float32).min)
    for i in range(scores.shape[0]):
        online_softmax_row(scores[i], i, first, running, sums, rescale, low)


@_inline
def online_softmax_row(row, i, first, running, sums, rescale, low):
    """One row of ``exp_rows_online`` (row ``i`` of its state; ``low``: f32's lowest, the max of an all-masked
    row)."""
    m = max(row_max_vec(row), low)
    if not first:
        m = max(m, running[i])
        rescale[i] = exp_f32(running[i] - m)
    running[i] = m
    exp_shifted(row, m)
    total = row_sum_vec(row)
    sums[i] = total if first else sums[i] * rescale[i] + total


@_inline
def row_sum_sq(row, shift):
    # sum((row - shift)^2) with eight running sums
    n = row.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F(0.0)
    n8 = n - n % 8
    for j in range(0, n8, 8):
        d0 = row[j] - shift
        d1 = row[j + 1] - shift
        d2 = row[j + 2] - shift
        d3 = row[j + 3] - shift
        d4 = row[j + 4] - shift
        d5 = row[j + 5] - shift
        d6 = row[j + 6] - shift
        d7 = row[j + 7] - shift
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
        s4 += d4 * d4
        s5 += d5 * d5
        s6 += d6 * d6
        s7 += d7 * d7
    for j in range(n8, n):
        d = row[j] - shift
        s0 += d * d
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@_rows
def softmax_rows(x, out):
    """``out[i] = exp(x[i] - max(x[i])) / sum(...)``."""
    for i in range(x.shape[0]):
        row, dst = x[i], out[i]
        m = row_max(row)
        for j in range(row.size):
            dst[j] = exp_f32(row[j] - m)
        total = row_sum(dst)
        for j in range(dst.size):
            dst[j] = dst[j] / total


@_inline
def _rms_inv(row, inv_n, eps):
    return F(1.0) / np.sqrt(row_sum_sq(row, F(0.0)) * inv_n + eps)


@_inline
def _layer_stats(row, inv_n, eps):
    mean = row_sum(row) * inv_n
    return mean, F(1.0) / np.sqrt(row_sum_sq(row, mean) * inv_n + eps)


@_inline
def _store(row, dst, mean, r, scale, shift, affine, centred):
    # dst = norm(row) [* scale [+ shift]]; ``affine`` and ``centred`` are constants at every call site, so each
    # call compiles to one vectorised loop (a choice made inside the row loop measured 4x slower: not unswitched)
    if centred:
        if affine == 0:
            for j in range(row.size):
                dst[j] = (row[j] - mean) * r
        elif affine == 1:
            for j in range(row.size):
                dst[j] = ((row[j] - mean) * r) * scale[j]
        else:
            for j in range(row.size):
                dst[j] = ((row[j] - mean) * r) * scale[j] + shift[j]
    elif affine == 0:
        for j in range(row.size):
            dst[j] = row[j] * r
    elif affine == 1:
        for j in range(row.size):
            dst[j] = (row[j] * r) * scale[j]
    else:
        for j in range(row.size):
            dst[j] = (row[j] * r) * scale[j] + shift[j]


# The norms: ``out[i] = norm(x[i])``, then times ``scale`` (affine 1), plus ``shift`` (affine 2): the RMSNorm
# weight or the adaptive LayerNorm's modulation, one vector [N] for every row, applied while the row is in cache.
# (256-bit vectors: 512-bit ones measured 5-30% slower here, unlike the Elementwise kernel's exp.)
@_rows
def rms_norm_rows(x, out, scale, shift, affine, inv_n, eps):
    """``out[i] = x[i] / sqrt(mean(x[i]^2) + eps)`` (* scale + shift)."""
    zero = F(0.0)
    if affine == 0:
        for i in range(x.shape[0]):
            _store(x[i], out[i], zero, _rms_inv(x[i], inv_n, eps), scale, shift, 0, False)
    elif affine == 1:
        for i in range(x.shape[0]):
            _store(x[i], out[i], zero, _rms_inv(x[i], inv_n, eps), scale, shift, 1, False)
    else:
        for i in range(x.shape[0]):
            _store(x[i], out[i], zero, _rms_inv(x[i], inv_n, eps), scale, shift, 2, False)


@_rows
def layer_norm_rows(x, out, scale, shift, affine, inv_n, eps):
    """``out[i] = (x[i] - mean) / sqrt(var + eps)``, the variance of the centred row (* scale + shift)."""
    if affine == 0:
        for i in range(x.shape[0]):
            mean, r = _layer_stats(x[i], inv_n, eps)
            _store(x[i], out[i], mean, r, scale, shift, 0, True)
    elif affine == 1:
        for i in range(x.shape[0]):
            mean, r = _layer_stats(x[i], inv_n, eps)
            _store(x[i], out[i], mean, r, scale, shift, 1, True)
    else:
        for i in range(x.shape[0]):
            mean, r = _layer_stats(x[i], inv_n, eps)
            _store(x[i], out[i], mean, r, scale, shift, 2, True)


# The same over rows that no single array stride reaches as contiguous rows: row i of ``out`` [rows, N] is
# ``flat[start + i * stride :][:N]`` of a 1-D buffer. numba types a 2-D strided view's rows as of unknown inner
# stride and does not vectorise them (per-head rows of a fused q/k/v projection: 3x slower than contiguous rows);
# a slice of a contiguous 1-D buffer it knows to be contiguous.
@_rows
def rms_norm_strided(flat, start, stride, out, scale, shift, affine, inv_n, eps):
    n, zero = out.shape[1], F(0.0)
    if affine == 0:
        for i in range(out.shape[0]):
            row = flat[start + i * stride : start + i * stride + n]
            _store(row, out[i], zero, _rms_inv(row, inv_n, eps), scale, shift, 0, False)
    elif affine == 1:
        for i in range(out.shape[0]):
            row = flat[start + i * stride : start + i * stride + n]
            _store(row, out[i], zero, _rms_inv(row, inv_n, eps), scale, shift, 1, False)
    else:
        for i in range(out.shape[0]):
            row = flat[start + i * stride : start + i * stride + n]
            _store(row, out[i], zero, _rms_inv(row, inv_n, eps), scale, shift, 2, False)


# RMSNorm times its weight, then the rotary embedding of adjacent pairs (FLUX.2's q/k), one pass per row: row i
# of x at ``flat[start + i * stride :][:n]``, its tables' rows at ``cos[c0 + i * cs :]`` and ``sin[s0 + i * ss :]``
# (n even); out[2j] = y[2j] cos[2j] + y[2j+1] (sin[2j] * -1), out[2j+1] = y[2j+1] cos[2j+1] + y[2j] sin[2j+1].
# Three vectorised loops over the row in cache (``work`` [2n]: y and its swapped pairs): y = (x * inv) * scale;
# each pair swapped with the sign of its first element flipped (one 64-bit rotate and xor per pair: the sign
# flip is exact, so t[2j] = -y[2j+1] and t[2j] * sin[2j] = y[2j+1] * (sin[2j] * -1)); out = y * cos + t * sin.
# A loop over the pairs storing both elements measured 1.5-3x slower (LLVM keeps it scalar).
@_rows
def rms_norm_rope_rows(flat, start, stride, out, scale, cos, c0, cs, sin, s0, ss, inv_n, eps, work):
    n = out.shape[1]
    y, t = work[:n], work[n : 2 * n]
    yu, tu = y.view(np.uint64), t.view(np.uint64)
    half, sign = np.uint64(32), np.uint64(0x80000000)  # the low half of a pair's 64 bits is its first element
    for i in range(out.shape[0]):
        row = flat[start + i * stride : start + i * stride + n]
        c = cos[c0 + i * cs : c0 + i * cs + n]
        s = sin[s0 + i * ss : s0 + i * ss + n]
        r = _rms_inv(row, inv_n, eps)
        dst = out[i]
        for j in range(n):
            y[j] = (row[j] * r) * scale[j]
        for k in range(n // 2):
            v = yu[k]
            tu[k] = ((v >> half) | (v << half)) ^ sign
        for j in range(n):
            dst[j] = y[j] * c[j] + t[j] * s[j]


@_rows
def layer_norm_strided(flat, start, stride, out, scale, shift, affine, inv_n, eps):
    n = out.shape[1]
    if affine == 0:
        for i in range(out.shape[0]):
            row = flat[start + i * stride : start + i * stride + n]
            mean, r = _layer_stats(row, inv_n, eps)
            _store(row, out[i], mean, r, scale, shift, 0, True)
    elif affine == 1:
        for i in range(out.shape[0]):
            row = flat[start + i * stride : start + i * stride + n]
            mean, r = _layer_stats(row, inv_n, eps)
            _store(row, out[i], mean, r, scale, shift, 1, True)
    else:
        for i in range(out.shape[0]):
            row = flat[start + i * stride : start + i * stride + n]
            mean, r = _layer_stats(row, inv_n, eps)
            _store(row, out[i], mean, r, scale, shift, 2, True)


# GroupNorm with its affine transform (and SiLU): per row of x's [N * G, n] view (one group of one sample),
# LayerNorm's two-pass statistics, then per channel of the group t = (x - mean) * (inv * scale[c]) + shift[c] (and
# t * sigmoid(t)) straight into the output: the row is read three times while in cache, the result written once.
# 512-bit vectors: the SiLU pass measured ~10% faster with them (16 x 256^2 on one core: 1.0-1.1 vs 1.1-1.2 ms).
@_inline
def _silu(t):
    # t * sigmoid(t) from e^-|t| (never overflows: exp_f32 gives 0 below its range), one division
    e = exp_f32(-abs(t))
    return t * ((F(1.0) if t >= F(0.0) else e) / (F(1.0) + e))


@_rows
def group_norm_rows(flat, start, stride, out, r0, r1, scale, shift, groups, hw, inv_n, eps, silu):
    """Rows ``r0:r1`` of x, row r at ``flat[start + r * stride :][:n]`` (n = out's row length), into ``out [R,
    n]``; row r is group ``r % groups`` of its sample, n / hw channels of hw elements each."""
    _wide_vectors()
    n = out.shape[1]
    cg = n // hw
    for r in range(r0, r1):
        row = flat[start + r * stride : start + r * stride + n]
        mean, inv = _layer_stats(row, inv_n, eps)
        dst = out[r]
        for k in range(cg):
            c = (r % groups) * cg + k
            a, b = inv * scale[c], shift[c]
            src, d = row[k * hw : (k + 1) * hw], dst[k * hw : (k + 1) * hw]
            if silu:
                for j in range(hw):
                    d[j] = _silu((src[j] - mean) * a + b)
            else:
                for j in range(hw):
                    d[j] = (src[j] - mean) * a + b


@_rows
def decode_fp8_rows(codes, scale, out, table):
    """``out[i, j] = table[codes[i, j]] * scale[i, 0]`` (fp8 bytes to f32 through their 256 values)."""
    for i in range(codes.shape[0]):
        row, dst, s = codes[i], out[i], scale[i, 0]
        for j in range(row.size):
            dst[j] = table[row[j]] * s


@_rows
def decode_nvfp4_rows(packed, scale_codes, out, pairs, scale_values, scale_2):
    """``out[i, 2j + e] = (pairs[packed[i, j], e] * s) * scale_2[0, 0]`` with ``s = scale_values[scale_codes[i,
    j // 8]]`` (a byte is two E2M1 codes in element order; one f8e4m3 scale per 16 elements, read as its byte
    through its 256 f32 values: ml_dtypes' own cast took 4 ns per scale on one core; ``scale_2`` is read when
    called: a weight)."""
    s2 = scale_2[0, 0]
    for i in range(packed.shape[0]):
        row, srow, dst = packed[i], scale_codes[i], out[i]
        for j in range(row.size):
            b = row[j]
            s = scale_values[srow[j >> 3]]
            dst[2 * j] = (pairs[b, 0] * s) * s2
            dst[2 * j + 1] = (pairs[b, 1] * s) * s2


@_rows
def conv_kw3_rows(x, w, bias, out, y0, y1):
    """A stride-1 convolution with kernels 3 wide, output rows ``y0:y1``: ``out[o, y, :] = bias[o] + sum over
    (c, i, j) of w[c, i, j, o] * x[c, y + i, j : j + Wo]`` for ``x [C, H, W]`` (already padded), ``w [C, kh, 3,
    O4]`` and ``bias [O4]`` zero-padded to O4, a multiple of 4 >= O, ``out [O, Ho, Wo]``. A direct convolution:
    each input row is read once per four output channels, no im2col (for the few-channel, wide layers of a VAE,
    where BLAS on an im2col matrix is bound by copying it). Sums in a fixed order. The rows being summed, ``acc
    [O4, Wo]`` (<= 256 kB here), are this call's own, and the channel loop runs to exactly their count: LLVM
    vectorises the sums only so (an ``acc`` argument, or a loop bound below the array's rows, runs 5x slower)."""
    nc, kh, no4 = x.shape[0], w.shape[1], w.shape[3]
    no, wo = out.shape[0], out.shape[2]
    acc = np.empty((no4, wo), np.float32)
    for y in range(y0, y1):
        for o in range(no4):
            b = bias[o]
            for j in range(wo):
                acc[o, j] = b
        for c in range(nc):
            for i in range(kh):
                row = x[c, y + i]
                for o in range(0, no4, 4):
                    w00, w01, w02, w03 = w[c, i, 0, o], w[c, i, 0, o + 1], w[c, i, 0, o + 2], w[c, i, 0, o + 3]
                    w10, w11, w12, w13 = w[c, i, 1, o], w[c, i, 1, o + 1], w[c, i, 1, o + 2], w[c, i, 1, o + 3]
                    w20, w21, w22, w23 = w[c, i, 2, o], w[c, i, 2, o + 1], w[c, i, 2, o + 2], w[c, i, 2, o + 3]
                    for j in range(wo):
                        r0, r1, r2 = row[j], row[j + 1], row[j + 2]
                        acc[o, j] += w00 * r0 + w10 * r1 + w20 * r2
                        acc[o + 1, j] += w01 * r0 + w11 * r1 + w21 * r2
                        acc[o + 2, j] += w02 * r0 + w12 * r1 + w22 * r2
                        acc[o + 3, j] += w03 * r0 + w13 * r1 + w23 * r2
        for o in range(no):
            for j in range(wo):
                out[o, y, j] = acc[o, j]

# ---- the fused Elementwise kernel: register code (expr.ElementwiseCode) over tiles -----------------------
# no fastmath at all: each instruction is one IEEE operation, as numpy's ufunc passes compute it
_exact = numba.njit(cache=True, nogil=True, error_model="numpy")
_exact_inline = numba.njit(cache=True, inline="always", error_model="numpy")
EXP_HIGH = F(88.72284)  # above this e^x overflows f32
EXP_ZERO = F(-104.0)  # below this e^x rounds to 0 in f32


@intrinsic
def _f32_pointer(typingctx, address):
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return sig, codegen


@_exact_inline
def exp_any(x):
    """e^x over every f32 input, as numpy's ``exp`` gives it: exp_f32's reduction and polynomial (in fused
    multiply-adds, which the exact kernels' flags would not contract), with 2^n applied as two factors (2^128 has no
    f32 exponent, and subnormal results need n < -126), inf above the f32 range, 0 below the subnormal one, NaN for
    NaN. No branches: the special cases are selects after the polynomial of the clamped argument, so a loop of it
    vectorises whole. Relative error < 1e-7 (numpy's own is 2e-7)."""
    xc = x if x > EXP_ZERO else EXP_ZERO  # NaN: clamped here, given back below
    xc = xc if xc < EXP_HIGH else EXP_HIGH
    n = np.floor(_fma(xc, F(1.4426950408889634), F(0.5)))
    r = _fma(n, F(-0.693359375), xc)
    r = _fma(n, F(2.12194440e-4), r)
    p = _fma(F(1.9875691500e-4), r, F(1.3981999507e-3))
    p = _fma(p, r, F(8.3334519073e-3))
    p = _fma(p, r, F(4.1665795894e-2))
    p = _fma(p, r, F(1.6666665459e-1))
    p = _fma(p, r, F(5.0000001201e-1))
    p = _fma(p * r, r, r) + F(1.0)
    k = np.int32(n)
    half = k >> np.int32(1)
    y = (p * _f32_from_bits((half + np.int32(127)) << np.int32(23))) * \
        _f32_from_bits((k - half + np.int32(127)) << np.int32(23))
    y = y if x > EXP_ZERO else F(0.0)
    y = y if x <= EXP_HIGH else F(np.inf)
    return y if x == x else x


@_exact  # called, not inlined: three call sites, one compiled body (numba's inlining multiplies compile time)
def _tile_io(table, k, reg_address, i, j0, rows, l0, cols, store):
    # operand k's box [i, j0:j0+rows, l0:l0+cols] <-> the register at reg_address (row by row); table[k] =
    # (address, strides). Registers are raw pointers: a slice of the register array per call would cost two atomic
    # reference-count updates, ~50 ns per instruction and tile, as much as the arithmetic of a small tile.
    _wide_vectors()
    reg = _f32_pointer(reg_address)
    p = _f32_pointer(table[k, 0])
    s0, s1, s2 = table[k, 1], table[k, 2], table[k, 3]
    if rows > 1 and s1 == cols * s2:  # the rows follow each other: one run of rows * cols elements
        at = i * s0 + j0 * s1 + l0 * s2
        n = rows * cols
        if store:
            if s2 == 1:
                for t in range(n):
                    p[at + t] = reg[t]
            else:
                for t in range(n):
                    p[at + t * s2] = reg[t]
        elif s2 == 1:
            for t in range(n):
                reg[t] = p[at + t]
        elif s2 == 0:
            v = p[at]
            for t in range(n):
                reg[t] = v
        else:
            for t in range(n):
                reg[t] = p[at + t * s2]
        return
    if cols == 2 and not store:  # short rows (pairs): both elements of a row per iteration
        at = i * s0 + j0 * s1 + l0 * s2
        if s1 == 2 and s2 == -1:  # the pairs of a contiguous run, each read reversed (vectorises: shuffles)
            q = at - 1
            for r in range(rows):
                a = p[q + 2 * r]
                b = p[q + 2 * r + 1]
                reg[2 * r] = b
                reg[2 * r + 1] = a
            return
        for r in range(rows):
            reg[2 * r] = p[at + r * s1]
            reg[2 * r + 1] = p[at + r * s1 + s2]
        return
    for r in range(rows):
        at = i * s0 + (j0 + r) * s1 + l0 * s2
        t = r * cols
        if store:
            if s2 == 1:
                for c in range(cols):
                    p[at + c] = reg[t + c]
            else:
                for c in range(cols):
                    p[at + c * s2] = reg[t + c]
        elif s2 == 1:
            for c in range(cols):
                reg[t + c] = p[at + c]
        elif s2 == 0:
            v = p[at]
            for c in range(cols):
                reg[t + c] = v
        else:
            for c in range(cols):
                reg[t + c] = p[at + c * s2]


@_exact
def elementwise_tiles(code, consts, table, shape, regs):
    """Evaluate register code over the box ``shape`` (3 axes) tile by tile: ``table[k]`` = (address, three
    strides in elements) of operand k (0 the output, k >= 1 the inputs);
    ``regs`` [registers, tile] f32 scratch. A tile is whole rows of the last axis, or a piece of one row.

    Where a tile of an operand is one contiguous run, nothing is copied: its Load makes the register read the
    operand's memory in place, and the operation whose result the Store writes out computes straight into the
    output (where a tile of the output is one run). Only strided, broadcast or reversed tiles are copied into
    registers. The values are the same either way (each operation still rounds once, in the same order); in
    place, a kernel that writes over its own input (the memory planner's in-place kernels) reads each element
    before it writes it, in the same instruction."""
    _wide_vectors()
    d0, d1, d2 = shape[0], shape[1], shape[2]
    width = regs.shape[1]
    if d0 == 0 or d1 == 0 or d2 == 0:
        return
    rows, cols = (1, width) if d2 >= width else (width // d2, d2)
    start = 0
    while start < code.shape[0] and code[start, 0] == 0:  # constants: filled once
        regs[code[start, 1], :] = consts[code[start, 2]]
        start += 1
    base, size = regs.ctypes.data, 4 * width  # register r's own memory at base + r * size
    address = np.empty(regs.shape[0], np.int64)  # where register r's current value is read from
    for r in range(regs.shape[0]):
        address[r] = base + r * size
    last = code.shape[0] - 1
    # the operation computing the stored register can write the output directly (not when the Store writes a
    # load or a constant: then there is no such operation)
    direct = last > start and code[last, 0] == 2 and code[last - 1, 0] >= 3 and code[last - 1, 1] == code[last, 2]
    # a pure copy (the stored register is a load): the load copies straight into the output's tile
    copy = last == start + 1 and code[start, 0] == 1 and code[last, 0] == 2 and code[start, 1] == code[last, 2]
    for i in range(d0):
        for j0 in range(0, d1, rows):
            nr = min(rows, d1 - j0)
            for l0 in range(0, d2, cols):
                nc = min(cols, d2 - l0)
                n = nr * nc
                wrote = False
                # the output's tile is one run (not where the box's axes were reordered: then it is written
                # through a register, row by row)
                run = table[0, 3] == 1 and (nr == 1 or table[0, 2] == nc)
                for c in range(start, code.shape[0]):
                    op, d, a, b = code[c, 0], code[c, 1], code[c, 2], code[c, 3]
                    if op == 1:
                        if copy and run:
                            out_at = table[0, 0] + 4 * (i * table[0, 1] + j0 * table[0, 2] + l0 * table[0, 3])
                            _tile_io(table, a, out_at, i, j0, nr, l0, nc, False)
                            wrote = True
                        elif table[a, 3] == 1 and (nr == 1 or table[a, 2] == nc):  # one run: read in place
                            address[d] = table[a, 0] + 4 * (i * table[a, 1] + j0 * table[a, 2] + l0)
                        else:
                            address[d] = base + d * size
                            _tile_io(table, a, address[d], i, j0, nr, l0, nc, False)
                        continue
                    if op == 2:
                        if not wrote:
                            _tile_io(table, 0, address[a], i, j0, nr, l0, nc, True)
                        continue
                    address[d] = base + d * size
                    wrote = False
                    if direct and run and c == last - 1:  # the result goes straight into the output's tile, unless an
                        # operand is that very memory (in place): LLVM's overlap test would then take its
                        # scalar loop
                        out_at = table[0, 0] + 4 * (i * table[0, 1] + j0 * table[0, 2] + l0 * table[0, 3])
                        if out_at != address[a] and out_at != address[b]:
                            address[d] = out_at
                            wrote = True
                    z = _f32_pointer(address[d])
                    x = _f32_pointer(address[a])
                    y = _f32_pointer(address[b])
                    if op == 3:
                        for t in range(n):
                            z[t] = x[t] + y[t]
                    elif op == 4:
                        for t in range(n):
                            z[t] = x[t] * y[t]
                    elif op == 5:
                        for t in range(n):
                            z[t] = np.fmod(x[t], y[t])
                    elif op == 6:
                        for t in range(n):
                            z[t] = F(1.0) / x[t]
                    elif op == 7:
                        for t in range(n):
                            z[t] = np.sqrt(x[t])
                    elif op == 8:
                        for t in range(n):
                            z[t] = exp_any(x[t])
                    elif op == 9:
                        for t in range(n):
                            z[t] = np.exp2(x[t])
                    elif op == 10:
                        for t in range(n):
                            z[t] = np.log2(x[t])
                    elif op == 11:
                        for t in range(n):
                            z[t] = np.sin(x[t])
                    else:  # Logistic: 1 / (e^(x * y) + w), y and w constant registers
                        w = _f32_pointer(address[code[c, 4]])
                        for t in range(n):
                            z[t] = F(1.0) / (exp_any(x[t] * y[t]) + w[t])


# ---- Winograd F(2x2, 3x3) convolution: the transforms around one batched BLAS product per band of tiles -------
# out = A^T [(G w G^T) * (B^T d B)] A per 2x2 output tile d-> 4x4 input patch (Lavin & Gray, "Fast Algorithms for
# Convolutional Neural Networks", 2015): 16 products per tile instead of 36, i.e. 2.25x fewer multiplications, the
# sum over input channels being 16 matrix products [O, C] @ [C, tiles] (BLAS). Each loop below touches one or two
# arrays with unit stride (the vectoriser gives up on a loop with many possibly aliasing arrays), and the 16
# planes are written one loop each (16 store streams 2^k bytes apart thrash L1's sets).
@_rows
def winograd_weights(w, u):
    """``u[4a + b, o, c] = (G w[o, c] G^T)[a, b]`` for ``w [O, C, 3, 3]``, ``G = [[1, 0, 0], [1/2, 1/2, 1/2],
    [1/2, -1/2, 1/2], [0, 0, 1]]`` (``winograd_weight_rows`` over every output channel)."""
    winograd_weight_rows(np.int64(w.ctypes.data), w.strides[0] // 4, w.strides[1] // 4, w.strides[2] // 4,
                         w.strides[3] // 4, w.shape[1], u, 0, w.shape[0])


@_rows
def winograd_weight_rows(wa, s0, s1, s2, s3, nc, u, o0, o1):
    """``winograd_weights`` for the output channels ``o0:o1`` of the f32 weight at address ``wa`` with element
    strides ``s0..s3`` (by address: one machine-code version whatever the weight's layout), ``nc`` input
    channels: per output channel, the nine taps gathered into rows over the input channels, then every step a
    loop over those rows (vectorised)."""
    h = F(0.5)
    wp = _f32_pointer(wa)
    g = np.empty((9, nc), np.float32)  # g[3i + j, c] = w[o, c, i, j]
    gw = np.empty((12, nc), np.float32)  # gw[3a + j] = (G w[o])[a, j]
    for o in range(o0, o1):
        for c in range(nc):
            for q in range(9):
                g[q, c] = wp[o * s0 + c * s1 + (q // 3) * s2 + (q % 3) * s3]
        for j in range(3):  # G over the kernel's rows
            g0, g1, g2 = g[j], g[3 + j], g[6 + j]
            r0, r1, r2, r3 = gw[j], gw[3 + j], gw[6 + j], gw[9 + j]
            for c in range(nc):
                r0[c] = g0[c]
                r1[c] = h * ((g0[c] + g2[c]) + g1[c])
                r2[c] = h * ((g0[c] + g2[c]) - g1[c])
                r3[c] = g2[c]
        for a in range(4):  # then G^T over its columns, into u's planes 4a .. 4a + 3
            b0, b1, b2 = gw[3 * a], gw[3 * a + 1], gw[3 * a + 2]
            d0, d1, d2, d3 = u[4 * a, o], u[4 * a + 1, o], u[4 * a + 2, o], u[4 * a + 3, o]
            for c in range(nc):
                d0[c] = b0[c]
                d1[c] = h * ((b0[c] + b2[c]) + b1[c])
                d2[c] = h * ((b0[c] + b2[c]) - b1[c])
                d3[c] = b2[c]


@_rows
def winograd_input(x, v, ty0, ty1, tw, top, left):
    """``v[4a + b, c, (ty - ty0) * tw + tx] = (B^T d B)[a, b]`` for the tiles of rows ``ty0:ty1``, ``d = p[c, 2ty :
    2ty + 4, 2tx : 2tx + 4]``, ``B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]``, where ``p``
    is ``x [C, H, W]`` zero-padded by ``top`` rows and ``left`` columns (and as many as needed after it: ``p[c,
    r, j] = x[c, r - top, j - left]`` inside x, else 0; the padding is never written out; x's rows have unit
    stride); ``tw`` tiles per row, ``v [16, C, >= (ty1 - ty0) tw]`` with unit stride along the tiles. Rows and
    planes are addressed through raw pointers: a slice per row and plane (~30 per channel and row of tiles) cost
    two atomic reference-count updates each (one row of tiles, fastest of 300 on one core: 32 channels x 256
    wide 20.7 -> 14.3 us, 128 channels x 32 wide 31.5 -> 13.5 us)."""
    nc, hx, wx = x.shape
    n = 2 * tw + 2
    ja, jb = min(max(0, left), n), max(min(n, left + wx), 0)  # the padded row's columns that hold data
    ja = min(ja, jb)
    m, sa = jb - ja, ja - left  # the data columns' count, and the first one's index in x
    zero = np.zeros(max(wx, 1), np.float32)  # a padding row
    t = np.zeros((4, n), np.float32)  # B^T of the four input rows of a row of tiles (zero where padding)
    eo = np.empty((2, tw + 1), np.float32)  # one row of t's even and odd columns
    sc, sr = x.strides[0] // 4, x.strides[1] // 4
    sp, sv = v.strides[0] // 4, v.strides[1] // 4
    xa, za, ta, va = np.int64(x.ctypes.data), np.int64(zero.ctypes.data), np.int64(t.ctypes.data), \
        np.int64(v.ctypes.data)
    te, to = _f32_pointer(np.int64(eo.ctypes.data)), _f32_pointer(np.int64(eo.ctypes.data) + 4 * (tw + 1))
    d0, d1 = _f32_pointer(ta + 4 * ja), _f32_pointer(ta + 4 * (n + ja))
    d2, d3 = _f32_pointer(ta + 4 * (2 * n + ja)), _f32_pointer(ta + 4 * (3 * n + ja))
    for c in range(nc):
        for ty in range(ty0, ty1):
            r = 2 * ty - top
            base = xa + 4 * (c * sc + sa)
            s0 = _f32_pointer(base + 4 * r * sr if 0 <= r < hx else za)
            s1 = _f32_pointer(base + 4 * (r + 1) * sr if 0 <= r + 1 < hx else za)
            s2 = _f32_pointer(base + 4 * (r + 2) * sr if 0 <= r + 2 < hx else za)
            s3 = _f32_pointer(base + 4 * (r + 3) * sr if 0 <= r + 3 < hx else za)
            # B^T over the four rows, whole rows at once (the padding columns stay 0)
            for j in range(m):
                d0[j] = s0[j] - s2[j]
            for j in range(m):
                d1[j] = s1[j] + s2[j]
            for j in range(m):
                d2[j] = s2[j] - s1[j]
            for j in range(m):
                d3[j] = s1[j] - s3[j]
            at = va + 4 * (c * sv + (ty - ty0) * tw)
            for a in range(4):  # then B over each tile's four columns, one plane per loop
                row = _f32_pointer(ta + 4 * a * n)
                for j in range(tw + 1):  # even and odd columns apart (one pass; a loop reading every other
                    te[j] = row[2 * j]  # element of a row alone compiles to gathers)
                    to[j] = row[2 * j + 1]
                d = _f32_pointer(at + 4 * (4 * a) * sp)
                for tx in range(tw):
                    d[tx] = te[tx] - te[tx + 1]
                d = _f32_pointer(at + 4 * (4 * a + 1) * sp)
                for tx in range(tw):
                    d[tx] = to[tx] + te[tx + 1]
                d = _f32_pointer(at + 4 * (4 * a + 2) * sp)
                for tx in range(tw):
                    d[tx] = te[tx + 1] - to[tx]
                d = _f32_pointer(at + 4 * (4 * a + 3) * sp)
                for tx in range(tw):
                    d[tx] = to[tx] - to[tx + 1]


@_rows
def winograd_output(m, bias, out, ty0, ty1, tw):
    """``out[o, 2ty : 2ty + 2, 2tx : 2tx + 2] = bias[o] + A^T M A`` for the tiles of rows ``ty0:ty1``, ``M[a, b] =
    m[4a + b, o, (ty - ty0) * tw + tx]``, ``A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]``; ``out [O, Ho, Wo]`` (``Wo =
    2 tw``, unit stride along a row), ``m [16, >= O, >= (ty1 - ty0) tw]`` (unit stride along the tiles), ``bias
    [>= O]``. Raw pointers, as in ``winograd_input``."""
    no = out.shape[0]
    s = np.empty((8, tw), np.float32)
    sa = np.int64(s.ctypes.data)
    sp, so = m.strides[0] // 4, m.strides[1] // 4
    oc, orow = out.strides[0] // 4, out.strides[1] // 4
    ma, oa = np.int64(m.ctypes.data), np.int64(out.ctypes.data)
    for o in range(no):
        b = bias[o]
        for ty in range(ty0, ty1):
            at = ma + 4 * (o * so + (ty - ty0) * tw)
            for q in range(4):  # A^T over the rows of M: s[q] its first row, s[4 + q] its second
                m0, m1 = _f32_pointer(at + 4 * q * sp), _f32_pointer(at + 4 * (4 + q) * sp)
                m2, m3 = _f32_pointer(at + 4 * (8 + q) * sp), _f32_pointer(at + 4 * (12 + q) * sp)
                sq = _f32_pointer(sa + 4 * q * tw)
                for tx in range(tw):
                    sq[tx] = (m0[tx] + m1[tx]) + m2[tx]
                sq = _f32_pointer(sa + 4 * (4 + q) * tw)
                for tx in range(tw):
                    sq[tx] = (m1[tx] - m2[tx]) - m3[tx]
            for r in range(2):  # then A over the columns, into output row 2ty + r
                y = _f32_pointer(oa + 4 * (o * oc + (2 * ty + r) * orow))
                s0, s1 = _f32_pointer(sa + 4 * (4 * r) * tw), _f32_pointer(sa + 4 * (4 * r + 1) * tw)
                s2, s3 = _f32_pointer(sa + 4 * (4 * r + 2) * tw), _f32_pointer(sa + 4 * (4 * r + 3) * tw)
                for tx in range(tw):
                    y[2 * tx] = b + ((s0[tx] + s1[tx]) + s2[tx])
                    y[2 * tx + 1] = b + ((s1[tx] - s2[tx]) - s3[tx])


def _sgemm_intrinsic(int_bits: int):
    """``cblas_sgemm(RowMajor, ta, tb, m, n, k, 1, a, lda, b, ldb, 0, c, ldc)`` through the function at ``fn``
    (an address), integers ``int_bits`` wide (an ILP64 or LP64 BLAS); matrices by address, ``ta``/``tb`` the
    CBLAS codes (111: no transpose, 112: transpose)."""

    @intrinsic
    def sgemm(typingctx, fn, ta, tb, m, n, k, a, lda, b, ldb, c, ldc):
        sig = types.none(*([types.int64] * 12))

        def codegen(context, builder, signature, args):
            i32, ix, f32 = ir.IntType(32), ir.IntType(int_bits), ir.FloatType()
            ptr = f32.as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, ix, ix, ix, f32, ptr, ix, ptr, ix, f32, ptr, ix])
            callee = builder.inttoptr(args[0], fnty.as_pointer())
            ta_, tb_, m_, n_, k_, a_, lda_, b_, ldb_, c_, ldc_ = args[1:]

            def width(v):
                return v if int_bits == 64 else builder.trunc(v, ix)

            builder.call(callee, [ir.Constant(i32, 101), builder.trunc(ta_, i32), builder.trunc(tb_, i32),
                                  width(m_), width(n_), width(k_), ir.Constant(f32, 1.0), builder.inttoptr(a_, ptr),
                                  width(lda_), builder.inttoptr(b_, ptr), width(ldb_), ir.Constant(f32, 0.0),
                                  builder.inttoptr(c_, ptr), width(ldc_)])
            return context.get_dummy_value()

        return sig, codegen

    return sgemm


_sgemm64, _sgemm32 = _sgemm_intrinsic(64), _sgemm_intrinsic(32)


WEIGHT_CHUNK = 32  # output channels per weight-transform task of ``winograd_bands``


@_rows
def winograd_bands(x, wa, ws, u, bias, out, v, m, bands, counter, tw, top, left, sgemm, ilp64):
    """A core's share of a Winograd convolution in one compiled call. The tasks, numbered by ``counter[0]``
    (shared by the cores, increased atomically: each core takes the next untaken one until none is left), are
    first the weight transform (``winograd_weight_rows`` of the f32 weight at address ``wa``, element strides
    ``ws``, into ``u [16, O, C]``, contiguous) in chunks of ``WEIGHT_CHUNK`` output channels, ``counter[1 + q]``
    set once chunk ``q`` is done, then the bands of tile rows ``bands[j] = (image, ty0, ty1)``: ``winograd_input``
    into ``v``, the 16 products ``m[p] = u[p] @ v[p]`` as single-threaded calls of the BLAS's ``cblas_sgemm`` at
    address ``sgemm`` (``ilp64``: 64-bit integers), and ``winograd_output`` into ``out[image]``. Before its first
    products a core transforms itself any chunk another core took but has not finished (the same values written
    twice, never a wait for a core the OS has descheduled). The same arithmetic as the per-band Python loop,
    without its ~2 us per band of dispatch, the GIL it holds between the calls, and the weight transform on one
    core. Returns how many bands this call ran."""
    no, nc = u.shape[1], u.shape[2]
    chunks = (no + WEIGHT_CHUNK - 1) // WEIGHT_CHUNK
    ua, va, ma = np.int64(u.ctypes.data), np.int64(v.ctypes.data), np.int64(m.ctypes.data)
    su, sv, sm = np.int64(u.strides[0]), np.int64(v.strides[0]), np.int64(m.strides[0])  # bytes between planes
    ldb, ldc = v.strides[1] // 4, m.strides[1] // 4
    taken, done = np.int64(counter.ctypes.data), np.int64(counter.ctypes.data) + 8
    ran, weights_ready = 0, False
    while True:
        j = _fetch_add(taken, np.int64(1))
        if j < chunks:
            winograd_weight_rows(wa, ws[0], ws[1], ws[2], ws[3], nc, u, j * WEIGHT_CHUNK,
                                 min(no, (j + 1) * WEIGHT_CHUNK))
            _fetch_add(done + 8 * j, np.int64(1))
            continue
        j -= chunks
        if j >= bands.shape[0]:
            return ran
        ran += 1
        i, t0, t1 = bands[j, 0], bands[j, 1], bands[j, 2]
        winograd_input(x[i], v, t0, t1, tw, top, left)
        if not weights_ready:
            for q in range(chunks):
                if _fetch_add(done + 8 * q, np.int64(0)) == 0:
                    winograd_weight_rows(wa, ws[0], ws[1], ws[2], ws[3], nc, u, q * WEIGHT_CHUNK,
                                         min(no, (q + 1) * WEIGHT_CHUNK))
                    _fetch_add(done + 8 * q, np.int64(1))
            weights_ready = True
        n = (t1 - t0) * tw
        for p in range(16):
            if ilp64:
                _sgemm64(sgemm, 111, 111, no, n, nc, ua + p * su, nc, va + p * sv, ldb, ma + p * sm, ldc)
            else:
                _sgemm32(sgemm, 111, 111, no, n, nc, ua + p * su, nc, va + p * sv, ldb, ma + p * sm, ldc)
        winograd_output(m, bias, out[i], t0, t1, tw)


@_rows
def upsample2_rows(src, dst, r0, r1):
    """The 2x nearest-neighbour upsampling of ``src [R, W]``'s rows ``r0:r1`` into ``dst [2R, 2W]``: each value
    written twice along its row, then the row written again below (one pass; the strided copies of a repeated
    view took ~5x longer: 32 x 128^2 -> 256^2 1.51 vs 0.32 ms on one core)."""
    w = src.shape[1]
    for r in range(r0, r1):
        s, d0, d1 = src[r], dst[2 * r], dst[2 * r + 1]
        for j in range(w):
            v = s[j]
            d0[2 * j] = v
            d0[2 * j + 1] = v
        for j in range(2 * w):
            d1[j] = d0[j]
