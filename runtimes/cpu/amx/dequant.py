"""``x @ dequant(W).T`` for FP8 and NVFP4 weights on the CPU's AMX tiles, at f32 accuracy, W kept packed.

Why three tile products, not bf16x3's six (``amx.gemm``): a decoded quantized weight is exactly a bf16. An fp8
value (e4m3: 4 significant bits, e5m2: 3) lies inside bf16's exponent range; an NVFP4 element is an E2M1 code
(<= 2 significant bits) times its f8e4m3 block scale (4 bits): <= 6 significant bits, |w| in [2^-10, 2688]. What
is left of the decoding, one factor per output column (NVFP4's ``weight_scale_2``, fp8's per-tensor or
per-channel scale), multiplies the f32 result instead. So only x is cut into three bf16 parts (``x = hi + mid +
lo``, exact) and ``y = (hi w + mid w + lo w) * scale``: each tile product is exact in the f32 accumulator, nothing
is dropped; the error is the accumulator's f32 rounding plus one rounding of the column scale (an f32 GEMM of the
decoded weight rounds each decoded value and each sum instead: the two agree with float64 alike, see
tests/runtimes/test_amx_dequant.py).

Decoding straight into AMX's VNNI layout: a tile of B is 16 k-pairs x 16 columns, each 4-byte word the two
consecutive k of one column. An NVFP4 byte holds two consecutive k of one output row, so one lookup of a
65536-entry table, ``(scale byte << 8) | code byte -> word`` (256 KiB; the few scales of a layer keep their rows
in L1), gives a whole word; fp8 e4m3fn is decoded arithmetically, 16 columns x 16 k pairs at a time in
registers (transposed there into VNNI rows), other fp8 through a 256-entry bf16 table, two to a word.

Loop order (per part, one per core, each owning a range of output columns, or of x's rows where the weight has
fewer rows than x): the weight is decoded a block at a time, ``kc`` k by ``nc`` columns (<= 1 MiB of bf16: it
stays in the core's L2), and that block is used for every 32-row panel of x, each panel cut into its three bf16
parts once per block (``amx.gemm.pack_a``); each k block is summed in fresh tile accumulators and added into the
output in f32 (a sum of block sums rounds less than one running sum over K), and the column scale is applied to
each 32 x 32 block after its last. Neither the weight nor x is ever converted whole.

Falls back (the caller's BLAS path, the same values as without AMX): an x with a value that is not finite (inf
minus inf in its parts, inf times a zero part), a weight with an infinity (fp8 e5m2: inf times a zero part of x
would be NaN), layouts the kernel does not read (see ``readable``), products too small or decode-bound
(``worth_it``), and whatever ``runtimes/cpu/amx/`` refuses. (numba's disk cache checks only the file of the cached
function: the kernels compile ``amx.gemm``'s ``pack_a`` and intrinsics into their own code.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from luminal_recipes.graph.dtypes import E2M1_VALUES, E4M3_VALUES

from .. import amx

B_BLOCK_BYTES = 1 << 20  # a part's decoded weight block (bf16): in its core's 2 MiB L2 with a panel of x
KC_MOST = 512  # k per block at most (more k per block: fewer passes over the output's partial sums)
MIN_MACS = 1 << 23  # as amx.MIN_MACS: smaller products stay on the decode-then-BLAS path
# (see worth_it) fp8 decoded through the table (e5m2; e4m3fn is decoded in registers, 2x faster: 1.5-1.7x the
# bands at one row) times one row of x, 1 x 6144 x 6144: tiles 0.79-1.12x the bands' speed; 8 rows already 1.5x
FP8_MIN_ROWS = 2

# how the kernel reads the weight (as amx.dequant_gemm's): fp8 through the table, fp8 with infinities (checked),
# NVFP4 (ModelOpt scales, comfy's tiled ones), fp8 e4m3fn decoded in registers
FP8, FP8_INF, NVFP4, NVFP4_TILED, FP8_E4M3 = 0, 1, 2, 3, 4
BLOCK = 32  # as amx.gemm.BLOCK: columns per panel, rows per panel of x


# ---- the decode tables ------------------------------------------------------------------------------------
def _bf16_bits(values: np.ndarray) -> np.ndarray | None:
    """The bf16 bits (uint32) of f32 values that are exactly bf16, or None if one is not (then no table)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    finite = np.isfinite(values)
    if np.any(bits[finite] & 0xFFFF):
        return None
    return bits >> 16


