"""The quantization tool: a bf16/f16/f32 checkpoint folder -> the same with NVFP4 or FP8 linear weights.

Every 2-D ``*.weight`` of a float dtype is treated as a linear layer and quantized, except embedding tables
(they are gathered, not multiplied), modules matching an ``exclude`` pattern and, for NVFP4, weights whose
dims are not multiples of 16; those stay as they are. Other tensors and files (configs, tokenizers) are copied
unchanged, file and shard names are kept, and ``hf_quant_config.json`` is written in ModelOpt's form so other
loaders (vLLM, TensorRT-LLM, diffusers) recognise the result. The comfy layout also gets ComfyUI's
``_quantization_metadata``. Output is built in a temporary sibling folder and renamed into place at the end:
an error or Ctrl-C leaves nothing. No activation scales (``input_scale``) are written: there is no calibration
data, so the result is weight-only."""

from __future__ import annotations

import fnmatch
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from .. import __version__
from ..errors import QuantizationError
from .check import DENSE_FLOAT, HF_QUANT_CONFIG
from .formats import NVFP4_BLOCK, FP8Granularity, nvfp4_layout, quantize_fp8, quantize_nvfp4
from .safetensors_io import INDEX_SUFFIX, QUANT_METADATA_KEY, Checkpoint, TensorInfo

# Embedding tables are 2-D ``.weight`` tensors too, but a Gather reads them: quantizing would break lookups.
EMBEDDING_PATTERNS = ("*embed_tokens", "*embeddings", "*embedding", "*wte", "*wpe")
COMFY_FORMATS = {"nvfp4": "nvfp4", "fp8": "float8_e4m3fn"}


@dataclass
class QuantizeSummary:
    """What :func:`quantize_checkpoint` did."""

    src: Path
    dst: Path
    format: str
    layout: str
    quantized: list[str] = field(default_factory=list)  # module names
    kept: dict[str, str] = field(default_factory=dict)  # 2-D weight left dense -> why
    bytes_in: int = 0
    bytes_out: int = 0

    def __str__(self) -> str:
        lines = [
            f"quantized {len(self.quantized)} linear weights of {self.src} to {self.format} ({self.layout} "
            f"layout) in {self.dst}: {self.bytes_in / 2**20:.1f} MiB -> {self.bytes_out / 2**20:.1f} MiB"
        ]
        if self.kept:
            lines.append(f"kept {len(self.kept)} 2-D weights dense:")
            lines += [f"  {name}: {why}" for name, why in sorted(self.kept.items())]
        return "\n".join(lines)


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str = "nvfp4",
    layout: str = "modelopt",
    exclude: Sequence[str] = (),
    fp8_granularity: FP8Granularity = "per_tensor",
) -> QuantizeSummary:
    """Write a quantized copy of checkpoint folder ``src`` to the new folder ``dst``.

    ``fmt``: ``nvfp4`` or ``fp8``. ``layout``: ``modelopt`` or ``comfy`` (for NVFP4 the nibble order and scale
    swizzle; for FP8 only which metadata is written). ``exclude``: fnmatch patterns of module names (or tensor
    names) to keep dense.
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    _check_arguments(src, dst, fmt, layout, fp8_granularity)
    ckpt = Checkpoint.open(src)
    _refuse_quantized(ckpt)
    summary = QuantizeSummary(src, dst, fmt, layout)
    patterns = (*EMBEDDING_PATTERNS, *exclude)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    except OSError as exc:
        raise QuantizationError(f"cannot create {dst} ({exc.strerror or exc}); choose a writable folder") from None
    try:
        weight_map: dict[str, str] = {}
        for file in ckpt.files:
            infos = sorted((i for i in ckpt.tensors.values() if i.file == file), key=lambda i: i.start)
            out, layers = {}, {}
            for info in infos:
                produced = _convert(ckpt, info, fmt, layout, fp8_granularity, patterns, summary)
                out.update(produced)
                if f"{_module(info.name)}.weight_scale" in produced:
                    layers[_module(info.name)] = {"format": COMFY_FORMATS[fmt]}
            metadata = dict(ckpt.file_metadata[file])
            if layout == "comfy" and layers:
                metadata[QUANT_METADATA_KEY] = json.dumps({"format_version": "1.0", "layers": layers})
            save_file(out, staging / file.name, metadata=metadata or None)
            summary.bytes_in += sum(i.nbytes for i in infos)
            summary.bytes_out += sum(a.nbytes for a in out.values())
            weight_map.update({name: file.name for name in out})
        if ckpt.index is not None:
            index = {
                "metadata": {"total_size": summary.bytes_out},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (staging / ckpt.index.name).write_text(json.dumps(index, indent=2) + "\n")
        _copy_other_files(
            src, staging, skip={f.name for f in ckpt.files} | {ckpt.index.name if ckpt.index else ""}
        )
        config = hf_quant_config(fmt, layout, fp8_granularity, sorted({_module(n) for n in summary.kept}))
        (staging / HF_QUANT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        staging.rename(dst)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)  # nothing partial is left, whatever went wrong
        if isinstance(exc, (OSError, SafetensorError)):  # a full disk, a quota, a vanished folder
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise QuantizationError(
                f"cannot write the quantized checkpoint {dst} ({reason}); nothing was written. Free some space "
                "or choose another destination."
            ) from None
        raise
    return summary


def hf_quant_config(fmt: str, layout: str, fp8_granularity: str, exclude_modules: list[str]) -> dict:
    """``hf_quant_config.json`` in NVIDIA ModelOpt's export form, plus layout fields for the comfy layout."""
    if fmt == "nvfp4":
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": NVFP4_BLOCK}
    else:
        algo = "FP8" if fp8_granularity == "per_tensor" else "FP8_PER_CHANNEL_PER_TOKEN"
        quant = {"quant_algo": algo, "kv_cache_quant_algo": None}
    quant["exclude_modules"] = exclude_modules
    if layout == "comfy":
        quant["layout"] = "comfy"
        if fmt == "nvfp4":
            quant["nibble_order"] = "high_first"
            quant["block_scale_layout"] = "cublas_128x4_swizzled"
    return {"producer": {"name": "luminal-recipes", "version": __version__}, "quantization": quant}


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _check_arguments(src: Path, dst: Path, fmt: str, layout: str, fp8_granularity: str) -> None:
    if fmt not in ("nvfp4", "fp8"):
        raise QuantizationError(f"unknown format '{fmt}'; use --format nvfp4 or --format fp8")
    if layout not in ("modelopt", "comfy"):
        raise QuantizationError(f"unknown layout '{layout}'; use --layout modelopt or --layout comfy")
    if fmt == "fp8" and fp8_granularity not in ("per_tensor", "per_channel"):
        raise QuantizationError(f"unknown FP8 granularity '{fp8_granularity}'; use per_tensor or per_channel")
    if fmt == "fp8" and layout == "comfy" and fp8_granularity != "per_tensor":
        raise QuantizationError(
            "ComfyUI's float8_e4m3fn layers carry one scale per tensor; use per_tensor FP8 "
            "with --layout comfy"
        )
    if not src.is_dir():
        raise QuantizationError(
            f"source {src} is not a folder; pass the model's folder (the one holding "
            "config.json and the .safetensors files)"
        )
    if dst.exists():
        raise QuantizationError(f"destination {dst} already exists; choose a new folder or remove it first")
    if dst.resolve().is_relative_to(src.resolve()):
        raise QuantizationError(
            f"destination {dst} lies inside the source folder {src}; choose a folder outside it"
        )


