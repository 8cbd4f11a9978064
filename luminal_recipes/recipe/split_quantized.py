"""Split a fused *quantized* linear weight (packed QKV) into row ranges, scales and all.

A split rule slices a dense tensor along an axis. A quantized weight is several stored tensors: the packed
``weight``, its ``weight_scale`` and the per-tensor ``weight_scale_2`` / ``input_scale``. Each part becomes a
quantized weight of its own in the same format and layout, so the builder dequantizes it like any other:

* the packed weight is cut on its rows, which are logical output rows in every layout (the two E2M1 codes
  of a byte lie along the input dim);
* NVFP4 block scales follow their rows: ModelOpt's plain ``[N, K/16]`` is sliced; the comfy layout's
  128x4-swizzled tiles are unswizzled to logical rows first, sliced, then padded and swizzled again for the
  part (slicing the stored bytes would mix scales of unrelated rows);
* a per-tensor scale (FP8 ``weight_scale``, NVFP4 ``weight_scale_2``, ``input_scale``) is shared by every
  part; a per-channel FP8 scale is sliced with the rows.

Only axis 0 (output rows) can be split, and the stored shapes must be those of the declared layout: a
mismatch is an error here, before anything is read, never a silent mis-slice. (A comfy-layout fused weight
whose rows are not a multiple of 16 carries padding rows its shapes cannot reveal: give the split rule
``sizes:`` then; equal parts assume no padding.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CheckpointError
from ..weights.formats import (
    NVFP4_BLOCK,
    NVFP4_LAYOUTS,
    NVFP4Layout,
    nvfp4_layout,
    swizzle_block_scales,
    unswizzle_block_scales,
)
from .schema import QuantizationSpec

if TYPE_CHECKING:
    from .mapping import MappedTensor

SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
_FORMAT_OF_DTYPE = {"U8": "nvfp4", "F8_E4M3": "fp8"}


def quantized_companions(name: str, tensors: Mapping[str, MappedTensor]) -> dict[str, MappedTensor]:
    """The scale tensors stored next to weight ``name`` (``{"weight_scale": ..., ...}``); empty when the
    weight is dense (no ``weight_scale``)."""
    if not name.endswith(".weight") or f"{name}_scale" not in tensors:
        return {}
    owner = name[: -len(".weight")]
    return {s: tensors[f"{owner}.{s}"] for s in SCALE_SUFFIXES if f"{owner}.{s}" in tensors}


def split_quantized(
    weight: MappedTensor,
    scales: Mapping[str, MappedTensor],
    parts: list[str],
    axis: int,
    sizes_for: Callable[..., list[int]],
    quant: QuantizationSpec | None,
) -> dict[str, MappedTensor]:
    """Recipe tensors (each part's ``weight`` and scales) of a fused quantized weight split on its rows.

    ``parts``: the parts' weight names (``....weight``); ``sizes_for(rows, padded_to=1)``: the part sizes in
    logical rows, given the stored rows (and the multiple they are padded to).
    """
    fmt = _FORMAT_OF_DTYPE.get(weight.dtype)
    where = f"split of '{weight.name}' (from {weight.via})"
    if fmt is None or len(weight.shape) != 2:
        raise CheckpointError(
            f"{where}: it has a weight_scale, so it is quantized, but it is {weight.dtype} "
            f"{list(weight.shape)}, neither packed NVFP4 (U8) nor FP8 (F8_E4M3) 2-D."
        )
    if quant is None or quant.format != fmt:
        declared = f"declares {quant.format}" if quant else "has no quantization block"
        raise CheckpointError(
            f"{where}: the checkpoint stores it as {fmt.upper()} but the recipe {declared}; declare "
            f"`weights.quantization: {{format: {fmt}{', layout: ...' if fmt == 'nvfp4' else ''}}}` (or a "
            "pipeline's `models.NAME.quantization`) so the parts are split with their scales."
        )
    if axis != 0:
        raise CheckpointError(
            f"{where}: a quantized weight can only be split along its output rows (axis 0), not axis "
            f"{axis}; its codes and block scales run along the input dim."
        )
    bad = [p for p in parts if not p.endswith(".weight")]
    if bad:
        raise CheckpointError(
            f"{where}: the parts of a quantized weight must be named '<module>.weight' so their scales can "
            f"follow as '<module>.weight_scale'; got {', '.join(bad)}."
        )
    if fmt == "fp8":
        return _split_fp8(weight, scales, parts, sizes_for(weight.shape[0]))
    layout = nvfp4_layout(quant.layout or "")
    # the comfy layout pads the fused rows to 16: explicit sizes may add up to less than the stored rows
    sizes = sizes_for(weight.shape[0], 16 if layout.pad_to_16 else 1)
    return _split_nvfp4(weight, scales, parts, sizes, layout)


def _tensor(template: MappedTensor, name: str, shape: tuple[int, ...], load) -> MappedTensor:
    from .mapping import MappedTensor

    return MappedTensor(name, tuple(shape), template.dtype, template.sources, load)


def _rows(load: Callable[[], np.ndarray], start: int, stop: int, padded: int | None = None):
    """A loader of rows ``start:stop``, zero-padded to ``padded`` rows when given."""

    def read() -> np.ndarray:
        rows = np.asarray(load())[start:stop]
        if padded is None or padded == rows.shape[0]:
            return rows
        out = np.zeros((padded, *rows.shape[1:]), dtype=rows.dtype)
        out[: rows.shape[0]] = rows
        return out

    return read


def _owner(part: str) -> str:
    return part[: -len(".weight")]


def _shared(scales: Mapping[str, MappedTensor], owner: str, suffixes: tuple[str, ...]) -> dict:
    """Per-tensor scales, the same for every part."""
    return {
        f"{owner}.{s}": _tensor(scales[s], f"{owner}.{s}", scales[s].shape, scales[s].load)
        for s in suffixes
        if s in scales
    }


def _split_fp8(
    weight: MappedTensor, scales: Mapping[str, MappedTensor], parts: list[str], sizes: list[int]
) -> dict[str, MappedTensor]:
    rows, cols = weight.shape
    scale = scales["weight_scale"]
    per_channel = int(np.prod(scale.shape, dtype=np.int64)) == rows and rows > 1
    out: dict[str, MappedTensor] = {}
    start = 0
    for part, size in zip(parts, sizes):
        owner = _owner(part)
        out[part] = _tensor(weight, part, (size, cols), _rows(weight.load, start, start + size))
        if per_channel:
            shape = (size, *scale.shape[1:])
            out[f"{owner}.weight_scale"] = _tensor(
                scale, f"{owner}.weight_scale", shape, _rows(scale.load, start, start + size)
            )
            out.update(_shared(scales, owner, ("input_scale",)))
        else:
            out.update(_shared(scales, owner, ("weight_scale", "input_scale")))
        start += size
    return out


def _split_nvfp4(
    weight: MappedTensor,
    scales: Mapping[str, MappedTensor],
    parts: list[str],
    sizes: list[int],
    layout: NVFP4Layout,
) -> dict[str, MappedTensor]:
    rows, packed_cols = weight.shape
    scale = scales["weight_scale"]
    cols = 2 * packed_cols
    stored = layout.scale_shape(rows, cols)
    if tuple(scale.shape) != stored:
        others = [o.name for o in NVFP4_LAYOUTS.values() if o.scale_shape(rows, cols) == scale.shape]
        hint = f"; that is the {others[0]} layout's shape: declare layout: {others[0]}" if others else ""
        raise CheckpointError(
            f"split of '{weight.name}' (from {weight.via}): its block scales '{scale.name}' are "
            f"{list(scale.shape)}, but NVFP4 ({layout.name}) of a packed U8 {list(weight.shape)} weight "
            f"stores {list(stored)}{hint}. Scales of another layout would be split on the wrong rows, so "
            "nothing is loaded."
        )
    out: dict[str, MappedTensor] = {}
    start = 0
    for part, size in zip(parts, sizes):
        owner = _owner(part)
        part_rows = layout.padded_shape(size, cols)[0]
        rows_of_part = _rows(weight.load, start, start + size, part_rows)
        out[part] = _tensor(weight, part, (part_rows, packed_cols), rows_of_part)
        out[f"{owner}.weight_scale"] = _tensor(
            scale,
            f"{owner}.weight_scale",
            layout.scale_shape(size, cols),
            _scale_rows(scale.load, layout, rows, cols // NVFP4_BLOCK, start, size, part_rows),
        )
        out.update(_shared(scales, owner, ("weight_scale_2", "input_scale")))
        start += size
    return out


def _scale_rows(
    load: Callable[[], np.ndarray],
    layout: NVFP4Layout,
    rows: int,
    blocks: int,
    start: int,
    size: int,
    part_rows: int,
) -> Callable[[], np.ndarray]:
    """A loader of the block scales of rows ``start:start+size``, stored as ``layout`` stores them."""
    if not layout.swizzled_scales:
        return _rows(load, start, start + size)

    def read() -> np.ndarray:
        plain = unswizzle_block_scales(np.asarray(load()), rows, blocks)
        part = np.zeros((part_rows, blocks), dtype=plain.dtype)
        part[:size] = plain[start : start + size]
        return swizzle_block_scales(part)

    return read
