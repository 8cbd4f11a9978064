"""f32 kernels as compiled calls where the CPU backend ran numpy or BLAS from Python, so that the CPU chains
(``chain.py``) run them between the other kernels' calls (a decoding step then runs as one chain):

- ``rows_product``: a product of a few rows (decoding: one token's activations) against a weight stored as rows
  (``out[m, n] = x[m] . w[n]``, the layout of a ``Linear``'s ``[out, in]`` weight read as ``w^T``): one pass over
  the weight, each row read once from memory and dotted with every row of ``x`` from the cache. Such a product is
  bound by memory bandwidth; OpenBLAS's ``sgemv`` read weights at about half the rate of this loop here (Zen 4:
  ~15 vs ~30 GB/s on one core). The dot products are reassociated (``fastmath`` reassoc: LLVM vectorises them),
  each in the compiled code's fixed order, so an output does not depend on how the rows ``n`` are split over the
  cores.
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


@_fast
def rows_product(x, x0, xs, w, w0, ws, out, o0, os_, m, k, n0, n1):
    """``out[o0 + i*os_ + n] = sum_j x[x0 + i*xs + j] * w[w0 + n*ws + j]`` for rows ``i < m`` and ``n0 <= n <
    n1``: ``x`` [m, k] and ``w`` [N, k] row by row (unit stride along k), ``out`` [m, N] (unit stride along N)."""
    for n in range(n0, n1):
        wa = w0 + n * ws
        wn = w[wa:wa + k]
        for i in range(m):
            xa = x0 + i * xs
            xm = x[xa:xa + k]
            s = F(0.0)
            for j in range(k):  # (slices: indices from 0, no wraparound check, so the loop vectorises)
                s += xm[j] * wn[j]
            out[o0 + i * os_ + n] = s


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
