"""numpy ``DequantMatMul``: ``x @ dequant(W).T`` with W kept packed (FP8, or NVFP4 in the ModelOpt or ComfyUI
layout).

With numba (``jit``), a band is decoded by one compiled pass per row, the rows split over the cores; the numpy
passes below remain where it is missing (same values: the same products in the same order).

The weight is decoded a band of output rows at a time into an f32 scratch (``DEQUANT_TILE`` elements) and
each band is one BLAS product into its columns of the output, so the dense weight never exists whole. Decoding
follows ``ops.quant`` exactly (same products in the same order, in f32):

- fp8: ``w = f32(weight) * scale`` with ``scale`` per tensor (``[]``/``[1]``) or per output channel
  (``[N]``/``[N, 1]``). Two fp8 bytes at a time are decoded through a 65536-entry table of f32 pairs (numpy
  indexing is several times faster than a per-element dtype conversion).
- nvfp4: each byte holds two E2M1 codes (ModelOpt: element 0 in the low nibble; comfy: in the high nibble);
  one 256-entry table maps a byte straight to its two f32 values. ``w = (e2m1 * f32(weight_scale)) *
  weight_scale_2``, with one f8e4m3 scale per 16 inputs; comfy scales are stored in cuBLAS 128x4 tiles and are
  untiled band by band.

On a CPU with AMX tiles (``runtimes/cpu/amx/dequant.py``), a large enough product runs there instead: the weight
decoded block by block straight into bf16 tiles (exact), x cut into three bf16 parts, f32 accuracy; the bands
above remain for what it refuses (an x with a value that is not finite, an infinite fp8 weight), with a smaller
band (``FALLBACK_TILE``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from luminal_recipes.graph.dtypes import E2M1_VALUES, DType

from ...kernels.context import Bind, KernelContext
from .. import jit
from .. import threads as cpu_threads
from ..amx import dequant as amx_dequant
from .common import F32, bind_all, with_refresh
from .operands import operand

# decoded weight elements per band (16 MiB in f32): each band is one BLAS call, which packs all of x again, so
# narrow bands cost more than the decoding (measured at x [512, 6144] @ [3072, 6144]^T: 4 MiB bands 0.65x the dense
# product's speed, 16 MiB 0.77x, the whole weight at once 0.80x; at [1024, 2048] @ [2048, 2048]^T 0.86x -> 0.90x;
# at one row of x, where decoding is all, the same time)
DEQUANT_TILE = 1 << 22
FALLBACK_TILE = 1 << 18  # with AMX the bands only serve the rare x with a value that is not finite
NVFP4_BLOCK = 16


def byte_table(layout: str) -> np.ndarray:
    """uint64[256]: the two f32 values of a packed byte, in element order, as one 8-byte word."""
    codes = np.arange(256)
    lo, hi = E2M1_VALUES[codes & 15], E2M1_VALUES[codes >> 4]
    pairs = np.stack([lo, hi] if layout == "modelopt" else [hi, lo], axis=1).astype(np.float32)
    return np.ascontiguousarray(pairs).view(np.uint64).reshape(256)


@lru_cache(maxsize=4)
def fp8_pair_table(dtype: np.dtype) -> np.ndarray:
    """uint64[65536]: the two f32 values of two consecutive fp8 bytes (element 0 in the low byte)."""
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    words = np.arange(65536)
    pairs = np.stack([values[words & 255], values[words >> 8]], axis=1)
    return np.ascontiguousarray(pairs).view(np.uint64).reshape(65536)


def prepare_dequant_matmul(ctx: KernelContext) -> Bind:
    fmt = ctx.node.attr("format")
    n_out, k_in = int(ctx.node.attr("out_features")), int(ctx.node.attr("in_features"))
    x_shape = ctx.inputs[0].view.shape
    if x_shape[-1] != k_in or ctx.shape != x_shape[:-1] + (n_out,):
        ctx.fail(f"x {x_shape} and out {ctx.shape} do not match in_features={k_in}, out_features={n_out}")
    rows = math.prod(x_shape[:-1])
    x_op = operand(ctx, 0, dtype=F32, shape=(rows, k_in), blas=True)
    tiles = _amx_plan(ctx, fmt, rows, k_in, n_out)
    tile = DEQUANT_TILE if tiles is None else FALLBACK_TILE
    if fmt == "fp8":
        n_scales = 3
        band, decode, ops, tile_weight = _prepare_fp8(ctx, n_out, k_in, tile)
    elif fmt == "nvfp4":
        n_scales = 4
        band, decode, ops, tile_weight = _prepare_nvfp4(ctx, n_out, k_in, tile)
    else:
        ctx.fail(f"format must be 'fp8' or 'nvfp4', got {fmt!r}")
    if len(ctx.inputs) not in (n_scales, n_scales + 1):
        ctx.fail(f"{fmt} expects {n_scales} inputs (x, packed weight, scales) and an optional bias")
    bias_op = operand(ctx, n_scales) if len(ctx.inputs) > n_scales else None
    dense = ctx.scratch.add((band, k_in), F32)
    acc = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    all_ops = [x_op, *ops, bias_op]

    def bind(out, flats, scratch):
        arrays = bind_all(all_ops, flats, scratch)
        x, bias = arrays[0], arrays[-1]
        target = out if acc is None else scratch[acc]
        out2 = target.reshape(rows, n_out)
        bands = []
        for n0 in range(0, n_out, band):
            n1 = min(n0 + band, n_out)
            w = scratch[dense][: n1 - n0]
            bands.append((decode(arrays[1:-1], scratch, n0, n1, w), w.T, out2[:, n0:n1]))
        on_tiles = None
        if tiles is not None:
            weight = tile_weight(arrays[1:-1])
            if weight is not None and amx_dequant.readable(weight) and out2.flags.c_contiguous:
                p, ids = tiles
                on_tiles = amx_dequant.product(p, x, weight, out2, [[scratch[i] for i in part] for part in ids])

        def body():
            if on_tiles is None or not on_tiles():
                for dec, wt, dst in bands:
                    dec()
                    np.matmul(x, wt, out=dst)
            if bias is not None:
                np.add(target, bias, out=target, dtype=F32)
            if acc is not None:
                np.copyto(out, target, casting="unsafe")

        return with_refresh(all_ops, body)

    return bind


def _amx_plan(ctx: KernelContext, fmt: str, rows: int, k_in: int, n_out: int):
    """The AMX product's plan (one part per core) and each part's scratch, or None (the bands on BLAS): large
    enough products of an f32-computed layer whose decoded weights are exact in bf16 (``amx.dequant``'s
    tables), where numba and AMX run."""
    table_fp8 = fmt == "fp8" and np.dtype(ctx.inputs[1].dtype) != np.dtype(DType.F8E4M3.np)
    if not jit.AVAILABLE or not amx_dequant.worth_it(rows, k_in, n_out,
                                                     amx_dequant.FP8_MIN_ROWS if table_fp8 else 1):
        return None
    if fmt == "fp8" and amx_dequant.fp8_table(np.dtype(ctx.inputs[1].dtype)) is None:
        return None
    if fmt == "nvfp4":
        scale_dtype = np.dtype(ctx.inputs[2].dtype)
        layout = ctx.node.attr("layout", "modelopt")
        if scale_dtype.itemsize != 1 or layout not in ("modelopt", "comfy") or amx_dequant.nvfp4_table(
                layout, scale_dtype) is None:
            return None
    p = amx_dequant.plan(rows, k_in, n_out, cpu_threads.THREADS)
    return p, [[ctx.scratch.add(shape, dtype) for shape, dtype in p.scratch_shapes] for _ in p.parts]


def _band_rows(k_in: int, multiple: int, n_out: int, tile: int = DEQUANT_TILE) -> int:
    rows = max(multiple, (tile // max(k_in, 1)) // multiple * multiple)
    return min(rows, -(-n_out // multiple) * multiple)


def _prepare_fp8(ctx: KernelContext, n_out: int, k_in: int, tile: int = DEQUANT_TILE):
    w_shape, s_shape = ctx.inputs[1].view.shape, ctx.inputs[2].view.shape
    if w_shape != (n_out, k_in):
        ctx.fail(f"fp8 weight is {w_shape}, expected {(n_out, k_in)}")
    per_channel = math.prod(s_shape) == n_out and n_out != 1 and s_shape in ((n_out,), (n_out, 1))
    if not per_channel and math.prod(s_shape) != 1:
        ctx.fail(f"fp8 scale {s_shape} is neither per tensor ([] / [1]) nor per channel ([{n_out}] / "
                 f"[{n_out}, 1])")
    w_op = operand(ctx, 1)
    s_op = operand(ctx, 2, dtype=F32, shape=(n_out, 1) if per_channel else (1, 1))
    band = _band_rows(k_in, 16, n_out, tile)
    # byte pairs need rows contiguous along K (a direct view with unit stride, or the scratch copy)
    paired = k_in % 2 == 0 and (not w_op.direct or w_op.view.strides[-1] == 1)
    # compiled: each fp8 byte through its 256 f32 values, one pass per row (the weight read in place)
    compiled = jit.AVAILABLE and w_op.direct
    values = np.arange(256, dtype=np.uint8).view(ctx.inputs[1].dtype).astype(np.float32)
    codes = None if compiled else ctx.scratch.add((band, k_in // 2 if paired else k_in), np.intp)
    table = fp8_pair_table(ctx.inputs[1].dtype) if paired and not compiled else None

    def decode(arrays, scratch, n0, n1, w):
        wq, s = arrays
        s_band = s[n0:n1] if per_channel else s
        if compiled:  # one pass per row through the 256 values, the rows split over the cores
            scale = s_band if per_channel else np.broadcast_to(s, (n1 - n0, 1))
            return jit.by_rows(jit.kernels("lowp").decode_fp8_rows, [wq[n0:n1].view(np.uint8), scale, w], values)
        idx = scratch[codes][: n1 - n0]
        if paired:
            raw = wq[n0:n1].view(np.uint8).view(np.uint16)
            words = w.view(np.uint64)

            def run():
                np.copyto(idx, raw, casting="unsafe")
                np.take(table, idx, out=words, mode="clip")
                np.multiply(w, s_band, out=w)
        else:
            def run():
                np.copyto(w, wq[n0:n1], casting="unsafe")
                np.multiply(w, s_band, out=w)

        return run

    w_dtype = np.dtype(ctx.inputs[1].dtype)
    if w_dtype == np.dtype(DType.F8E4M3.np):
        fmt = amx_dequant.FP8_E4M3
    elif np.isinf(np.arange(256, dtype=np.uint8).view(w_dtype).astype(np.float32)).any():
        fmt = amx_dequant.FP8_INF
    else:
        fmt = amx_dequant.FP8

    def tile_weight(arrays):
        wq, s = arrays
        table = amx_dequant.fp8_table(w_dtype)
        return None if table is None else amx_dequant.Weight(fmt, table, wq.view(np.uint8), None, s[:, 0], n_out)

    return band, decode, [w_op, s_op], tile_weight


def _prepare_nvfp4(ctx: KernelContext, n_out: int, k_in: int, tile: int = DEQUANT_TILE):
    layout = ctx.node.attr("layout", "modelopt")
    if layout not in ("modelopt", "comfy"):
        ctx.fail(f"nvfp4 layout must be 'modelopt' or 'comfy', got {layout!r}")
    if k_in % NVFP4_BLOCK:
        ctx.fail(f"nvfp4 needs in_features divisible by {NVFP4_BLOCK}, got {k_in}")
    blocks = k_in // NVFP4_BLOCK
    w_shape, s_shape, s2_shape = (ctx.inputs[i].view.shape for i in (1, 2, 3))
    if layout == "modelopt":
        want_w, want_s = (n_out, k_in // 2), (n_out, blocks)
    else:
        want_w = (-(-n_out // 16) * 16, -(-k_in // 16) * 16 // 2)
        want_s = (-(-n_out // 128) * 128, -(-blocks // 4) * 4)
    if w_shape != want_w or s_shape != want_s or math.prod(s2_shape) != 1:
        ctx.fail(f"nvfp4 ({layout}) weight {w_shape}, weight_scale {s_shape}, weight_scale_2 {s2_shape}; "
                 f"expected {want_w}, {want_s} and one value for a [{n_out}, {k_in}] weight")
    w_op = operand(ctx, 1)
    s2_op = operand(ctx, 3, dtype=F32, shape=(1, 1))
    multiple = 128 if layout == "comfy" else 16
    band = _band_rows(k_in, multiple, n_out, tile)
    table = byte_table(layout)
    value_pairs = table.view(np.float32).reshape(256, 2)  # the same table as two f32 per byte
    # compiled: one pass per row reads the packed bytes in place and each (f8e4m3) scale as its byte through
    # its 256 f32 values; numpy: the scales cast to f32 (ml_dtypes, ~4 ns each) and products over the band
    scale_dtype = np.dtype(ctx.inputs[2].dtype)
    compiled = jit.AVAILABLE and w_op.direct and scale_dtype.itemsize == 1
    scale_values = np.arange(256, dtype=np.uint8).view(scale_dtype).astype(np.float32) if compiled else None
    # np.take wants intp indices: converted in planned memory
    codes = None if compiled else ctx.scratch.add((band, k_in // 2), np.intp)
    if layout == "modelopt":
        s_op = operand(ctx, 2)
        scales = None if compiled else ctx.scratch.add((band, blocks), F32)  # compiled: read in place
    else:
        rp, cp = want_s
        s_op = operand(ctx, 2, shape=(rp // 128, cp // 4, 32, 4, 4))
        scales = ctx.scratch.add((band, cp), np.uint8 if compiled else F32)

    def decode(arrays, scratch, n0, n1, w):
        packed, s, s2 = arrays
        r = n1 - n0
        idx = None if codes is None else scratch[codes][:r]
        pairs = w.view(np.uint64)  # (r, K/2) words, each the two f32 values of one byte
        w3 = w.reshape(r, blocks, NVFP4_BLOCK)
        if compiled and layout == "modelopt":  # the scale bytes read in place, one pass per row on every core
            return jit.by_rows(jit.kernels("lowp").decode_nvfp4_rows,
                               [packed[n0:n1, : k_in // 2], s[n0:n1].view(np.uint8), w], value_pairs,
                               scale_values, s2)
        sb = scratch[scales]
        if compiled:
            s = s.view(np.uint8)  # the bytes, untiled as they are (the kernel decodes them)
        if layout == "modelopt":
            src, dst = s[n0:n1], sb[:r]
        else:
            # logical rows 128*rb + 32*a + b sit at tile (rb, cb, b, a, c): untile whole 128-row tiles
            tiles = s.transpose(0, 3, 2, 1, 4)[n0 // 128 : -(-n1 // 128)]
            src, dst = tiles, sb[: tiles.shape[0] * 128].reshape(tiles.shape)
        s_band = sb[:r, :blocks, None]
        if compiled:  # untile the scale bytes (1/32 of the data), then one pass per row on every core
            rows = jit.by_rows(jit.kernels("lowp").decode_nvfp4_rows, [packed[n0:n1, : k_in // 2], sb[:r], w],
                               value_pairs, scale_values, s2)

            def run_compiled():
                np.copyto(dst, src)
                rows()

            return run_compiled

        def run():
            np.copyto(idx, packed[n0:n1, : k_in // 2], casting="unsafe")
            np.take(table, idx, out=pairs, mode="clip")
            np.copyto(dst, src, casting="unsafe")
            np.multiply(w3, s_band, out=w3)
            np.multiply(w, s2, out=w)

        return run

    def tile_weight(arrays):
        packed, s, s2 = arrays
        words = amx_dequant.nvfp4_table(layout, scale_dtype) if scale_dtype.itemsize == 1 else None
        if words is None:
            return None
        fmt = amx_dequant.NVFP4 if layout == "modelopt" else amx_dequant.NVFP4_TILED
        return amx_dequant.Weight(fmt, words, packed, s.view(np.uint8), s2.reshape(-1), n_out)

    return band, decode, [w_op, s_op, s2_op], tile_weight