def _refuse_quantized(ckpt: Checkpoint) -> None:
    scales = [n for n in ckpt.names if n.endswith(".weight_scale")]
    if scales or (ckpt.root / HF_QUANT_CONFIG).exists() or ckpt.quantization_metadata is not None:
        what = f"tensor '{scales[0]}'" if scales else f"{HF_QUANT_CONFIG} or _quantization_metadata"
        raise QuantizationError(
            f"{ckpt.root} is already quantized ({what}); quantize from the bf16/f32 checkpoint"
        )


def _convert(
    ckpt: Checkpoint,
    info: TensorInfo,
    fmt: str,
    layout: str,
    granularity: FP8Granularity,
    patterns: Sequence[str],
    summary: QuantizeSummary,
) -> dict[str, np.ndarray]:
    """The output tensors for one input tensor: quantized if it is an eligible linear weight, else itself."""
    name = info.name
    if not (name.endswith(".weight") and len(info.shape) == 2 and info.dtype in DENSE_FLOAT):
        return {name: ckpt.load(name)}
    module = _module(name)
    hit = next((p for p in patterns if fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(name, p)), None)
    n, k = info.shape
    if hit is not None:
        summary.kept[name] = f"excluded by pattern '{hit}'"
        return {name: ckpt.load(name)}
    if fmt == "nvfp4" and (n % NVFP4_BLOCK or k % NVFP4_BLOCK):
        summary.kept[name] = f"shape [{n}, {k}] is not a multiple of {NVFP4_BLOCK} in both dims"
        return {name: ckpt.load(name)}
    try:
        if fmt == "nvfp4":
            tensors = quantize_nvfp4(ckpt.load(name), nvfp4_layout(layout)).tensors(module)
        else:
            weight, scale = quantize_fp8(ckpt.load(name), granularity)
            tensors = {name: weight, f"{module}.weight_scale": scale}
    except QuantizationError as e:
        raise QuantizationError(f"cannot quantize '{name}' of {info.file}: {e}") from e
    summary.quantized.append(module)
    return tensors


def _copy_other_files(src: Path, staging: Path, skip: set[str]) -> None:
    for path in sorted(src.iterdir()):
        if (
            path.is_file()
            and path.name not in skip
            and not path.name.endswith((".safetensors", INDEX_SUFFIX))
        ):
            shutil.copy2(path, staging / path.name)
