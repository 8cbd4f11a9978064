"""The quantization tool on diffusers- and transformers-style folders (sharded and single-file)."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from luminal_recipes import __version__
from luminal_recipes.errors import QuantizationError
from luminal_recipes.weights.check import (
    ExpectedTensor,
    QuantSpec,
    check_checkpoint,
    check_quant_declaration,
    read_hf_quant_config,
)
from luminal_recipes.weights.formats import dequantize_fp8, quantize_nvfp4
from luminal_recipes.weights.quantize import quantize_checkpoint
from luminal_recipes.weights.safetensors_io import Checkpoint

CONFIG = {"_class_name": "Flux2Transformer2DModel", "num_layers": 1}
NVFP4 = QuantSpec("nvfp4", "modelopt")
COMFY = QuantSpec("nvfp4", "comfy")


def _diffusers_folder(path, sharded=True):
    """A FLUX.2-shaped diffusers transformer folder, bf16, saved by torch (sharded with an index)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    tensors = {
        "x_embedder.weight": randn(64, 32),
        "transformer_blocks.0.attn.to_q.weight": randn(64, 64),
        "transformer_blocks.0.attn.to_q.bias": randn(64),
        "transformer_blocks.0.ff.linear_in.weight": randn(128, 64),
        "norm_out.linear.weight": randn(128, 64),
        "proj_out.weight": randn(20, 64),  # 20 rows: not a multiple of 16
        "transformer_blocks.0.norm.weight": randn(64),
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(tensors)
    if not sharded:
        save_file(tensors, path / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
        return tensors
    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": names[:4],
        "diffusion_pytorch_model-00002-of-00002.safetensors": names[4:],
    }
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, path / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, m in shards.items() for n in m}}
    (path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def test_nvfp4_modelopt_on_a_sharded_diffusers_folder(tmp_path):
    src, dst = tmp_path / "transformer", tmp_path / "out" / "transformer-nvfp4"
    tensors = _diffusers_folder(src)
    summary = quantize_checkpoint(src, dst, "nvfp4", "modelopt", exclude=["norm_out.*"])
    assert sorted(summary.quantized) == [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.ff.linear_in",
        "x_embedder",
    ]
    assert summary.kept == {
        "norm_out.linear.weight": "excluded by pattern 'norm_out.*'",
        "proj_out.weight": "shape [20, 64] is not a multiple of 16 in both dims",
    }
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir()) + [
        "hf_quant_config.json"
    ]
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()
    assert "quantized 3 linear weights" in str(summary) and "proj_out.weight: shape [20, 64]" in str(summary)
    assert read_hf_quant_config(dst) == {
        "producer": {"name": "luminal-recipes", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["norm_out.linear", "proj_out"],
        },
    }
    out = Checkpoint.open(dst)  # validates the rewritten index against the shards
    assert out.index is not None and out.metadata == {"format": "pt"}
    stored_dtypes = {"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32"}
    for module in summary.quantized:
        expected = quantize_nvfp4(_numpy(tensors[f"{module}.weight"]), "modelopt")
        for name, array in expected.tensors(module).items():
            assert out[name].dtype == stored_dtypes[name.rsplit(".", 1)[1]]
            assert out.load(name).tobytes() == array.tobytes()
    for name in ("proj_out.weight", "norm_out.linear.weight", "transformer_blocks.0.norm.weight"):
        np.testing.assert_array_equal(
            out.load(name).view(np.uint16), tensors[name].view(torch.int16).numpy().view(np.uint16)
        )
    expected = {
        n: ExpectedTensor(
            tuple(t.shape), "bf16", NVFP4 if n[: -len(".weight")] in summary.quantized else None
        )
        for n, t in tensors.items()
    }
    check_checkpoint(expected, out)