@functools.lru_cache(maxsize=8)
def fp8_table(dtype: np.dtype) -> np.ndarray | None:
    """uint32[256]: the bf16 bits of each fp8 byte's value (a VNNI word is two of them: ``t[b0] | t[b1] << 16``;
    a table of byte pairs would be 256 KiB, and its lookups of random pairs missed L1: 2x slower)."""
    bf = _bf16_bits(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32))
    return None if bf is None else bf.astype(np.uint32)


@functools.lru_cache(maxsize=8)
def nvfp4_table(layout: str, scale_dtype: np.dtype) -> np.ndarray | None:
    """uint32[65536]: the VNNI word of a packed E2M1 byte times its block scale, at ``scale byte << 8 | byte``
    (ModelOpt: element 0 in the low nibble; comfy: in the high one). The products are those of ``ops.quant``
    (``e2m1 * f32(scale)``), each exactly a bf16."""
    return _nvfp4_words(layout, np.arange(256, dtype=np.uint8).view(scale_dtype).astype(np.float32))


def _nvfp4_words(layout: str, scales: np.ndarray) -> np.ndarray | None:
    """``nvfp4_table`` for the scale bytes' values ``scales`` (float32[256])."""
    codes = np.arange(256)
    first, second = (codes & 15, codes >> 4) if layout == "modelopt" else (codes >> 4, codes & 15)
    with np.errstate(invalid="ignore"):
        lo = scales[:, None] * E2M1_VALUES[first][None, :]
        hi = scales[:, None] * E2M1_VALUES[second][None, :]
    lo_bits, hi_bits = _bf16_bits(lo), _bf16_bits(hi)
    if lo_bits is None or hi_bits is None:
        return None
    return (lo_bits | (hi_bits << 16)).astype(np.uint32).reshape(65536)


