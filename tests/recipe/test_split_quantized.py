"""Split rules over quantized fused weights (packed QKV): each part, dequantized, is exactly its rows of the
fused weight dequantized, in every layout; a layout the stored shapes contradict is refused before loading."""

from __future__ import annotations

import numpy as np
import pytest

from luminal_recipes.errors import CheckpointError
from luminal_recipes.recipe.mapping import StoredTensor, map_checkpoint
from luminal_recipes.recipe.schema import WeightsSection
from luminal_recipes.weights.formats import (
    dequantize_fp8,
    dequantize_nvfp4,
    nvfp4_layout,
    quantize_fp8,
    quantize_nvfp4,
)

PARTS = ("q", "k", "v")
SAFETENSORS = {np.dtype("uint8"): "U8", np.dtype("float32"): "F32"}


def _dtype_name(array: np.ndarray) -> str:
    return SAFETENSORS.get(array.dtype, "F8_E4M3")


def split(tensors: dict[str, np.ndarray], quantization: dict | None, **rule):
    section = WeightsSection.model_validate(
        {
            "split": [{"regex": r"attn\.qkv\.weight", "into": [f"attn.{p}.weight" for p in PARTS], **rule}],
            "quantization": quantization,
        }
    )
    stored = {name: StoredTensor(tuple(a.shape), _dtype_name(a)) for name, a in tensors.items()}
    return map_checkpoint(stored, section, tensors.__getitem__)


def fused_weight(rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(rows * 1000 + cols)
    # rows of very different magnitudes: a scale applied to the wrong rows changes the values a lot
    return (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-4, 4, (rows, 1)))).astype(np.float32)


@pytest.mark.parametrize(
    ("layout", "n", "sizes"),
    [
        ("modelopt", 64, None),
        ("modelopt", 40, None),
        ("comfy", 64, None),
        ("comfy", 48, None),
        ("comfy", 40, [40] * 3),
    ],
)
def test_nvfp4_parts_are_the_fused_rows(layout, n, sizes):
    k = 96
    lay = nvfp4_layout(layout)
    w = fused_weight(3 * n, k)
    tensors = quantize_nvfp4(w, layout).tensors("attn.qkv")
    tensors["attn.qkv.input_scale"] = np.array(0.5, dtype=np.float32)
    mapped = split(tensors, {"format": "nvfp4", "layout": layout}, **({"sizes": sizes} if sizes else {}))
    suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    assert set(mapped) == {f"attn.{p}.{s}" for p in PARTS for s in suffixes}
    fused = dequantize_nvfp4(*(tensors[f"attn.qkv.{s}"] for s in suffixes[:3]), layout, shape=(3 * n, k))
    for index, part in enumerate(PARTS):
        got = {s: mapped[f"attn.{part}.{s}"] for s in suffixes}
        assert got["weight"].shape == lay.weight_shape(n, k)
        assert got["weight_scale"].shape == lay.scale_shape(n, k)
        arrays = {s: np.asarray(t.load()) for s, t in got.items()}
        assert arrays["weight"].shape == got["weight"].shape
        assert arrays["weight_scale"].shape == got["weight_scale"].shape
        dense = dequantize_nvfp4(
            arrays["weight"], arrays["weight_scale"], arrays["weight_scale_2"], layout, (n, k)
        )
        np.testing.assert_array_equal(dense, fused[index * n : (index + 1) * n])
        assert arrays["input_scale"] == np.float32(0.5)


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_fp8_parts_are_the_fused_rows(granularity):
    n, k = 24, 40
    w = fused_weight(3 * n, k)
    weight, scale = quantize_fp8(w, granularity)
    mapped = split(
        {"attn.qkv.weight": weight, "attn.qkv.weight_scale": scale}, {"format": "fp8", "scale": granularity}
    )
    assert set(mapped) == {f"attn.{p}.{s}" for p in PARTS for s in ("weight", "weight_scale")}
    fused = dequantize_fp8(weight, scale)
    for index, part in enumerate(PARTS):
        got = dequantize_fp8(mapped[f"attn.{part}.weight"].load(), mapped[f"attn.{part}.weight_scale"].load())
        np.testing.assert_array_equal(got, fused[index * n : (index + 1) * n])


@pytest.mark.parametrize(("stored", "declared"), [("comfy", "modelopt"), ("modelopt", "comfy")])
def test_scales_of_the_other_layout_are_refused(stored, declared):
    tensors = quantize_nvfp4(fused_weight(3 * 64, 64), stored).tensors("attn.qkv")
    with pytest.raises(CheckpointError, match=f"declare layout: {stored}"):
        split(tensors, {"format": "nvfp4", "layout": declared})


def test_quantized_split_needs_a_quantization_block():
    tensors = quantize_nvfp4(fused_weight(48, 32), "modelopt").tensors("attn.qkv")
    with pytest.raises(CheckpointError, match="stores it as NVFP4 but the recipe has no quantization block"):
        split(tensors, None)


def test_quantized_weight_splits_only_on_rows():
    weight, scale = quantize_fp8(fused_weight(16, 48))
    with pytest.raises(CheckpointError, match="output rows"):
        split({"attn.qkv.weight": weight, "attn.qkv.weight_scale": scale}, {"format": "fp8"}, axis=1)
