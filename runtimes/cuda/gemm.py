"""GEMM descriptors in cuBLAS terms, derived from operand views, and a numpy model of exactly that descriptor.

cuBLAS is column-major: ``C (m x n, ldc) = alpha * op(A) (m x k) @ op(B) (k x n) + beta * C``, with ``batch``
matrices ``stride_*`` elements apart (``gemmStridedBatchedEx``, f32 accumulation). A row-major product
``out [M, N] = X [M, K] @ Y [K, N]`` is the column-major ``out^T = Y^T X^T``: cuBLAS ``A`` is ``Y``, ``B`` is
``X``, ``m = N, n = M``. A row-major matrix with unit column stride is a column-major one transposed, with the row
stride as leading dimension; one with unit row stride is column-major as it is. Anything else (stride 0 inside a
matrix, padding, two non-unit strides) is not expressible: the caller copies that operand into scratch.

``run_model`` executes a descriptor on flat numpy buffers exactly as cuBLAS reads and writes them (the leading
dimensions, transposes and batch strides included), after checking that every element it touches lies inside
its buffer: cuda-emu runs every GEMM through it, so a wrong descriptor fails on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from luminal_recipes.graph.view import BoundView

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUDA_DATA_TYPE = {"float32": 0, "float16": 2, "bfloat16": 14, "float8_e4m3fn": 28, "float8_e5m2": 29}
F32 = np.dtype(np.float32)


class GemmLayoutError(ValueError):
    """The views cannot be read in place by one strided-batched GEMM."""


@dataclass(frozen=True)
class GemmDesc:
    trans_a: bool
    trans_b: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    alpha: float
    beta: float
    a_type: np.dtype
    b_type: np.dtype
    c_type: np.dtype

    def check(self) -> None:
        """cuBLAS's own argument checks (it refuses these with CUBLAS_STATUS_INVALID_VALUE)."""
        rows_a = self.k if self.trans_a else self.m
        rows_b = self.n if self.trans_b else self.k
        if min(self.m, self.n, self.k, self.batch) < 0:
            raise GemmLayoutError(f"negative size in {self}")
        if self.lda < max(1, rows_a) or self.ldb < max(1, rows_b) or self.ldc < max(1, self.m):
            raise GemmLayoutError(f"leading dimension too small in {self}")

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch


def _extent(rows: int, cols: int, ld: int, stride: int, batch: int) -> int:
    """Elements from the first to one past the last one a column-major (rows x cols, ld) batch touches."""
    if 0 in (rows, cols, batch):
        return 0
    return (batch - 1) * stride + (cols - 1) * ld + rows


def footprint(desc: GemmDesc) -> tuple[int, int, int]:
    """Elements each of A, B, C spans from its base pointer."""
    ra, ca = (desc.k, desc.m) if desc.trans_a else (desc.m, desc.k)
    rb, cb = (desc.n, desc.k) if desc.trans_b else (desc.k, desc.n)
    return (_extent(ra, ca, desc.lda, desc.stride_a, desc.batch), _extent(rb, cb, desc.ldb, desc.stride_b, desc.batch),
            _extent(desc.m, desc.n, desc.ldc, desc.stride_c, desc.batch))