def test_nvfp4_comfy_layout_single_file(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    tensors = _diffusers_folder(src, sharded=False)
    summary = quantize_checkpoint(src, dst, "nvfp4", "comfy")
    out = Checkpoint.open(dst)
    assert out.files == [dst / "diffusion_pytorch_model.safetensors"] and out.index is None
    layers = out.quantization_metadata["layers"]
    assert layers == {m: {"format": "nvfp4"} for m in summary.quantized}
    config = read_hf_quant_config(dst)["quantization"]
    assert (config["layout"], config["nibble_order"]) == ("comfy", "high_first")
    w = out.load("transformer_blocks.0.ff.linear_in.weight_scale")
    assert w.shape == (128, 4)  # [128, 64/16] swizzled: rows padded to 128
    expected = {
        n: ExpectedTensor(tuple(t.shape), quant=COMFY if n[: -len(".weight")] in summary.quantized else None)
        for n, t in tensors.items()
    }
    check_checkpoint(expected, out)
    check_quant_declaration(COMFY, out)
    with pytest.raises(QuantizationError, match="layout"):
        check_quant_declaration(NVFP4, out)


@pytest.mark.parametrize(
    "granularity,algo", [("per_tensor", "FP8"), ("per_channel", "FP8_PER_CHANNEL_PER_TOKEN")]
)
def test_fp8(tmp_path, granularity, algo):
    src, dst = tmp_path / "src", tmp_path / "dst"
    tensors = _diffusers_folder(src)
    summary = quantize_checkpoint(src, dst, "fp8", fp8_granularity=granularity)
    assert "proj_out" in summary.quantized  # FP8 has no block-size constraint
    assert read_hf_quant_config(dst)["quantization"]["quant_algo"] == algo
    out = Checkpoint.open(dst)
    for module in summary.quantized:
        original = tensors[f"{module}.weight"].float().numpy()
        scale = out.load(f"{module}.weight_scale")
        assert scale.shape == (() if granularity == "per_tensor" else (original.shape[0],))
        err = np.abs(dequantize_fp8(out.load(f"{module}.weight"), scale) - original)
        floor = 2.0**-10 * (scale if scale.ndim == 0 else scale[:, None])
        assert np.all(err <= np.maximum(2.0**-4 * np.abs(original), floor) * (1 + 2**-20))


def test_embeddings_stay_dense_in_a_transformers_folder(tmp_path):
    src = tmp_path / "llm"
    src.mkdir()
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(64, 32),
            "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32),
            "lm_head.weight": torch.randn(64, 32),
        },
        src / "model.safetensors",
    )
    (src / "tokenizer.json").write_text("{}")
    summary = quantize_checkpoint(src, tmp_path / "out", "nvfp4", exclude=["lm_head"])
    assert summary.quantized == ["model.layers.0.mlp.up_proj"]
    assert summary.kept["model.embed_tokens.weight"] == "excluded by pattern '*embed_tokens'"
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_failure_leaves_nothing_behind(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _diffusers_folder(src)
    bad = torch.zeros(32, 32, dtype=torch.bfloat16)
    bad[3, 4] = float("nan")
    save_file({"zz.weight": bad}, src / "diffusion_pytorch_model-00002-of-00002.safetensors")
    index = json.loads((src / "diffusion_pytorch_model.safetensors.index.json").read_text())
    index["weight_map"] = {
        n: f for n, f in index["weight_map"].items() if not f.endswith("00002.safetensors")
    }
    index["weight_map"]["zz.weight"] = "diffusion_pytorch_model-00002-of-00002.safetensors"
    (src / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QuantizationError, match=r"'zz\.weight'.*NaN"):
        quantize_checkpoint(src, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_refusals(tmp_path):
    src = tmp_path / "src"
    _diffusers_folder(src)
    with pytest.raises(QuantizationError, match="already exists"):
        quantize_checkpoint(src, src)
    with pytest.raises(QuantizationError, match="inside the source"):
        quantize_checkpoint(src, src / "q")
    with pytest.raises(QuantizationError, match="not a folder"):
        quantize_checkpoint(src / "config.json", tmp_path / "q")
    with pytest.raises(QuantizationError, match="per_tensor"):
        quantize_checkpoint(src, tmp_path / "q", "fp8", "comfy", fp8_granularity="per_channel")
    with pytest.raises(QuantizationError, match="unknown format"):
        quantize_checkpoint(src, tmp_path / "q", "int4")
    quantize_checkpoint(src, tmp_path / "q")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "qq")
