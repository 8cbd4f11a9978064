"""Low-precision weight formats, bit for bit as they lie in checkpoints (ARCHITECTURE.md, "Low-precision
formats").

NVFP4 (block size 16, two-level scales). The math is NVIDIA ModelOpt's (``NVFP4QTensor``):

    weight_scale_2 = amax(|W|) / (6 * 448)                                  F32 scalar
    weight_scale   = fp8_e4m3(block_amax / (6 * weight_scale_2))            one per 16 consecutive K elements
    code           = e2m1_rne(W / (f32(weight_scale) * weight_scale_2))     4-bit, saturating at +-6
    W'             = e2m1(code) * (f32(weight_scale) * weight_scale_2)

An all-zero block gets scale 1.0 (ModelOpt's rule); a block whose scale rounds to fp8 zero gets codes 0, where
ModelOpt would divide by zero. Two on-disk layouts share this math:

* ``modelopt``: ``weight`` U8 ``[N, K/2]``, element 0 in the **low** nibble; ``weight_scale`` F8_E4M3 ``[N,
  K/16]`` row-major.
* ``comfy`` (ComfyUI, comfy-kitchen, ``black-forest-labs/FLUX.2-dev-NVFP4``): element 0 in the **high** nibble
  (comfy-kitchen ``pack_uint4(hi_first=True)``); the weight is zero-padded to multiples of 16 in both dims
  (``TensorCoreNVFP4Layout.get_padded_shape``), so ``weight`` is U8 ``[pad16(N), pad16(K)/2]``;
  ``weight_scale`` is F8_E4M3 stored 2-D as ``[pad128(pad16(N)), pad4(pad16(K)/16)]`` in the cuBLAS
  block-scaling-factor layout (comfy ``to_blocked(scales, flatten=False)``: 128x4 tiles in row-major tile
  order, and inside a tile the scale of (row r, col c) at byte ``(r % 32) * 16 + (r // 32) * 4 + c``);
  ``weight_scale_2`` F32 0-d. Confirmed from Comfy-Org/comfy-kitchen ``backends/eager/quantization.py``
  (``quantize_nvfp4`` / ``dequantize_nvfp4`` / ``from_blocked``), ComfyUI ``comfy/float.py`` ``to_blocked``
  (returns ``reshape(padded_rows, padded_cols)``) and ``tensor/nvfp4.py`` (``state_dict_tensors``: ``weight``,
  ``weight_scale``, ``weight_scale_2``). ComfyUI marks such files with
  ``__metadata__["_quantization_metadata"] = {"format_version": "1.0", "layers": {module: {"format":
  "nvfp4"}}}``; sglang PR 23625 ("FLUX.2-dev-NVFP4 produced pure-white images") records the nibble order of
  BFL's file as the opposite of ModelOpt's.

FP8 E4M3: ``weight`` F8_E4M3, ``weight_scale`` F32 per tensor (0-d) or per output channel (``[N]``), ``scale =
amax / 448``. ComfyUI's legacy files carry a ``scaled_fp8`` marker tensor and name the scales
``.scale_weight`` / ``.scale_input``; :func:`comfy_legacy_fp8_renames` maps them onto ``.weight_scale`` /
``.input_scale`` as ComfyUI's ``convert_old_quants`` does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..errors import QuantizationError
from ..graph.dtypes import E2M1_VALUES, DType

NVFP4_BLOCK = 16
FP4_E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0


NibbleOrder = Literal["low_first", "high_first"]
_ROWS_PER_CHUNK = 1024  # bounds the f32 temporaries while quantizing large matrices


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# --- E2M1 codes and nibble packing ------------------------------------------------------------------------
def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """4-bit E2M1 codes (uint8, one per element) -> float32 values."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes, round to nearest even, saturating at +-6 (ModelOpt's ``_cast_fp4``)."""
    # + 0.0 turns -0.0 into +0.0: ModelOpt takes the sign from ``x < 0``, so an exact -0.0 gets code 0, not 8
    clipped = np.clip(np.asarray(x, dtype=np.float32), -FP4_E2M1_MAX, FP4_E2M1_MAX) + np.float32(0.0)
    return clipped.astype(DType.F4E2M1.np).view(np.uint8)


def pack_fp4(codes: np.ndarray, order: NibbleOrder = "low_first") -> np.ndarray:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes; ``order`` says which nibble holds the even element."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise QuantizationError(
            f"cannot pack {codes.shape[-1]} FP4 codes per row into bytes: the count must be even"
        )
    even, odd = codes[..., 0::2] & 0xF, codes[..., 1::2] & 0xF
    if order == "low_first":
        return (even | (odd << 4)).astype(np.uint8)
    if order == "high_first":
        return ((even << 4) | odd).astype(np.uint8)
    raise QuantizationError(
        f"unknown nibble order '{order}'; use 'low_first' (ModelOpt) or 'high_first' (ComfyUI)"
    )


