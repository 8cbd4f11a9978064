"""Check a checkpoint against what a recipe expects, before anything runs, and report every problem at once.

A quantized weight is expected by its logical (dense) shape plus a :class:`QuantSpec`; the check derives the
stored tensors that format and layout imply (``weight``, ``weight_scale``, ``weight_scale_2``, optional
``input_scale``) and recognises the usual confusions by shape: a packed NVFP4 ``[N, K/2]`` U8 weight where a
dense matrix is expected, FP8 where bf16 is expected, ComfyUI's 128x4-swizzled block scales where ModelOpt's
plain ``[N, K/16]`` are declared (and the reverse). The checkpoint's own declarations
(``hf_quant_config.json``, ComfyUI's ``_quantization_metadata``) are checked against the recipe's quantization
block too."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import CheckpointError, QuantizationError
from ..files import MAX_JSON_BYTES, present, read_json
from .formats import NVFP4_BLOCK, NVFP4_LAYOUTS, NVFP4Layout, nvfp4_layout
from .safetensors_io import Checkpoint, TensorInfo

HF_QUANT_CONFIG = "hf_quant_config.json"
DENSE_FLOAT = {"F32", "F16", "BF16"}
_LIST_LIMIT = 12

# dtype spellings a recipe may use -> safetensors header names
_DTYPE_ALIASES = {
    "f32": "F32",
    "float32": "F32",
    "f16": "F16",
    "float16": "F16",
    "bf16": "BF16",
    "bfloat16": "BF16",
    "f8e4m3": "F8_E4M3",
    "float8_e4m3fn": "F8_E4M3",
    "f8e5m2": "F8_E5M2",
    "float8_e5m2": "F8_E5M2",
    "u8": "U8",
    "uint8": "U8",
    "i32": "I32",
    "int32": "I32",
    "i64": "I64",
    "int64": "I64",
    "bool": "BOOL",
}


def safetensors_dtype(name: str) -> str:
    """A dtype as a safetensors header spells it (``bf16`` -> ``BF16``)."""
    return _DTYPE_ALIASES.get(name.lower(), name.upper())


@dataclass(frozen=True)
class QuantSpec:
    """How a recipe declares one quantized weight.

    ``format``: ``nvfp4`` or ``fp8``. ``layout``: for NVFP4 ``modelopt`` or ``comfy``; for FP8 the scale
    granularity ``per_tensor`` / ``per_channel``, or ``None`` to accept either.
    """

    format: Literal["nvfp4", "fp8"]
    layout: str | None = "modelopt"

    def __post_init__(self) -> None:
        if self.format == "nvfp4":
            nvfp4_layout(self.layout or "")
        elif self.format == "fp8":
            if self.layout not in (None, "per_tensor", "per_channel", "modelopt", "comfy"):
                raise QuantizationError(
                    f"FP8 scale layout '{self.layout}' is unknown; use per_tensor or per_channel"
                )
        else:
            raise QuantizationError(f"unknown quantization format '{self.format}'; use nvfp4 or fp8")


@dataclass(frozen=True)
class ExpectedTensor:
    """A tensor a recipe needs: logical shape, dtype (``None``: any) and quantization (``None``: dense)."""

    shape: tuple[int, ...]
    dtype: str | None = None
    quant: QuantSpec | None = None


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _module(weight_name: str) -> str:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def _is_scalar(info: TensorInfo) -> bool:
    return info.numel == 1 and len(info.shape) <= 1


class _Report:
    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatches: list[str] = []
        self.used: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatches)

    def message(self, where: str) -> str:
        count = len(self.missing) + len(self.unexpected) + len(self.mismatches)
        lines = [f"checkpoint {where} does not match the recipe ({count} problem{'s' * (count != 1)}):"]
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                shown = ", ".join(f"'{n}'" for n in names[:_LIST_LIMIT])
                more = f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
                lines.append(f"  - {len(names)} {label} tensor{'s' * (len(names) != 1)}: {shown}{more}")
        lines += [f"  - {m}" for m in self.mismatches[:50]]
        if len(self.mismatches) > 50:
            lines.append(f"  - and {len(self.mismatches) - 50} more mismatches")
        lines.append(
            "Fix the recipe's weights section (name mapping, shapes, dtype, quantization block) or point "
            "--weights at the checkpoint the recipe was written for."
        )
        return "\n".join(lines)


def check_checkpoint(
    expected: Mapping[str, ExpectedTensor],
    checkpoint: Checkpoint,
    ignore_unexpected: Iterable[str] = (),
    quant_config: dict | None = None,
) -> None:
    """Raise one :class:`CheckpointError` listing every disagreement between ``expected`` and ``checkpoint``.

    ``ignore_unexpected``: fnmatch patterns of checkpoint tensors the recipe knowingly leaves unused.
    ``quant_config``: the checkpoint's ``hf_quant_config.json`` (default: read from ``checkpoint.root``).
    """
    report = _Report()
    for name, want in expected.items():
        if want.quant is None:
            _check_dense(name, want, checkpoint, report)
        elif want.quant.format == "nvfp4":
            _check_nvfp4(name, want, nvfp4_layout(want.quant.layout or ""), checkpoint, report)
        else:
            _check_fp8(name, want, checkpoint, report)
    patterns = list(ignore_unexpected)
    report.unexpected = [
        n
        for n in checkpoint.names
        if n not in report.used and not any(fnmatch.fnmatchcase(n, p) for p in patterns)
    ]
    if quant_config is None:
        quant_config = read_hf_quant_config(checkpoint.root)
    specs = {w.quant for w in expected.values() if w.quant is not None}
    report.mismatches += quant_declaration_problems(specs, quant_config, checkpoint.quantization_metadata)
    if report:
        raise CheckpointError(report.message(str(checkpoint.root)))


def _check_dense(name: str, want: ExpectedTensor, ckpt: Checkpoint, report: _Report) -> None:
    if name not in ckpt:
        report.missing.append(name)
        return
    report.used.add(name)
    info = ckpt[name]
    module = _module(name)
    scale = ckpt.tensors.get(f"{module}.weight_scale")
    if scale is not None and info.dtype in ("U8", "F4", "F8_E4M3") and name.endswith(".weight"):
        kind = "NVFP4-packed" if info.dtype in ("U8", "F4") else "FP8"
        report.mismatches.append(
            f"'{name}' is {kind} ({info.dtype} {_fmt_shape(info.shape)} with a weight_scale) but the recipe "
            f"expects a dense {_fmt_shape(want.shape)} weight; declare the checkpoint's quantization in the "
            "recipe's weights section, or use an unquantized checkpoint"
        )
        report.used.update(n for n in _companions(module) if n in ckpt)
        return
    _shape_and_dtype(name, info, want.shape, want.dtype, report)


def _shape_and_dtype(
    name: str, info: TensorInfo, shape: tuple[int, ...], dtype: str | None, report: _Report
) -> None:
    if tuple(info.shape) != tuple(shape):
        report.mismatches.append(
            f"'{name}' has shape {_fmt_shape(info.shape)} in the checkpoint, the recipe expects "
            f"{_fmt_shape(shape)}"
        )
    if dtype is not None and info.dtype != safetensors_dtype(dtype):
        report.mismatches.append(
            f"'{name}' is {info.dtype} in the checkpoint, the recipe expects {safetensors_dtype(dtype)}"
        )


def _companions(module: str) -> list[str]:
    return [f"{module}.{s}" for s in ("weight_scale", "weight_scale_2", "input_scale")]


def _check_nvfp4(
    name: str, want: ExpectedTensor, layout: NVFP4Layout, ckpt: Checkpoint, report: _Report
) -> None:
    module = _module(name)
    if len(want.shape) != 2:
        report.mismatches.append(
            f"'{name}' is declared NVFP4 but its expected shape {_fmt_shape(want.shape)} is not "
            "2-D; only linear weights are quantized"
        )
        return
    n, k = want.shape
    if not layout.pad_to_16 and k % NVFP4_BLOCK:
        report.mismatches.append(
            f"'{name}' is declared NVFP4 ({layout.name}) but its input dim {k} is not a multiple "
            f"of {NVFP4_BLOCK}"
        )
        return
    others = [lay for lay in NVFP4_LAYOUTS.values() if lay != layout]
    scale_name, scale2_name, input_name = _companions(module)
    weight = ckpt.tensors.get(name)
    if weight is None:
        report.missing.append(name)
    else:
        report.used.add(name)
        stored = layout.weight_shape(n, k)
        if weight.dtype in DENSE_FLOAT and tuple(weight.shape) == (n, k):
            report.mismatches.append(
                f"'{name}' is a dense {weight.dtype} {_fmt_shape(weight.shape)} weight but the recipe "
                f"declares NVFP4 ({layout.name}); quantize the checkpoint (luminal-recipe quantize) or "
                "remove the module from the recipe's quantization block"
            )
            return
        if weight.dtype != "U8":
            report.mismatches.append(
                f"'{name}' should be packed NVFP4 (U8 {_fmt_shape(stored)}) but is "
                f"{weight.dtype} {_fmt_shape(weight.shape)}"
            )
        elif tuple(weight.shape) != stored:
            hint = next(
                (
                    f" - that is the {o.name} layout's shape"
                    for o in others
                    if o.weight_shape(n, k) == tuple(weight.shape)
                ),
                "",
            )
            report.mismatches.append(
                f"'{name}' is U8 {_fmt_shape(weight.shape)}, but NVFP4 ({layout.name}) of a "
                f"{_fmt_shape(want.shape)} weight is stored as {_fmt_shape(stored)}{hint}"
            )
    scale = ckpt.tensors.get(scale_name)
    if scale is None:
        report.missing.append(scale_name)
    else:
        report.used.add(scale_name)
        stored = layout.scale_shape(n, k)
        if scale.dtype != "F8_E4M3":
            report.mismatches.append(f"'{scale_name}' should be F8_E4M3 block scales but is {scale.dtype}")
        if tuple(scale.shape) != stored:
            other = next((o for o in others if o.scale_shape(n, k) == tuple(scale.shape)), None)
            hint = (
                f"; that is the {other.name} layout "
                f"({'128x4-swizzled' if other.swizzled_scales else 'plain'} "
                f"scales, element 0 in the {other.nibble_order.removesuffix('_first')} nibble): "
                f"declare layout: {other.name}"
                if other
                else ""
            )
            report.mismatches.append(
                f"'{scale_name}' has shape {_fmt_shape(scale.shape)}, but the recipe's NVFP4 layout "
                f"{layout.name} stores {_fmt_shape(stored)} block scales for a {_fmt_shape(want.shape)} "
                f"weight{hint}"
            )
    _check_scalar(scale2_name, ckpt, report, required=True)
    _check_scalar(input_name, ckpt, report, required=False)


def _check_scalar(name: str, ckpt: Checkpoint, report: _Report, required: bool) -> None:
    info = ckpt.tensors.get(name)
    if info is None:
        if required:
            report.missing.append(name)
        return
    report.used.add(name)
    if info.dtype != "F32" or not _is_scalar(info):
        report.mismatches.append(
            f"'{name}' should be one F32 value but is {info.dtype} {_fmt_shape(info.shape)}"
        )


def _check_fp8(name: str, want: ExpectedTensor, ckpt: Checkpoint, report: _Report) -> None:
    module = _module(name)
    scale_name, _, input_name = _companions(module)
    weight = ckpt.tensors.get(name)
    if weight is None:
        report.missing.append(name)
    else:
        report.used.add(name)
        if weight.dtype in DENSE_FLOAT:
            report.mismatches.append(
                f"'{name}' is a dense {weight.dtype} weight but the recipe declares FP8; quantize "
                "the checkpoint (luminal-recipe quantize --format fp8) or drop the declaration"
            )
            return
        _shape_and_dtype(name, weight, want.shape, "F8_E4M3", report)
    scale = ckpt.tensors.get(scale_name)
    if scale is None:
        report.missing.append(scale_name)
    else:
        report.used.add(scale_name)
        rows = want.shape[0] if want.shape else 1
        granularity = (
            "per_tensor"
            if _is_scalar(scale)
            else "per_channel"
            if scale.numel == rows and scale.shape in ((rows,), (rows, 1))
            else None
        )
        wanted = (
            want.quant.layout if want.quant and want.quant.layout in ("per_tensor", "per_channel") else None
        )
        if scale.dtype != "F32":
            report.mismatches.append(f"'{scale_name}' should be F32 but is {scale.dtype}")
        if granularity is None:
            report.mismatches.append(
                f"'{scale_name}' has shape {_fmt_shape(scale.shape)}: neither one per-tensor "
                f"value nor one per output channel ({rows})"
            )
        elif wanted and granularity != wanted:
            report.mismatches.append(
                f"'{scale_name}' is a {granularity.replace('_', '-')} scale but the recipe "
                f"declares {wanted.replace('_', '-')} FP8"
            )
    _check_scalar(input_name, ckpt, report, required=False)


# --- declared quantization vs the checkpoint's own metadata -----------------------------------------------
def read_hf_quant_config(folder: str | Path) -> dict | None:
    """``hf_quant_config.json`` of a checkpoint folder (ModelOpt's export format), or ``None`` if absent."""
    path = Path(folder) / HF_QUANT_CONFIG
    if not present(path):
        return None
    try:
        data = read_json(path, HF_QUANT_CONFIG, MAX_JSON_BYTES, CheckpointError, fix="download or write it again")
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); download or write it again") from e
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        raise CheckpointError(
            f"{path} has no 'quantization' object; expected ModelOpt's form "
            '{"producer": {...}, "quantization": {"quant_algo": ..., ...}}'
        )
    return data


