"""Checking a checkpoint against a recipe's expectations: every problem at once, layouts told apart."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from luminal_recipes.errors import CheckpointError, QuantizationError
from luminal_recipes.weights.check import (
    ExpectedTensor,
    QuantSpec,
    check_checkpoint,
    check_quant_declaration,
    read_hf_quant_config,
)
from luminal_recipes.weights.formats import quantize_fp8, quantize_nvfp4
from luminal_recipes.weights.safetensors_io import Checkpoint

NVFP4 = QuantSpec("nvfp4", "modelopt")
COMFY = QuantSpec("nvfp4", "comfy")


def _save(folder, tensors, metadata=None):
    save_file(tensors, folder / "model.safetensors", metadata=metadata)
    return Checkpoint.open(folder)


def _mixed(layout="modelopt"):
    """A dense norm, an NVFP4 linear (200 x 64, so the two layouts' shapes differ) and an FP8 linear."""
    rng = np.random.default_rng(0)
    tensors = {"norm.weight": np.ones(64, np.float32)}
    tensors.update(
        quantize_nvfp4(rng.standard_normal((200, 64)).astype(np.float32), layout).tensors("q_proj")
    )
    weight, scale = quantize_fp8(rng.standard_normal((32, 64)).astype(np.float32))
    tensors.update({"o_proj.weight": weight, "o_proj.weight_scale": scale})
    return tensors


EXPECTED = {
    "norm.weight": ExpectedTensor((64,), "f32"),
    "q_proj.weight": ExpectedTensor((200, 64), quant=NVFP4),
    "o_proj.weight": ExpectedTensor((32, 64), quant=QuantSpec("fp8", "per_tensor")),
}


def test_matching_checkpoint_passes(tmp_path):
    check_checkpoint(EXPECTED, _save(tmp_path, _mixed()))


def test_comfy_checkpoint_passes_when_declared_comfy(tmp_path):
    tensors = _mixed("comfy")
    ckpt = _save(
        tmp_path, tensors, {"_quantization_metadata": json.dumps({"layers": {"q_proj": {"format": "nvfp4"}}})}
    )
    expected = dict(EXPECTED, **{"q_proj.weight": ExpectedTensor((200, 64), quant=COMFY)})
    check_checkpoint(expected, ckpt)


def test_every_problem_is_reported_at_once(tmp_path):
    tensors = _mixed("comfy")  # NVFP4 in ComfyUI's layout while the recipe says modelopt
    tensors["norm.weight"] = np.ones(64, np.float16)  # dtype mismatch
    tensors["extra.bias"] = np.zeros(3, np.float32)  # unexpected
    packed = quantize_nvfp4(np.ones((16, 32), np.float32))  # NVFP4 where the recipe expects a dense weight
    tensors.update({"mlp.weight": packed.weight, "mlp.weight_scale": packed.weight_scale})
    expected = dict(
        EXPECTED,
        **{
            "missing.weight": ExpectedTensor((4, 4)),
            "mlp.weight": ExpectedTensor((16, 32), "bf16"),
            "o_proj.weight": ExpectedTensor((32, 48), quant=QuantSpec("fp8", "per_channel")),
        },
    )
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(expected, _save(tmp_path, tensors))
    message = str(e.value)
    assert "1 missing tensor: 'missing.weight'" in message
    assert "1 unexpected tensor: 'extra.bias'" in message
    assert "'norm.weight' is F16 in the checkpoint, the recipe expects F32" in message
    assert "'mlp.weight' is NVFP4-packed (U8 [16, 16] with a weight_scale)" in message
    assert "'q_proj.weight' is U8 [208, 32]" in message and "comfy layout's shape" in message
    assert "'q_proj.weight_scale' has shape [256, 4]" in message and "declare layout: comfy" in message
    assert "'o_proj.weight' has shape [32, 64] in the checkpoint, the recipe expects [32, 48]" in message
    assert "'o_proj.weight_scale' is a per-tensor scale but the recipe declares per-channel FP8" in message
    assert str(tmp_path) in message
    unexpected_line = next(line for line in message.splitlines() if "unexpected" in line)
    assert "mlp.weight_scale" not in unexpected_line  # explained by the NVFP4 mismatch, not listed again


def test_dense_checkpoint_where_nvfp4_is_declared(tmp_path):
    ckpt = _save(tmp_path, {"q_proj.weight": np.zeros((200, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"dense F32 \[200, 64\] weight but the recipe declares NVFP4"):
        check_checkpoint({"q_proj.weight": ExpectedTensor((200, 64), quant=NVFP4)}, ckpt)


def test_modelopt_scales_where_comfy_is_declared(tmp_path):
    ckpt = _save(tmp_path, quantize_nvfp4(np.ones((200, 64), np.float32), "modelopt").tensors("l"))
    with pytest.raises(CheckpointError) as e:
        check_checkpoint({"l.weight": ExpectedTensor((200, 64), quant=COMFY)}, ckpt)
    assert "modelopt layout's shape" in str(e.value) and "declare layout: modelopt" in str(e.value)


def test_ignore_unexpected_patterns(tmp_path):
    ckpt = _save(tmp_path, {"a": np.zeros(2, np.float32), "rotary.inv_freq": np.zeros(2, np.float32)})
    check_checkpoint({"a": ExpectedTensor((2,))}, ckpt, ignore_unexpected=["*.inv_freq"])


def test_metadata_that_contradicts_the_declared_layout(tmp_path):
    # square-enough shapes that both layouts agree on every stored shape: only the metadata can tell
    tensors = quantize_nvfp4(np.ones((256, 64), np.float32), "comfy").tensors("l")
    meta = {
        "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {"l": {"format": "nvfp4"}}})
    }
    ckpt = _save(tmp_path, tensors, meta)
    expected = {"l.weight": ExpectedTensor((256, 64), quant=NVFP4)}
    with pytest.raises(CheckpointError, match="high nibble first with 128x4-swizzled scales"):
        check_checkpoint(expected, ckpt)
    with pytest.raises(QuantizationError, match="declares layout modelopt"):
        check_quant_declaration(NVFP4, ckpt)
    check_quant_declaration(COMFY, ckpt)


def test_hf_quant_config_checks(tmp_path):
    ckpt = _save(tmp_path, quantize_nvfp4(np.ones((256, 64), np.float32)).tensors("l"))
    config = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(config))
    assert read_hf_quant_config(tmp_path) == config
    check_quant_declaration(NVFP4, ckpt)
    with pytest.raises(QuantizationError, match="NVFP4 layout is modelopt but the recipe declares comfy"):
        check_quant_declaration(COMFY, ckpt)
    with pytest.raises(QuantizationError, match="quant_algo NVFP4 but the recipe declares fp8"):
        check_quant_declaration(QuantSpec("fp8", None), ckpt)
    config["quantization"].update(layout="comfy", nibble_order="low_first")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="nibble_order low_first but layout comfy"):
        check_quant_declaration(COMFY, ckpt)
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="hf_quant_config.json:1:2: not valid JSON"):
        read_hf_quant_config(tmp_path)
    assert read_hf_quant_config(tmp_path / "elsewhere") is None


def test_bad_declarations():
    with pytest.raises(QuantizationError, match="unknown NVFP4 layout"):
        QuantSpec("nvfp4", "swizzled")
    with pytest.raises(QuantizationError, match="unknown quantization format"):
        QuantSpec("int4")
