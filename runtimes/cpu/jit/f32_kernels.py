"""f32 kernels as compiled calls where the CPU backend ran numpy or BLAS from Python, so that the CPU chains
(``chain.py``) run them between the other kernels' calls (a decoding step then runs as one chain):

- ``rows_product``: a product of a few rows (decoding: one token's activations) against a weight stored as rows
  (``out[m, n] = x[m] . w[n]``, the layout of a ``Linear``'s ``[out, in]`` weight read as ``w^T``): one pass over
  the weight, each row read once from memory and dotted with every row of ``x`` from the cache. Such a product is
  bound by memory bandwidth; OpenBLAS's ``sgemv`` read weights at about half the rate of this loop here (Zen 4:
  ~15 vs ~30 GB/s on one core). It reads ``ROWS`` (12) weight rows at once, each with its own accumulator: twelve
  streams through memory rather than one. A torch model's weights lie in 4 KiB pages (numpy asks Linux for huge
  pages on large arrays, torch does not), where a core's hardware prefetcher stops at every page's end: on the
  Intel Xeon of bench/README.md one row at a time read them at 10.6-13.0 GB/s (PyTorch's MKL 11.9-12.8), twelve
  at 13.1-14.4 (``bench/decode_matvec.py``; one stream over 2 MiB pages: ~18.5).
  The dot products are reassociated (``fastmath`` reassoc: LLVM vectorises them); row ``n`` is always dotted in
  the same lane of a group aligned at a multiple of ``ROWS`` (a group cut by a part's ends reads the rows
  around it again and writes only its own), so an output does not depend on how the rows ``n`` are split over
  the cores.
- ``cols_product``: the same for a right operand stored row by row (``[k, N]``, unit stride along N).
- ``sgemm_tasks``: a larger product cut into chunks (``tasks``: rows or columns of the output), each one
  single-threaded ``cblas_sgemm`` call of numpy's own OpenBLAS at its address (``..cblas``); every core calls it
  with the same arguments and takes the next chunk no core has taken (an atomic counter, reset by ``reset``
  before), so a core the OS gives less time simply runs fewer chunks and a chunk is computed the same whoever
  runs it.

- ``copy_rows``: a concatenation's box copies (``x + 0``, as the padded sum computes them), rows of a 3-D box;
  ``add_rows`` adds a box in place (a product's bias or residual); ``copy_box``: the same copy where the innermost
  axis is strided in either array (a ``stack`` along a new last axis interleaves its pieces: diffusers' RoPE
  rotation writes every second element), so the loop runs along that axis instead of one call-sized row per
  element.

Operands are passed as flat runs of memory (1-D, contiguous) with element offsets and strides, so one compiled
version serves every layout and the inner loops read contiguous memory.
"""

from __future__ import annotations

import numba
import numpy as np

from .disk_cache import install as _install_cache_locator

_install_cache_locator()  # the kernels below compile in numba_kernels' helpers (the atomic add)

from .numba_kernels import _fetch_add, _sgemm32, _sgemm64  # noqa: E402 - after the cache locator

F = np.float32
_fast = numba.njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True, error_model="numpy")
_contract = numba.njit(fastmath={"contract"}, cache=True, nogil=True, error_model="numpy")
_plain = numba.njit(cache=True, nogil=True, error_model="numpy")


ROWS = 12  # weight rows a rows_product group reads at once (AVX2's 16 vector registers hold their 12 sums)


@_plain
def _row(w, a, p, d, ws, k):
    """Row ``p`` of a group at ``a`` (``w``'s rows ``ws`` apart), or its row ``d`` where ``p > d``: a slice (indices
    from 0, no wraparound check, so the dot products vectorise)."""
    b = a + min(p, d) * ws
    return w[b:b + k]


@_plain
def _put(out, o, p, lo, hi, s):
    """``out[o + p] = s`` where lane ``p`` is one of the part's rows (``lo <= p < hi``)."""
    if lo <= p < hi:
        out[o + p] = s


@_fast
def rows_product(x, x0, xs, w, w0, ws, out, o0, os_, m, k, n0, n1):
    """``out[o0 + i*os_ + n] = sum_j x[x0 + i*xs + j] * w[w0 + n*ws + j]`` for rows ``i < m`` and ``n0 <= n <
    n1``: ``x`` [m, k] and ``w`` [N, k] row by row (unit stride along k), ``out`` [m, N] (unit stride along N).
    Groups of ``ROWS`` rows start at multiples of ``ROWS`` (rows past ``n1 - 1`` read row ``n1 - 1`` again):
    each row's sum is computed in its own lane (``n % ROWS``) of the same code whatever ``n0`` and ``n1``."""
    last = n1 - 1
    for g in range(n0 - n0 % ROWS, n1, ROWS):
        a = w0 + g * ws
        d = last - g  # rows past the end read the last row again
        r0, r1, r2, r3 = _row(w, a, 0, d, ws, k), _row(w, a, 1, d, ws, k), _row(w, a, 2, d, ws, k), \
            _row(w, a, 3, d, ws, k)
        r4, r5, r6, r7 = _row(w, a, 4, d, ws, k), _row(w, a, 5, d, ws, k), _row(w, a, 6, d, ws, k), \
            _row(w, a, 7, d, ws, k)
        r8, r9, r10, r11 = _row(w, a, 8, d, ws, k), _row(w, a, 9, d, ws, k), _row(w, a, 10, d, ws, k), \
            _row(w, a, 11, d, ws, k)
        for i in range(m):
            xa = x0 + i * xs
            xm = x[xa:xa + k]
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = s8 = s9 = s10 = s11 = F(0.0)
            for j in range(k):
                v = xm[j]
                s0 += v * r0[j]
                s1 += v * r1[j]
                s2 += v * r2[j]
                s3 += v * r3[j]
                s4 += v * r4[j]
                s5 += v * r5[j]
                s6 += v * r6[j]
                s7 += v * r7[j]
                s8 += v * r8[j]
                s9 += v * r9[j]
                s10 += v * r10[j]
                s11 += v * r11[j]
            o = o0 + i * os_ + g
            lo, hi = n0 - g, n1 - g  # this part's rows only (a tuple indexed by lane here cost 25% in the cache)
            _put(out, o, 0, lo, hi, s0)
            _put(out, o, 1, lo, hi, s1)
            _put(out, o, 2, lo, hi, s2)
            _put(out, o, 3, lo, hi, s3)
            _put(out, o, 4, lo, hi, s4)
            _put(out, o, 5, lo, hi, s5)
            _put(out, o, 6, lo, hi, s6)
            _put(out, o, 7, lo, hi, s7)
            _put(out, o, 8, lo, hi, s8)
            _put(out, o, 9, lo, hi, s9)
            _put(out, o, 10, lo, hi, s10)
            _put(out, o, 11, lo, hi, s11)