# ---- plans and steps --------------------------------------------------------------------------------------
def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclass(frozen=True)
class Plan:
    """``x [m, k] @ W[n, k].T`` cut into ``parts``, one per core, each ``(r0, r1, c0, c1)``: rows of x and output
    columns (multiples of 32), each part decoding blocks of ``kc`` k by ``nc`` columns."""

    m: int
    k: int
    n: int
    kc: int
    nc: int
    parts: tuple[tuple[int, int, int, int], ...]

    @property
    def scratch_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        return [((3, 1, BLOCK, self.kc), np.dtype(np.uint16)), ((self.nc // BLOCK, self.kc // 2, BLOCK),
                np.dtype(np.uint32)), ((BLOCK + 1, BLOCK), np.dtype(np.float32)), ((64,), np.dtype(np.uint8))]


def plan(m: int, k: int, n: int, threads: int) -> Plan:
    """Parts own columns (each decodes its own, all parts cut all of x into bf16 parts) where the weight has at
    least as many rows as x, else rows of x (each part decodes all of the smaller weight)."""
    by_columns = n >= m
    blocks = _round_up(n if by_columns else m, BLOCK) // BLOCK
    threads = max(1, min(threads, blocks, m * k * n // amx.MACS_PER_PART))
    bounds = [min(blocks * i // threads * BLOCK, n if by_columns else m) for i in range(threads + 1)]
    if by_columns:
        parts = tuple((0, m, bounds[i], bounds[i + 1]) for i in range(threads))
    else:
        parts = tuple((bounds[i], bounds[i + 1], 0, n) for i in range(threads))
    # K <= 256 in two blocks of 128: measured 1.2-1.3x faster than one of 256 (768 x 256 x 2304); larger K in
    # blocks of KC_MOST (vs 128: 1.05-1.15x at K = 2048-6144)
    kc = min(_round_up(max(k, 1), BLOCK), KC_MOST if k > 256 else 128)
    widest = max(c1 - c0 for _, _, c0, c1 in parts)
    nc = min(_round_up(widest, BLOCK), max(BLOCK, B_BLOCK_BYTES // (2 * kc) // BLOCK * BLOCK))
    return Plan(m, k, n, kc, nc, parts)


def worth_it(m: int, k: int, n: int, min_rows: int = 1) -> bool:
    """Whether ``x [m, k] @ W[n, k].T`` goes to the tiles: ~8M multiply-adds at least (below, the decode and
    the hand-offs to the cores cost more than the product), ``min_rows`` rows of x (``FP8_MIN_ROWS`` for fp8
    weights decoded through the table: times one row, decoding is all, and the bands' vectorised f32 pass is as
    fast), on a CPU where the kernels run (``ready``)."""
    return m >= min_rows and m * k * n >= MIN_MACS and n >= BLOCK and ready()


@dataclass(frozen=True)
class Weight:
    """How the kernel reads one packed weight: ``fmt``, its decode table, the byte arrays (weight, NVFP4 scales)
    and the column scale (an f32 array of one value, or one per output row)."""

    fmt: int
    table: np.ndarray
    packed: np.ndarray  # [rows, bytes] uint8-sized elements with unit column stride
    scales: np.ndarray | None  # NVFP4: [N, K / 16] bytes (unit column stride), or comfy's 5-D tiles (C-contiguous)
    col_scale: np.ndarray  # f32, [1] / [1, 1] (per tensor) or [N] / [N, 1]
    n_rows: int  # the weight's real rows (comfy pads them to 16)


def readable(w: Weight) -> bool:
    """Whether the kernel can read these arrays in place (else the caller keeps its BLAS path)."""
    if w.packed.ndim != 2 or w.packed.itemsize != 1 or w.packed.strides[1] != 1:
        return False
    if w.fmt == NVFP4 and (w.scales is None or w.scales.ndim != 2 or w.scales.strides[1] != 1):
        return False
    if w.fmt == NVFP4_TILED and (w.scales is None or w.scales.ndim != 5 or not w.scales.flags.c_contiguous):
        return False
    return w.col_scale.dtype == np.float32 and w.col_scale.size in (1, w.n_rows)


def product(p: Plan, x: np.ndarray, weight: Weight, out: np.ndarray, scratch: list[list[np.ndarray]]):
    """A step computing ``out = (x @ decoded(W).T) * col_scale`` on the cores (``out`` [m, n] f32,
    C-contiguous): returns False, ``out`` unfinished, where x has a value that is not finite or the weight an
    infinity (the caller then computes it on BLAS)."""
    reason = amx.reason_unavailable()  # also asks Linux for the tiles, before any tile instruction
    if reason:
        raise RuntimeError(f"AMX products unavailable: {reason}")
    if x.dtype != np.float32 or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("AMX dequant products take an f32 x and a C-contiguous f32 output")
    from .. import threads as cpu_threads
    from .dequant_gemm import dequant_gemm

    cs = weight.col_scale
    cs_stride = 0 if cs.size == 1 else cs.strides[0]
    s = weight.scales
    if weight.fmt == NVFP4:
        s_addr, s_rs, s_cb = s.ctypes.data, s.strides[0], 0
    elif weight.fmt == NVFP4_TILED:
        s_addr, s_rs, s_cb = s.ctypes.data, 0, s.shape[1]
    else:
        s_addr, s_rs, s_cb = 0, 0, 0
    head = (weight.fmt, weight.table, x.ctypes.data, *x.strides, p.k, weight.packed.ctypes.data,
            weight.packed.strides[0], s_addr, s_rs, s_cb, weight.n_rows, cs.ctypes.data, cs_stride, out)
    failed = [0] * len(p.parts)

    def part(i, bounds, buffers):
        failed[i] = dequant_gemm(*head, *bounds, *buffers)

    parts = [functools.partial(part, i, bounds, bufs) for i, (bounds, bufs) in enumerate(zip(p.parts, scratch))]

    def step() -> bool:
        failed[:] = [0] * len(failed)
        cpu_threads.run_parts(parts)
        return not any(failed)

    return step


def _check_kernels() -> bool:
    """AMX runs here and the kernel, compiled (or loaded from numba's cache), gives numpy's product of the decoded
    weight on a small odd-shaped NVFP4 one: checked once per process, so that a broken toolchain keeps BLAS."""
    if not amx.ready():
        return False
    try:
        rng = np.random.default_rng(0)
        m, k, n = 40, 80, 50
        x = rng.standard_normal((m, k)).astype(np.float32)
        packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
        # E4M3 scale bytes of values in [0.5, 1.5), decoded from their bits (no ml_dtypes: ``E4M3_VALUES``)
        codes = rng.choice(np.flatnonzero((E4M3_VALUES >= 0.5) & (E4M3_VALUES < 1.5)), (n, k // 16)).astype(np.uint8)
        scales = E4M3_VALUES[codes]
        table = _nvfp4_words("modelopt", E4M3_VALUES)
        weight = Weight(NVFP4, table, packed, codes, np.full(1, 0.37, np.float32), n)
        p = plan(m, k, n, 1)
        out = np.full((m, n), np.nan, np.float32)
        done = product(p, x, weight, out, [[amx.aligned_empty(sh, d) for sh, d in p.scratch_shapes]])()
        lo, hi = E2M1_VALUES[packed & 15], E2M1_VALUES[packed >> 4]
        dense = np.stack([lo, hi], -1).reshape(n, k) * np.repeat(scales, 16, axis=1) * 0.37
        return done and bool(np.allclose(out, x @ dense.T, rtol=1e-5, atol=1e-4))
    except Exception:  # noqa: BLE001 - any failure to compile or run means: use BLAS
        return False


ready = amx.checked_once(_check_kernels)
