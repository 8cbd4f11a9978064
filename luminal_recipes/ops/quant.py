"""Dequantisation of FP8 and NVFP4 weights, in HLIR primitives (see ARCHITECTURE.md "Low-precision formats").

The packed bytes stay packed in the graph: nibbles are split with Mod, decoded through a 16-entry E2M1 table
(Gather), and scaled. A compiler rule can fuse the whole chain into a dequant-matmul kernel.
"""

from __future__ import annotations

from ..errors import QuantizationError
from ..graph import DType, Tensor, cast, gather
from ..graph.dtypes import E2M1_VALUES
from ..graph.symbolic import dims_equal, shape_str
from .shape import stack

NVFP4_BLOCK = 16
LAYOUTS = ("modelopt", "comfy")


def dequant_fp8(weight: Tensor, scale: Tensor, dtype="f32") -> Tensor:
    """``weight (f8) * scale``; ``scale`` is per tensor (``[]`` or ``[1]``) or per output channel
    (``[N]`` or ``[N, 1]``)."""
    if weight.dtype not in (DType.F8E4M3, DType.F8E5M2):
        raise QuantizationError(f"dequant_fp8: weight must be f8e4m3 or f8e5m2, got {weight.dtype}")
    w = cast(weight, dtype)
    s = scale if scale.dtype == w.dtype else cast(scale, w.dtype)
    n = weight.shape[0]
    if s.ndim == 0 or (s.ndim == 1 and dims_equal(s.shape[0], 1)):
        s = s.reshape(()) if s.ndim else s
        return w * s.broadcast_to(w.shape)
    if dims_equal(s.shape[0], n) and (s.ndim == 1 or (s.ndim == 2 and dims_equal(s.shape[1], 1))):
        s = s.reshape(n, 1) if s.ndim == 1 else s
        return w * s.broadcast_to(w.shape)
    raise QuantizationError(
        f"dequant_fp8: scale shape {shape_str(scale.shape)} is neither per-tensor ([] / [1]) nor per-channel "
        f"([{n}] / [{n}, 1]) for weight {shape_str(weight.shape)}"
    )


def unpack_fp4_codes(packed: Tensor, order: str) -> Tensor:
    """``u8 [N, K/2]`` -> i32 E2M1 codes ``[N, K]``; ``order`` says which nibble holds element 0."""
    if packed.dtype != DType.U8:
        raise QuantizationError(f"NVFP4 weights are stored as u8 bytes (two codes each), got {packed.dtype}; a packed "
                                f"[N, K/2] weight must never be read as a dense matrix")
    b = cast(packed, DType.I32)
    lo = b % 16
    hi = cast(cast(b - lo, DType.F32) * (1.0 / 16), DType.I32)  # exact: b - lo is a multiple of 16
    first, second = (lo, hi) if order == "low_first" else (hi, lo)
    codes = stack([first, second], axis=-1)                     # [N, K/2, 2]
    n, half = packed.shape
    return codes.reshape(n, half * 2)


def unswizzle_scales(scales: Tensor, rows: int, cols: int) -> Tensor:
    """Undo the cuBLAS 128x4 tile layout of block scales: stored ``[Rp, Cp]`` -> logical ``[rows, cols]``.

    Stored order (torchao/comfy-kitchen ``to_blocked``): tiles of 128 rows x 4 columns, row-major over tiles; inside
    a tile, row r = 32*a + b and column c sit at ``(b, a, c)``.
    """
    rp, cp = scales.shape
    if not (isinstance(rp, int) and isinstance(cp, int)) or rp % 128 or cp % 4:
        raise QuantizationError(f"swizzled NVFP4 scales must be [rows padded to 128, K/16 padded to 4], got "
                                f"{shape_str(scales.shape)}")
    nrb, ncb = rp // 128, cp // 4
    tiles = scales.reshape(nrb, ncb, 32, 4, 4)                  # [rb, cb, b, a, c]
    logical = tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp)      # [rb, a, b, cb, c] -> rows 128*rb+32a+b
    if rows > rp or cols > cp:
        raise QuantizationError(f"swizzled scales {shape_str(scales.shape)} are too small for [{rows}, {cols}]")
    return logical.slice(0, 0, rows).slice(1, 0, cols)


def dequant_nvfp4(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, out_features: int,
                  in_features: int, layout: str = "modelopt", dtype="f32") -> Tensor:
    """Dense ``[out, in]`` weight from NVFP4 ``weight`` (u8), ``weight_scale`` (f8e4m3) and ``weight_scale_2`` (f32).

    ``layout="modelopt"``: element 0 in the low nibble, scales ``[out, in/16]`` row-major.
    ``layout="comfy"``: element 0 in the high nibble, scales in 128x4 tiles, weight padded to 16x16.
    """
    if layout not in LAYOUTS:
        raise QuantizationError(f"NVFP4 layout must be one of {LAYOUTS}, got {layout!r}")
    if in_features % NVFP4_BLOCK:
        raise QuantizationError(f"NVFP4 needs in_features divisible by {NVFP4_BLOCK}, got {in_features}")
    blocks = in_features // NVFP4_BLOCK
    if layout == "modelopt":
        expect_w, expect_s = (out_features, in_features // 2), (out_features, blocks)
    else:
        pad16 = lambda v: -(-v // 16) * 16  # noqa: E731
        expect_w = (pad16(out_features), pad16(in_features) // 2)
        expect_s = (-(-out_features // 128) * 128, -(-blocks // 4) * 4)
    for what, t, want in (("weight", weight, expect_w), ("weight_scale", weight_scale, expect_s)):
        if tuple(t.shape) != want:
            raise QuantizationError(
                f"NVFP4 ({layout}) {what} has shape {shape_str(t.shape)}, expected {shape_str(want)} for a "
                f"[{out_features}, {in_features}] weight; check the recipe's quantization layout"
            )
    if weight_scale.dtype != DType.F8E4M3:
        raise QuantizationError(f"NVFP4 weight_scale must be f8e4m3, got {weight_scale.dtype}")
    codes = unpack_fp4_codes(weight, "low_first" if layout == "modelopt" else "high_first")
    if layout == "comfy":
        codes = codes.slice(0, 0, out_features).slice(1, 0, in_features)
        scales = unswizzle_scales(weight_scale, out_features, blocks)
    else:
        scales = weight_scale
    table = weight.graph.constant(E2M1_VALUES, dtype)
    values = gather(table, codes)                               # [out, in]
    s = cast(scales, dtype)
    s2 = weight_scale_2 if weight_scale_2.dtype == values.dtype else cast(weight_scale_2, values.dtype)
    s2 = s2.reshape(()) if s2.ndim else s2
    blocked = values.reshape(out_features, blocks, NVFP4_BLOCK) * s.expand(2, NVFP4_BLOCK)
    w = blocked.reshape(out_features, in_features)
    return w * s2.broadcast_to(w.shape)