@_contract
def cols_product(x, x0, xs, b, b0, bs, out, o0, os_, m, k, n0, n1):
    """``out[i, n] = sum_j x[i, j] * b[j, n]`` for rows ``i < m`` and ``n0 <= n < n1``, with ``b`` [k, N] row by row
    (unit stride along N: attention's ``p v``, a weight stored ``[in, out]``): per row of ``x``, the rows of ``b``
    scaled and added in order of ``j`` (each output's sum in that fixed order, however the columns are split)."""
    w = n1 - n0
    for i in range(m):
        oa = o0 + i * os_ + n0
        o = out[oa:oa + w]
        for c in range(w):
            o[c] = F(0.0)
        xa = x0 + i * xs
        for j in range(k):
            xv = x[xa + j]
            ba = b0 + j * bs + n0
            row = b[ba:ba + w]
            for c in range(w):
                o[c] += xv * row[c]


# per task (a chunk of the product): byte offsets of its a, b and c from the operands' addresses, and m, n, k
TASK_COLUMNS = 6


@_plain
def sgemm_tasks(geometry, tasks, counter, fn, ilp64):
    """Take chunks of a product (``tasks``, ``TASK_COLUMNS`` each) from ``counter[0]`` until none is left, each
    one ``cblas_sgemm`` call at address ``fn``. ``geometry``: a, b, c addresses, ``ta``, ``tb`` (CBLAS codes),
    ``lda``, ``ldb``, ``ldc``. Returns how many chunks this call ran."""
    a, b, c = geometry[0], geometry[1], geometry[2]
    ta, tb, lda, ldb, ldc = geometry[3], geometry[4], geometry[5], geometry[6], geometry[7]
    at = np.int64(counter.ctypes.data)
    ran = 0
    while True:
        j = _fetch_add(at, np.int64(1))
        if j >= tasks.shape[0]:
            return ran
        ran += 1
        m, n, k = tasks[j, 3], tasks[j, 4], tasks[j, 5]
        if ilp64:
            _sgemm64(fn, ta, tb, m, n, k, a + tasks[j, 0], lda, b + tasks[j, 1], ldb, c + tasks[j, 2], ldc)
        else:
            _sgemm32(fn, ta, tb, m, n, k, a + tasks[j, 0], lda, b + tasks[j, 1], ldb, c + tasks[j, 2], ldc)


@_plain
def reset(counter):
    """``counter[:] = 0`` (the next product's chunks start from the first)."""
    for i in range(counter.shape[0]):
        counter[i] = 0


@_plain
def copy_rows(dst, dg, src, sg):
    """``dst[a, b, :] = src[a, b, :] + 0`` over a 3-D box: ``dg`` = its shape and ``dst``'s two outer element
    strides, ``sg`` = ``src``'s (rows contiguous in both). No fastmath: ``x + 0`` is an IEEE addition (-0.0
    becomes +0.0, as in the padded sum a concatenation is)."""
    n0, n1, n2 = dg[0], dg[1], dg[2]
    for a in range(n0):
        for b in range(n1):
            da = a * dg[3] + b * dg[4]
            sa = a * sg[0] + b * sg[1]
            d = dst[da:da + n2]
            s = src[sa:sa + n2]
            for j in range(n2):
                d[j] = s[j] + F(0.0)


@_plain
def add_rows(dst, dg, src, sg):
    """``dst[a, b, :] += src[a, b, :]`` over a 3-D box (``copy_rows``' layout: a product's bias or residual)."""
    n0, n1, n2 = dg[0], dg[1], dg[2]
    for a in range(n0):
        for b in range(n1):
            da = a * dg[3] + b * dg[4]
            sa = a * sg[0] + b * sg[1]
            d = dst[da:da + n2]
            s = src[sa:sa + n2]
            for j in range(n2):
                d[j] = d[j] + s[j]


@_plain
def copy_box(dst, dg, src, sg):
    """``dst[a, b, c] = src[a, b, c] + 0`` over a 3-D box of any element strides: ``dg`` = its shape and ``dst``'s
    three element strides, ``sg`` = ``src``'s three (``copy_rows`` for a box whose rows are strided). Indices
    are unsigned (the strides are never negative here), so numba checks no wraparound: 3x faster."""
    n0, n1, n2 = dg[0], dg[1], numba.uint64(dg[2])
    d2, s2 = numba.uint64(dg[5]), numba.uint64(sg[2])
    for a in range(n0):
        for b in range(n1):
            da = numba.uint64(a * dg[3] + b * dg[4])
            sa = numba.uint64(a * sg[0] + b * sg[1])
            for j in range(n2):
                dst[da + j * d2] = src[sa + j * s2] + F(0.0)