def _colmajor(buf: np.ndarray, byte_offset: int, dtype: np.dtype, rows: int, cols: int, ld: int, stride: int,
              batch: int, what: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    need = _extent(rows, cols, ld, stride, batch)
    if byte_offset < 0 or byte_offset % dtype.itemsize or byte_offset + need * dtype.itemsize > buf.nbytes:
        raise GemmLayoutError(f"GEMM {what}: {batch} x ({rows} x {cols}, ld {ld}, stride {stride}) {dtype} at byte "
                              f"{byte_offset} reaches past its buffer of {buf.nbytes} bytes")
    if need == 0:
        return np.zeros((batch, rows, cols), dtype)
    flat = buf.reshape(-1).view(np.uint8)[byte_offset: byte_offset + need * dtype.itemsize].view(dtype)
    item = dtype.itemsize
    twin = flat if dtype.isbuiltin == 1 else flat.view(f"u{item}")
    out = np.lib.stride_tricks.as_strided(twin, (batch, rows, cols), (stride * item, item, ld * item),
                                          writeable=True)
    return out if out.dtype == dtype else out.view(dtype)


def run_model(desc: GemmDesc, a: tuple[np.ndarray, int], b: tuple[np.ndarray, int], c: tuple[np.ndarray, int],
              scale: float = 1.0) -> None:
    """``C = alpha * scale * op(A) op(B) + beta * C`` on ``(buffer, byte offset)`` operands, f32 accumulation,
    one rounding to C's type (cuBLAS's result for these types, up to the order of the K-sum). ``scale`` is the
    product of cuBLASLt's per-tensor A/B scales (1 for plain cuBLAS)."""
    desc.check()
    ra, ca = (desc.k, desc.m) if desc.trans_a else (desc.m, desc.k)
    rb, cb = (desc.n, desc.k) if desc.trans_b else (desc.k, desc.n)
    am = _colmajor(*a, desc.a_type, ra, ca, desc.lda, desc.stride_a, desc.batch, "A")
    bm = _colmajor(*b, desc.b_type, rb, cb, desc.ldb, desc.stride_b, desc.batch, "B")
    cm = _colmajor(*c, desc.c_type, desc.m, desc.n, desc.ldc, desc.stride_c, desc.batch, "C")
    if desc.batch == 0 or desc.m == 0 or desc.n == 0:
        return
    opa = am.astype(F32).transpose(0, 2, 1) if desc.trans_a else am.astype(F32)
    opb = bm.astype(F32).transpose(0, 2, 1) if desc.trans_b else bm.astype(F32)
    acc = np.matmul(opa, opb)
    alpha = np.float32(desc.alpha * scale)
    if alpha != 1:
        acc *= alpha
    if desc.beta != 0:
        acc += np.float32(desc.beta) * cm.astype(F32)
    with np.errstate(over="ignore"):
        cm[...] = acc.astype(desc.c_type)


# ---- descriptors from views ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Matrix:
    """A row-major logical matrix ``[rows, cols]`` read through strides ``(sr, sc)`` from element ``offset``."""

    rows: int
    cols: int
    sr: int
    sc: int
    offset: int

    def as_cublas(self) -> tuple[bool, int] | None:
        """``(row_major, ld)`` when cuBLAS can read this matrix in place, else None. A row-major matrix (unit
        column stride) is the column-major storage of its transpose with ld = row stride; a column-major one
        (unit row stride) is stored as it is with ld = column stride. A size-1 axis's stride is free."""
        rows, cols, sr, sc = self.rows, self.cols, self.sr, self.sc
        if rows <= 1 and cols <= 1:
            return True, max(cols, 1)
        if rows <= 1:
            return (True, cols) if sc == 1 else ((False, sc) if sc > 0 else None)
        if cols <= 1:
            return (False, rows) if sr == 1 else ((True, sr) if sr > 0 else None)
        if sc == 1 and sr >= cols:
            return True, sr
        if sr == 1 and sc >= rows:
            return False, sc
        return None


def split_batch(shape: tuple[int, ...], strides_list: list[tuple[int, ...]]) -> tuple[tuple[int, ...], int,
                                                                                      list[tuple[int, ...]],
                                                                                      list[int]]:
    """Split batch axes into ``outer`` axes (looped over, one GEMM call each) and one flattened inner batch
    expressible as a single stride per operand: the longest suffix of axes every operand strides uniformly.
    Returns (outer shape, inner count, per operand the outer strides, per operand the inner stride)."""
    axes = [i for i, d in enumerate(shape) if d != 1]
    inner: list[int] = []
    for ax in reversed(axes):
        trial = [ax] + inner
        ok = True
        for st in strides_list:
            for x, y in zip(trial, trial[1:]):
                if st[x] != st[y] * shape[y]:
                    ok = False
        if not ok:
            break
        inner = trial
    count = math.prod(shape[i] for i in inner) if inner else 1
    inner_strides = [st[inner[-1]] if inner else 0 for st in strides_list]
    outer_axes = [i for i in axes if i not in inner]
    outer = tuple(shape[i] for i in outer_axes)
    return outer, count, [tuple(st[i] for i in outer_axes) for st in strides_list], inner_strides


def matmul_desc(x: Matrix, y: Matrix, out_ld: int, batch: int, stride_x: int, stride_y: int, stride_out: int,
                x_type, y_type, out_type, alpha: float = 1.0, beta: float = 0.0) -> GemmDesc:
    """The descriptor of ``out [M, N] (row stride out_ld) = alpha * X [M, K] @ Y [K, N] + beta * out``, batched.
    Raises GemmLayoutError when X or Y cannot be read in place."""
    xa, ya = x.as_cublas(), y.as_cublas()
    if xa is None or ya is None:
        raise GemmLayoutError("operand not readable by cuBLAS in place")
    # cuBLAS A = Y^T (N x K): Y row-major (unit col stride) is col-major Y^T -> op N; else op T
    y_rowmajor, lda = ya
    x_rowmajor, ldb = xa
    desc = GemmDesc(trans_a=not y_rowmajor, trans_b=not x_rowmajor, m=y.cols, n=x.rows, k=x.cols, lda=lda,
                    ldb=ldb, ldc=out_ld, stride_a=stride_y, stride_b=stride_x, stride_c=stride_out, batch=batch,
                    alpha=alpha, beta=beta, a_type=np.dtype(y_type), b_type=np.dtype(x_type),
                    c_type=np.dtype(out_type))
    # a size-1 dimension's leading dimension is free: give cuBLAS the smallest legal one
    rows_a = desc.k if desc.trans_a else desc.m
    rows_b = desc.n if desc.trans_b else desc.k
    return replace(desc, lda=max(desc.lda, rows_a, 1), ldb=max(desc.ldb, rows_b, 1))


def matrix_of(bv: BoundView, offset_extra: int = 0) -> Matrix:
    return Matrix(bv.shape[-2], bv.shape[-1], bv.strides[-2], bv.strides[-1], bv.offset + offset_extra)
