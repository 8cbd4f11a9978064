"""One (head, query block) task of the numpy runtime's Attention kernel, both products on the AMX tiles (bf16x3,
f32 accuracy: ``amx_gemm``), in one compiled call that releases the GIL.

``p v`` on AMX needs ``p`` cut into its three bf16 parts; done as a separate pass over the ``(rows, T)`` block of
``p`` that costs what the faster product saves (bench/README "MatMul and attention on AMX tiles"). Here the
softmax pass that computes ``p`` writes its parts as it goes, straight into the packed A layout ``amx_gemm.gemm``
reads (``[3, 1, rows, Tp]`` bf16: k = the keys, padded to 32 with zeros), while the row is in L1; the product
then runs with ``a_packed`` and never packs ``p`` itself. In order, per task:

1. ``q * scale`` (the rows of the block, read in place at any strides), as the BLAS path scales q;
2. ``scores = (q * scale) k^T`` on AMX (``gemm``: k read in place, panels of 32 keys packed per call);
3. per score row: max, ``exp(x - max)`` in place, the row's sum, then the row split into p's three parts
   (numpy_jit's compiled exp, 512-bit vectors);
4. ``out = p v`` on AMX (v read in place) and each output row divided by its sum.

Returns 0 when done, 1 when q or k holds a value that is not finite (nothing is finished: the caller computes
the task on BLAS), 2 when p or v does (``scores`` then holds ``p`` in f32 and ``sums`` its sums: the caller
finishes with ``p v`` on BLAS): in bf16 parts inf times a zero part would give NaN. ``runtimes/amx.py`` says
when AMX may run; ``numpy_attention`` decides per kernel at prepare time and keeps the BLAS path for every other
case (a bias, outputs that are not f32 rows, no AMX, no numba).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from .amx_gemm import BLOCK, _load_f32, _put, _split_16, gemm
from .numpy_jit import _wide_vectors, exp_shifted, row_max_vec, row_sum_vec

_FAST = {"contract"}  # as numpy_jit's row kernels: FMA contraction only, IEEE infinities and NaNs


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def buffers(rows: int, d: int, t: int, dv: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The scratch arrays of ``task`` (shapes, dtypes) for blocks of up to ``rows`` query rows: packed q, a
    panel of k^T, packed p, a panel of v, the edge block and the tile configuration. Besides these a task needs
    its ``(rows, T)`` f32 scores and ``(rows,)`` sums."""
    r, dp, tp = _round_up(rows, BLOCK), _round_up(d, BLOCK), _round_up(t, BLOCK)
    u16, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    return [((r, d), f32), ((3, 1, r, dp), u16), ((3, dp // 2, BLOCK, 2), u16), ((3, 1, r, tp), u16),
            ((3, tp // 2, BLOCK, 2), u16), ((BLOCK, BLOCK), f32), ((64,), np.dtype(np.uint8))]


@numba.njit(fastmath=_FAST, cache=True, nogil=True, error_model="numpy")
def _softmax_parts(scores, rows, sums, p_buf):
    """Rows ``0:rows`` of ``scores``: ``exp(x - max)`` in place, their sums, and p's three bf16 parts written to
    ``p_buf`` [3, 1, R, Tp] (zero past the keys and on the padding rows up to a multiple of 32). 1 if p holds a
    value that is not finite."""
    _wide_vectors()
    t = scores.shape[1]
    tp = p_buf.shape[3]
    t16 = t - t % 16
    part_bytes = p_buf.strides[0]
    bad = 0
    for i in range(rows):
        row = scores[i]
        exp_shifted(row, row_max_vec(row))
        sums[i] = row_sum_vec(row)
        src = row.ctypes.data
        dst = p_buf.ctypes.data + i * p_buf.strides[2]
        for j in range(0, t16, 16):
            bad |= _split_16(src + j * 4, dst + j * 2, part_bytes)
        for j in range(t16, t):
            bad |= _put(p_buf, 0, i, j, row[j])
        for j in range(t, tp):
            p_buf[0, 0, i, j] = 0
            p_buf[1, 0, i, j] = 0
            p_buf[2, 0, i, j] = 0
    for i in range(rows, min(p_buf.shape[2], _round_up_rows(rows))):
        p_buf[:, 0, i, :] = 0
    return bad


@numba.njit(cache=True, inline="always")
def _round_up_rows(rows):
    return (rows + BLOCK - 1) // BLOCK * BLOCK


@numba.njit(fastmath=_FAST, cache=True, nogil=True, error_model="numpy")
def task(q, q_rs, q_cs, k, k_rs, k_cs, v, v_rs, v_cs, scale, scores, sums, out,
         qs, q_buf, k_buf, p_buf, v_buf, edge, config):
    """``out = softmax((q * scale) k^T) v`` for one block of query rows: ``q`` [rows, D], ``k`` [T, D] and ``v``
    [T, Dv] f32 at addresses ``q``, ``k``, ``v`` (strides in bytes), ``scores`` [rows, T] and ``sums`` [rows]
    f32 scratch, ``out`` [rows, Dv] f32 with contiguous rows; the rest as ``buffers`` gave (``qs``: at least
    ``rows`` rows). 0, 1 or 2 as the module says."""
    rows, t = scores.shape[0], scores.shape[1]
    d = qs.shape[1]
    for i in range(rows):
        src = q + i * q_rs
        for j in range(d):
            qs[i, j] = _load_f32(src + j * q_cs) * scale
    if gemm(qs.ctypes.data, qs.strides[0], qs.strides[1], k, k_cs, k_rs, d, scores, 0, rows, 0, t,
            q_buf, k_buf, edge, config, 0):
        return 1
    if _softmax_parts(scores, rows, sums, p_buf):
        return 2
    if gemm(0, 0, 0, v, v_rs, v_cs, t, out, 0, rows, 0, out.shape[1], p_buf, v_buf, edge, config, 1):
        return 2
    for i in range(rows):
        s = sums[i]
        for j in range(out.shape[1]):
            out[i, j] = out[i, j] / s
    return 0



@functools.cache
def ready() -> bool:
    """AMX products run here (``amx.ready``) and ``task`` compiles (or loads from numba's cache) and gives the
    float64 reference on a small odd-shaped block: checked once per process, so that a broken toolchain
    falls back to the BLAS path."""
    from . import amx

    if not amx.ready():
        return False
    try:
        rng = np.random.default_rng(0)
        rows, t, d, dv = 40, 70, 33, 20
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((rows, d), (t, d), (t, dv)))
        scores, out = np.empty((rows, t), np.float32), np.empty((rows, dv), np.float32)
        sums = np.empty(rows, np.float32)
        scratch = [amx.aligned_empty(shape, dtype) for shape, dtype in buffers(rows, d, t, dv)]
        status = task(q.ctypes.data, *q.strides, k.ctypes.data, *k.strides, v.ctypes.data, *v.strides,
                      np.float32(0.3), scores, sums, out, *scratch)
        s = (q.astype(np.float64) @ k.T.astype(np.float64)) * 0.3
        p = np.exp(s - s.max(axis=1, keepdims=True))
        want = (p @ v.astype(np.float64)) / p.sum(axis=1, keepdims=True)
        return status == 0 and bool(np.allclose(out, want, rtol=1e-5, atol=1e-5))
    except Exception:  # noqa: BLE001 - any failure to compile or run means: use BLAS
        return False