def unpack_fp4(packed: np.ndarray, order: NibbleOrder = "low_first") -> np.ndarray:
    """``[..., K/2]`` bytes -> ``[..., K]`` codes (inverse of :func:`pack_fp4`)."""
    packed = np.asarray(packed, dtype=np.uint8)
    low, high = packed & 0xF, packed >> 4
    if order == "low_first":
        pair = (low, high)
    elif order == "high_first":
        pair = (high, low)
    else:
        raise QuantizationError(
            f"unknown nibble order '{order}'; use 'low_first' (ModelOpt) or 'high_first' (ComfyUI)"
        )
    return np.stack(pair, axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# --- cuBLAS 128x4 block-scale swizzle ---------------------------------------------------------------------
def swizzled_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Stored shape of a ``[rows, cols]`` block-scale matrix in the 128x4 tiled layout."""
    return _round_up(rows, 128), _round_up(cols, 4)


def swizzle_block_scales(scales: np.ndarray) -> np.ndarray:
    """Row-major ``[rows, cols]`` scales -> cuBLAS tiles ``[pad128(rows), pad4(cols)]``, zero padded."""
    rows, cols = scales.shape
    prow, pcol = swizzled_scale_shape(rows, cols)
    padded = np.zeros((prow, pcol), dtype=scales.dtype)
    padded[:rows, :cols] = scales
    tiles = padded.reshape(prow // 128, 128, pcol // 4, 4).transpose(
        0, 2, 1, 3
    )  # (row tile, col tile, 128, 4)
    # inside a tile, row r = 32 * i + j goes to byte j * 16 + i * 4 + c
    tiles = tiles.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(tiles).reshape(prow, pcol)


def unswizzle_block_scales(swizzled: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of :func:`swizzle_block_scales`: the row-major ``[rows, cols]`` scales."""
    prow, pcol = swizzled_scale_shape(rows, cols)
    if swizzled.size != prow * pcol:
        raise QuantizationError(
            f"swizzled block scales hold {swizzled.size} values, but a [{rows}, {cols}] scale matrix padded "
            f"to 128x4 tiles needs {prow}x{pcol} = {prow * pcol}"
        )
    tiles = np.asarray(swizzled).reshape(prow // 128, pcol // 4, 32, 4, 4).transpose(0, 1, 3, 2, 4)
    plain = tiles.reshape(prow // 128, pcol // 4, 128, 4).transpose(0, 2, 1, 3).reshape(prow, pcol)
    return np.ascontiguousarray(plain[:rows, :cols])


# --- NVFP4 layouts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NVFP4Layout:
    """How NVFP4 tensors lie on disk: nibble order, scale swizzle and padding."""

    name: str
    nibble_order: NibbleOrder
    swizzled_scales: bool
    pad_to_16: bool

    def padded_shape(self, n: int, k: int) -> tuple[int, int]:
        return (_round_up(n, 16), _round_up(k, 16)) if self.pad_to_16 else (n, k)

    def weight_shape(self, n: int, k: int) -> tuple[int, int]:
        """Stored shape of ``<m>.weight`` (U8) for a logical ``[n, k]`` weight."""
        rows, cols = self.padded_shape(n, k)
        return rows, cols // 2

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """Stored shape of ``<m>.weight_scale`` (F8_E4M3) for a logical ``[n, k]`` weight."""
        rows, cols = self.padded_shape(n, k)
        blocks = cols // NVFP4_BLOCK
        return swizzled_scale_shape(rows, blocks) if self.swizzled_scales else (rows, blocks)


MODELOPT = NVFP4Layout("modelopt", nibble_order="low_first", swizzled_scales=False, pad_to_16=False)
COMFY = NVFP4Layout("comfy", nibble_order="high_first", swizzled_scales=True, pad_to_16=True)
NVFP4_LAYOUTS = {layout.name: layout for layout in (MODELOPT, COMFY)}


def nvfp4_layout(layout: str | NVFP4Layout) -> NVFP4Layout:
    if isinstance(layout, NVFP4Layout):
        return layout
    try:
        return NVFP4_LAYOUTS[layout]
    except KeyError:
        raise QuantizationError(
            f"unknown NVFP4 layout '{layout}'; use 'modelopt' (low nibble first, plain [N, K/16] scales) or "
            "'comfy' (high nibble first, 128x4-swizzled scales, ComfyUI / FLUX.2-dev-NVFP4)"
        ) from None


@dataclass(frozen=True)
class NVFP4Weight:
    """The three stored tensors of one NVFP4 linear weight, in a given layout."""

    weight: np.ndarray  # uint8, packed codes
    weight_scale: np.ndarray  # float8_e4m3fn block scales
    weight_scale_2: np.ndarray  # float32, 0-d
    layout: NVFP4Layout

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """``{<prefix>.weight: ..., <prefix>.weight_scale: ..., <prefix>.weight_scale_2: ...}``."""
        return {
            f"{prefix}.weight": self.weight,
            f"{prefix}.weight_scale": self.weight_scale,
            f"{prefix}.weight_scale_2": self.weight_scale_2,
        }


def _check_finite(amax: np.floating, what: str) -> None:
    if not np.isfinite(amax):
        raise QuantizationError(
            f"{what} contains NaN or infinite values and cannot be quantized; fix the source weights"
        )


def nvfp4_global_scale(w: np.ndarray) -> np.float32:
    """``weight_scale_2 = amax / (6 * 448)`` in float32 (1.0 for an all-zero tensor)."""
    with np.errstate(invalid="ignore"):  # NaN is reported below, with a message
        amax = np.float32(np.max(np.abs(w))) if w.size else np.float32(0)
    _check_finite(amax, "the weight")
    scale_2 = amax / np.float32(FP4_E2M1_MAX * FP8_E4M3_MAX)
    return np.float32(scale_2) if scale_2 > 0 else np.float32(1.0)


def nvfp4_block_scales(w: np.ndarray, scale_2: np.float32) -> np.ndarray:
    """FP8 block scales ``[N, K/16]`` (row-major): ``fp8(block_amax / (6 * weight_scale_2))``."""
    n, k = w.shape
    block_amax = np.max(np.abs(w.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)), axis=-1).astype(np.float32)
    scale = block_amax / (np.float32(FP4_E2M1_MAX) * scale_2)
    scale[scale == 0] = 1.0
    return np.minimum(scale, np.float32(FP8_E4M3_MAX)).astype(DType.F8E4M3.np)


def nvfp4_codes(w: np.ndarray, block_scales: np.ndarray, scale_2: np.float32) -> np.ndarray:
    """E2M1 codes ``[N, K]`` of ``w / (block_scale * weight_scale_2)``."""
    n, k = w.shape
    codes = np.empty((n, k), dtype=np.uint8)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        rows = slice(r0, min(n, r0 + _ROWS_PER_CHUNK))
        total = block_scales[rows].astype(np.float32) * scale_2  # f32 product, as ModelOpt forms it
        blocks = w[rows].astype(np.float32).reshape(-1, k // NVFP4_BLOCK, NVFP4_BLOCK)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = blocks / total[..., None]
        scaled[np.broadcast_to(total[..., None] == 0, scaled.shape)] = 0.0  # fp8 scale underflowed to zero
        codes[rows] = encode_e2m1(scaled).reshape(-1, k)
    return codes


def quantize_nvfp4(w: np.ndarray, layout: str | NVFP4Layout = "modelopt") -> NVFP4Weight:
    """Quantize a 2-D ``[N, K]`` weight to NVFP4 in ``layout``.

    ModelOpt needs K to be a multiple of 16; the comfy layout pads both dims to 16 with zeros first.
    """
    lay = nvfp4_layout(layout)
    w = np.asarray(w)
    if w.ndim != 2:
        raise QuantizationError(f"NVFP4 quantizes 2-D linear weights; got shape {list(w.shape)}")
    n, k = w.shape
    rows, cols = lay.padded_shape(n, k)
    if cols % NVFP4_BLOCK:
        raise QuantizationError(
            f"NVFP4 ({lay.name} layout) needs the input dim to be a multiple of {NVFP4_BLOCK}; weight shape "
            f"is [{n}, {k}]. Exclude this module from quantization or use the comfy layout, which pads"
        )
    if (rows, cols) != (n, k):
        padded = np.zeros((rows, cols), dtype=np.float32)
        padded[:n, :k] = w
        w = padded
    scale_2 = nvfp4_global_scale(w)
    scales = nvfp4_block_scales(w, scale_2)
    packed = pack_fp4(nvfp4_codes(w, scales, scale_2), lay.nibble_order)
    if lay.swizzled_scales:
        scales = swizzle_block_scales(scales)
    return NVFP4Weight(packed, scales, np.array(scale_2, dtype=np.float32), lay)


def dequantize_nvfp4(
    weight: np.ndarray,
    weight_scale: np.ndarray,
    weight_scale_2: np.ndarray | float,
    layout: str | NVFP4Layout = "modelopt",
    shape: tuple[int, int] | None = None,
) -> np.ndarray:
    """Stored NVFP4 tensors -> float32 ``[N, K]``; ``shape``: the logical shape (default: the stored one)."""
    lay = nvfp4_layout(layout)
    weight = np.asarray(weight)
    if weight.dtype != np.uint8 or weight.ndim != 2:
        raise QuantizationError(
            f"an NVFP4 weight is a 2-D uint8 tensor of packed codes; got {weight.dtype} {list(weight.shape)}"
        )
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    if cols % NVFP4_BLOCK:
        raise QuantizationError(
            f"packed NVFP4 weight [{rows}, {cols // 2}] holds {cols} codes per row, not a "
            f"multiple of the block size {NVFP4_BLOCK}"
        )
    blocks = cols // NVFP4_BLOCK
    scales = np.asarray(weight_scale)
    if lay.swizzled_scales:
        scales = unswizzle_block_scales(scales, rows, blocks)
    elif scales.shape != (rows, blocks):
        raise QuantizationError(
            f"ModelOpt NVFP4 block scales for a [{rows}, {cols // 2}] packed weight must be [{rows}, "
            f"{blocks}], got {list(scales.shape)}; a padded 128x4 shape means the checkpoint is in the comfy "
            "layout"
        )
    total = scales.astype(np.float32) * np.float32(np.asarray(weight_scale_2, dtype=np.float32).reshape(()))
    values = decode_e2m1(unpack_fp4(weight, lay.nibble_order)).reshape(rows, blocks, NVFP4_BLOCK)
    dense = (values * total[..., None]).reshape(rows, cols)
    if shape is not None:
        n, k = shape
        if n > rows or k > cols:
            raise QuantizationError(
                f"logical shape [{n}, {k}] is larger than the stored NVFP4 weight [{rows}, {cols}]"
            )
        dense = dense[:n, :k]
    return dense


# --- FP8 E4M3 ---------------------------------------------------------------------------------------------
FP8Granularity = Literal["per_tensor", "per_channel"]


def quantize_fp8(w: np.ndarray, granularity: FP8Granularity = "per_tensor") -> tuple[np.ndarray, np.ndarray]:
    """``(weight F8_E4M3, weight_scale F32)`` with ``scale = amax / 448``; the scale is 0-d or ``[N]``."""
    w = np.asarray(w)
    if granularity not in ("per_tensor", "per_channel"):
        raise QuantizationError(f"unknown FP8 granularity '{granularity}'; use 'per_tensor' or 'per_channel'")
    if granularity == "per_channel" and w.ndim != 2:
        raise QuantizationError(f"per-channel FP8 needs a 2-D weight; got shape {list(w.shape)}")
    with np.errstate(invalid="ignore"):  # NaN is reported below, with a message
        amax = np.max(np.abs(w), axis=None if granularity == "per_tensor" else 1, initial=0).astype(
            np.float32
        )
    _check_finite(np.max(amax, initial=0), "the weight")
    scale = np.asarray(amax / np.float32(FP8_E4M3_MAX), dtype=np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    scaled = w.astype(np.float32) / (scale if scale.ndim == 0 else scale[:, None])
    q = np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(DType.F8E4M3.np)
    return q, scale


def dequantize_fp8(weight: np.ndarray, weight_scale: np.ndarray | float) -> np.ndarray:
    """F8_E4M3 weight and its F32 scale (0-d, ``[1]``, ``[N]`` or ``[N, 1]``) -> float32."""
    values = np.asarray(weight).astype(np.float32)
    scale = np.asarray(weight_scale, dtype=np.float32)
    if scale.size == 1:
        return values * scale.reshape(())
    if values.ndim == 2 and scale.size == values.shape[0]:
        return values * scale.reshape(-1, 1)
    raise QuantizationError(
        f"an FP8 weight_scale must be per tensor (one value) or per output channel ({values.shape[0]} "
        f"values); got shape {list(scale.shape)} for a weight of shape {list(values.shape)}"
    )


# --- ComfyUI legacy FP8 names -----------------------------------------------------------------------------
LEGACY_FP8_MARKER = "scaled_fp8"
_LEGACY_SUFFIXES = {".scale_weight": ".weight_scale", ".scale_input": ".input_scale"}


def comfy_legacy_fp8_renames(names: list[str] | set[str]) -> tuple[dict[str, str], str | None]:
    """For a legacy ComfyUI ``scaled_fp8`` checkpoint: ``({stored name: canonical name}, marker name)``.

    Returns ``({}, None)`` when there is no marker. As in ComfyUI's ``convert_old_quants``, the marker may
    carry the model prefix (``model.diffusion_model.scaled_fp8``); only names under that prefix are renamed.
    """
    markers = [n for n in names if n == LEGACY_FP8_MARKER or n.endswith("." + LEGACY_FP8_MARKER)]
    if not markers:
        return {}, None
    if len(markers) > 1:
        raise QuantizationError(f"checkpoint has several legacy FP8 markers {sorted(markers)}; expected one")
    marker = markers[0]
    prefix = marker[: -len(LEGACY_FP8_MARKER)]
    renames = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        for old, new in _LEGACY_SUFFIXES.items():
            if name.endswith(old):
                renames[name] = name[: -len(old)] + new
    return renames, marker