def _hf_layout(config: dict) -> str:
    """The NVFP4 layout an ``hf_quant_config.json`` states: its ``layout`` field, else ModelOpt's."""
    return str(config["quantization"].get("layout", "modelopt"))


def quant_declaration_problems(
    specs: set[QuantSpec], hf_config: dict | None, comfy_meta: dict | None
) -> list[str]:
    """Disagreements between the recipe's quantization and the checkpoint's ``hf_quant_config.json`` and
    ``_quantization_metadata``; an empty list when they agree or the checkpoint declares nothing."""
    problems: list[str] = []
    formats = {s.format for s in specs}
    nvfp4_layouts = {s.layout for s in specs if s.format == "nvfp4"}
    if hf_config is not None:
        quant = hf_config["quantization"]
        algo = str(quant.get("quant_algo") or "").upper()
        stated = {
            "NVFP4": "nvfp4",
            "W4A16_NVFP4": "nvfp4",
            "FP8": "fp8",
            "FP8_PER_CHANNEL_PER_TOKEN": "fp8",
        }.get(algo)
        if algo and algo != "MIXED_PRECISION":
            if stated is None:
                problems.append(
                    f"{HF_QUANT_CONFIG} declares quant_algo {algo}, which is not supported (nvfp4, fp8)"
                )
            elif stated not in formats:
                declared = ", ".join(sorted(formats)) or "no quantization"
                problems.append(
                    f"{HF_QUANT_CONFIG} declares quant_algo {algo} but the recipe declares {declared}"
                )
        if stated == "nvfp4":
            if quant.get("group_size", NVFP4_BLOCK) != NVFP4_BLOCK:
                problems.append(
                    f"{HF_QUANT_CONFIG} declares group_size {quant.get('group_size')}; NVFP4 uses "
                    f"{NVFP4_BLOCK}"
                )
            layout = _hf_layout(hf_config)
            for want in sorted(nvfp4_layouts - {layout}):
                problems.append(
                    f"{HF_QUANT_CONFIG} says the NVFP4 layout is {layout} but the recipe declares {want}"
                )
            order = quant.get("nibble_order")
            for want in sorted(nvfp4_layouts):
                if order and order != NVFP4_LAYOUTS[want].nibble_order:
                    problems.append(
                        f"{HF_QUANT_CONFIG} says nibble_order {order} but layout {want} stores element 0 "
                        f"{NVFP4_LAYOUTS[want].nibble_order.replace('_first', '')} nibble first"
                    )
    if comfy_meta is not None:
        layer_formats = {
            str(v.get("format", "")) for v in comfy_meta.get("layers", {}).values() if isinstance(v, dict)
        }
        if "nvfp4" in layer_formats:
            if "nvfp4" not in formats:
                problems.append(
                    "the file's _quantization_metadata (ComfyUI) marks NVFP4 layers but the recipe does not "
                    "declare nvfp4"
                )
            for want in sorted(nvfp4_layouts - {"comfy"}):
                problems.append(
                    f"the file's _quantization_metadata (ComfyUI) marks NVFP4 layers, which ComfyUI stores "
                    f"high nibble first with 128x4-swizzled scales, but the recipe declares layout {want}"
                )
        if any(f.startswith("float8") for f in layer_formats) and "fp8" not in formats:
            problems.append(
                "the file's _quantization_metadata (ComfyUI) marks FP8 layers but the recipe does not "
                "declare fp8"
            )
    return problems


def check_quant_declaration(spec: QuantSpec, checkpoint: Checkpoint) -> None:
    """Raise :class:`QuantizationError` if the checkpoint's metadata contradicts the recipe's declaration."""
    problems = quant_declaration_problems(
        {spec}, read_hf_quant_config(checkpoint.root), checkpoint.quantization_metadata
    )
    if problems:
        raise QuantizationError(
            f"checkpoint {checkpoint.root}: " + "; ".join(problems) + ". Make the recipe's "
            "quantization block (format, layout) match how the checkpoint was written."
        )
