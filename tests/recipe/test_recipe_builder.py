"""The builder: name mapping, lazily bound weights, repeated layers as identical subgraphs, checkpoint checks
located in the YAML, quantized weights, and the validate/inspect functions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from luminal_recipes.errors import CheckpointError, RecipeError
from luminal_recipes.graph import run_reference
from luminal_recipes.recipe.builder import build
from luminal_recipes.recipe.commands import inspect, validate
from luminal_recipes.weights.formats import dequantize_nvfp4, quantize_fp8, quantize_nvfp4
from luminal_recipes.weights.safetensors_io import Checkpoint

HIDDEN, LAYERS, SEQ = 8, 3, 5

RECIPE = r"""
kind: model
name: tiny
params:
  hidden: ${config.hidden}
  layers: ${config.layers}
  every: 2
dims: [seq]
inputs:
  x: {shape: [seq, hidden]}
outputs: [y]
root: net
weights:
  rename:
    - {prefix: "transformer.", to: ""}
    - {regex: '^h\.(\d+)\.', to: 'blocks.\1.'}
  split:
    - {regex: '(blocks\.\d+)\.qkv\.weight', into: ['\1.q.weight', '\1.k.weight', '\1.v.weight'],
       sizes: [hidden, hidden, hidden]}
  stack:
    - {regex: '(blocks\.\d+)\.experts\.(?P<index>\d+)\.weight', into: '\1.experts'}
  transpose:
    - {regex: 'proj\.weight'}
modules:
  net:
    inputs: [x]
    weights:
      proj.weight: [hidden, hidden]
    submodules:
      blocks: {module: block, repeat: layers, with: {window: "4 if index % every == 0 else 2"}}
    forward: |
      h = linear(x, self.proj.weight)
      for i in range(layers):
          h = self.blocks[i](h)
      return h
  block:
    params: {window: 0}
    inputs: [x]
    weights:
      q.weight: [hidden, hidden]
      k.weight: [hidden, hidden]
      v.weight: [hidden, hidden]
      experts: [2, hidden, hidden]
    forward: |
      q = linear(x, self.q.weight)
      k = linear(x, self.k.weight)
      v = linear(x, self.v.weight)
      mixed = q * k + v
      e0 = squeeze(narrow(self.experts, 0, 0, 1), 0)
      e1 = squeeze(narrow(self.experts, 0, 1, 2), 0)
      return x + linear(mixed, e0) + linear(mixed, e1) * (1.0 / window)
"""


def make_checkpoint(folder, rng, drop=(), extra=()):
    tensors = {"transformer.proj.weight": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        tensors[f"transformer.h.{i}.qkv.weight"] = rng.standard_normal((3 * HIDDEN, HIDDEN)).astype(
            np.float32
        )
        for e in range(2):
            tensors[f"transformer.h.{i}.experts.{e}.weight"] = (
                rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32) * 0.3
            )
    for name in drop:
        tensors.pop(name)
    for name in extra:
        tensors[name] = np.zeros((2,), np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"hidden": HIDDEN, "layers": LAYERS}))
    return tensors


def reference(tensors, x):
    """The same model written directly in numpy from the checkpoint's own names."""
    h = x @ tensors["transformer.proj.weight"]  # stored transposed: linear uses its transpose
    for i in range(LAYERS):
        q, k, v = np.split(tensors[f"transformer.h.{i}.qkv.weight"], 3)
        mixed = (h @ q.T) * (h @ k.T) + h @ v.T
        e0, e1 = (tensors[f"transformer.h.{i}.experts.{e}.weight"] for e in range(2))
        window = 4 if i % 2 == 0 else 2
        h = h + mixed @ e0.T + (mixed @ e1.T) * (1.0 / window)
    return h


@pytest.fixture
def tiny(tmp_path, write):
    rng = np.random.default_rng(0)
    path, text = write("tiny.yaml", RECIPE)
    tensors = make_checkpoint(tmp_path / "ckpt", rng)
    return path, text, tmp_path / "ckpt", tensors


def test_mapping_and_graph_match_numpy(tiny):
    path, _, ckpt, tensors = tiny
    model = build(path, weights=ckpt)
    assert sorted(model.weights)[:4] == [
        "blocks.0.experts",
        "blocks.0.k.weight",
        "blocks.0.q.weight",
        "blocks.0.v.weight",
    ]
    assert model.weights["blocks.1.experts"].shape == (2, HIDDEN, HIDDEN)
    x = np.random.default_rng(1).standard_normal((SEQ, HIDDEN)).astype(np.float32)
    out = run_reference(model.graph, {"x": x}, model.load_weight, {"seq": SEQ})["y"]
    np.testing.assert_allclose(out, reference(tensors, x), rtol=1e-5, atol=1e-5)


def test_weights_are_loaded_lazily(tiny, monkeypatch):
    path, _, ckpt, _ = tiny
    reads = []
    original = Checkpoint.load
    monkeypatch.setattr(Checkpoint, "load", lambda self, name: reads.append(name) or original(self, name))
    model = build(path, weights=ckpt)
    assert reads == []
    model.load_weight("blocks.2.q.weight")
    assert reads == ["transformer.h.2.qkv.weight"]


def test_repeated_layers_are_structurally_identical(tiny, block_signature):
    path, _, ckpt, _ = tiny
    model = build(path, weights=ckpt)
    blocks = [c for c in model.calls if c.module == "block"]
    assert [c.path for c in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    sigs = [block_signature(model.graph, c) for c in blocks]
    assert sigs[0] == sigs[2]  # same per-layer window -> same subgraph
    assert sigs[0] != sigs[1]  # window differs -> a different constant
    assert len(sigs[0]) == len(sigs[1])
    names = {model.graph.nodes[i].name for c in blocks[:1] for i in range(c.start, c.end)} - {None}
    assert names == {"blocks.0.q.weight", "blocks.0.k.weight", "blocks.0.v.weight", "blocks.0.experts"}


def test_shape_expression_disagreeing_with_checkpoint_is_located(tmp_path, write, position):
    rng = np.random.default_rng(0)
    make_checkpoint(tmp_path / "ckpt", rng)
    path, text = write(
        "bad.yaml", RECIPE.replace("experts: [2, hidden, hidden]", "experts: [2, hidden, hidden * 2]")
    )
    with pytest.raises(CheckpointError) as info:
        build(path, weights=tmp_path / "ckpt")
    message = str(info.value)
    assert (
        f"bad.yaml:{position(text, 'hidden * 2')}: shape of weight 'experts' does not agree with the "
        f"checkpoint (blocks.0.experts, blocks.1.experts, blocks.2.experts): recipe [2, 8, 16], checkpoint "
        f"[2, 8, 8]" in message
    )
    assert "dimension 2 ('hidden * 2') evaluates to 16" in message
    assert "1 problem" in message


def test_missing_and_unexpected_tensors_reported_together(tmp_path, write, position):
    rng = np.random.default_rng(0)
    make_checkpoint(tmp_path / "ckpt", rng, drop=["transformer.proj.weight"], extra=["transformer.stray"])
    path, text = write("r.yaml", RECIPE)
    with pytest.raises(CheckpointError) as info:
        validate(path, weights=tmp_path / "ckpt")
    message = str(info.value)
    assert (
        f"r.yaml:{position(text, 'proj.weight: [hidden')}: weight 'proj.weight' is missing from the "
        f"checkpoint (proj.weight)" in message
    )
    assert "1 checkpoint tensor(s) no weight of the recipe uses: 'stray'" in message
    assert "2 problems" in message


def test_op_errors_are_located_at_the_call(tmp_path, write, position):
    rng = np.random.default_rng(0)
    make_checkpoint(tmp_path / "ckpt", rng)
    path, text = write("r.yaml", RECIPE.replace("mixed = q * k + v", "mixed = q * concat([k, v], -1)"))
    with pytest.raises(RecipeError) as info:
        build(path, weights=tmp_path / "ckpt")
    message = str(info.value)
    assert f"r.yaml:{position(text, 'q * concat')}:" in message and "in blocks.0 (block)" in message


def test_fp8_quantized_weights_are_dequantized_in_the_graph(tmp_path, write):
    rng = np.random.default_rng(0)
    tensors = make_checkpoint(tmp_path / "dense", rng)
    quant = dict(tensors)
    dequant = dict(tensors)
    for i in range(LAYERS):
        for e in range(2):
            name = f"transformer.h.{i}.experts.{e}.weight"
            weight, scale = quantize_fp8(tensors[name])
            quant[name] = weight
            quant[name.replace(".weight", ".weight_scale")] = scale
            dequant[name] = weight.astype(np.float32) * scale
    (tmp_path / "q").mkdir()
    save_file(quant, str(tmp_path / "q" / "model.safetensors"))
    (tmp_path / "q" / "config.json").write_text(json.dumps({"hidden": HIDDEN, "layers": LAYERS}))
    # per-expert 2-D weights (no stacking) so each is a quantized linear weight
    text = RECIPE.replace("  stack:\n", "  stack: []\n  unused_stack:\n")
    text = text.replace(
        "  unused_stack:\n    - {regex: '(blocks\\.\\d+)\\.experts\\.(?P<index>\\d+)\\.weight', "
        "into: '\\1.experts'}\n",
        "",
    )
    text = text.replace(
        "      experts: [2, hidden, hidden]\n",
        "      experts.0.weight: [hidden, hidden]\n      experts.1.weight: [hidden, hidden]\n",
    )
    text = text.replace("e0 = squeeze(narrow(self.experts, 0, 0, 1), 0)", "e0 = self.experts[0].weight")
    text = text.replace("e1 = squeeze(narrow(self.experts, 0, 1, 2), 0)", "e1 = self.experts[1].weight")
    text = text.replace(
        "modules:\n  net:", "  quantization: {format: fp8, modules: ['*.experts.*']}\nmodules:\n  net:"
    )
    path, _ = write("q.yaml", text)
    model = build(path, weights=tmp_path / "q")
    assert str(model.weights["blocks.0.experts.0.weight"].dtype) == "f8e4m3"
    x = rng.standard_normal((SEQ, HIDDEN)).astype(np.float32)
    out = run_reference(model.graph, {"x": x}, model.load_weight, {"seq": SEQ})["y"]
    np.testing.assert_allclose(out, reference(dequant, x), rtol=1e-5, atol=1e-5)
    # the dense checkpoint does not satisfy a recipe that declares FP8
    with pytest.raises(CheckpointError, match="dense F32 weight but the recipe declares FP8"):
        build(path, weights=tmp_path / "dense")


def test_validate_and_inspect(tiny):
    path, _, ckpt, _ = tiny
    assert "checkpoint not checked" in str(validate(path))
    report = validate(path, weights=ckpt)
    assert "matches: 13 weights" in str(report)
    text = inspect(path, weights=ckpt)
    assert "hidden" in text and "= 8" in text and "(config)" in text
    assert "block                  x3" in text
    assert "weights: 13 tensors, 4.0 KiB" in text and "f32" in text
    assert f"graph: {len(report.models['tiny'].graph)} nodes" in text
    text = inspect(path, config={"hidden": 16, "layers": 1})
    assert "weights: 5 tensors" in text
    assert "--set" in inspect(path, weights=ckpt, sets=["every=1"])


NVFP4_RECIPE = """
kind: model
name: q
params: {n: 24, k: 32}
dims: [s]
inputs: {x: {shape: [s, k]}}
weights:
  quantization: {format: nvfp4, layout: LAYOUT, modules: [proj]}
modules:
  m:
    inputs: [x]
    weights: {proj.weight: [n, k], proj.bias: [n]}
    forward: return linear(x, self.proj.weight, self.proj.bias)
"""


@pytest.mark.parametrize("layout", ["modelopt", "comfy"])
def test_nvfp4_weights_in_both_layouts(tmp_path, write, layout):
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((24, 32)).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    packed = quantize_nvfp4(weight, layout)
    folder = tmp_path / layout
    folder.mkdir()
    save_file({**packed.tensors("proj"), "proj.bias": bias}, str(folder / "model.safetensors"))
    path, _ = write(f"{layout}.yaml", NVFP4_RECIPE.replace("LAYOUT", layout))
    model = build(path, weights=folder)
    assert str(model.weights["proj.weight"].dtype) == "u8"
    x = rng.standard_normal((5, 32)).astype(np.float32)
    out = run_reference(model.graph, {"x": x}, model.load_weight, {"s": 5})["output"]
    dense = dequantize_nvfp4(
        packed.weight, packed.weight_scale, packed.weight_scale_2, layout, shape=(24, 32)
    )
    np.testing.assert_allclose(out, x @ dense.T + bias, rtol=1e-5, atol=1e-5)
    # the other layout's declaration is caught before anything runs, naming the right one
    other = "comfy" if layout == "modelopt" else "modelopt"
    wrong, _ = write(f"wrong-{layout}.yaml", NVFP4_RECIPE.replace("LAYOUT", other))
    with pytest.raises(CheckpointError, match=f"declare layout: {layout}"):
        build(wrong, weights=folder)
    # and a recipe without a quantization block never reads the packed bytes as a dense matrix
    dense_recipe, _ = write(
        f"dense-{layout}.yaml",
        NVFP4_RECIPE.replace(
            "  quantization: {format: nvfp4, layout: LAYOUT, modules: [proj]}\n", "  dtype: {compute: f32}\n"
        ),
    )
    with pytest.raises(CheckpointError, match="quantized in the checkpoint"):
        build(dense_recipe, weights=folder)


def test_per_layer_values_computed_in_the_forward(tiny):
    path, _, ckpt, tensors = tiny
    text = path.read_text()
    text = text.replace(
        "          h = self.blocks[i](h)",
        "          h = self.blocks[i](h, gain=2.0 if i % every == 1 else 1.0)",
    )
    text = text.replace(
        "    params: {window: 0}\n    inputs: [x]\n",
        "    params: {window: 0}\n    inputs: [x]\n    options: {gain: 1.0}\n",
    )
    text = text.replace("      return x + linear(mixed, e0)", "      return x * gain + linear(mixed, e0)")
    path.write_text(text)
    model = build(path, weights=ckpt)
    x = np.random.default_rng(1).standard_normal((SEQ, HIDDEN)).astype(np.float32)
    out = run_reference(model.graph, {"x": x}, model.load_weight, {"seq": SEQ})["y"]
    h = x @ tensors["transformer.proj.weight"]
    for i in range(LAYERS):
        q, k, v = np.split(tensors[f"transformer.h.{i}.qkv.weight"], 3)
        mixed = (h @ q.T) * (h @ k.T) + h @ v.T
        e0, e1 = (tensors[f"transformer.h.{i}.experts.{e}.weight"] for e in range(2))
        gain = 2.0 if i % 2 == 1 else 1.0
        h = h * gain + mixed @ e0.T + (mixed @ e1.T) * (1.0 / (4 if i % 2 == 0 else 2))
    np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-5)


def test_per_op_compute_dtype(tiny):
    path, _, ckpt, tensors = tiny
    path.write_text(
        path.read_text().replace(
            "  transpose:\n", "  dtype: {compute: f32, per_op: {linear: bf16}}\n  transpose:\n"
        )
    )
    model = build(path, weights=ckpt)
    casts = [n for n in model.graph.nodes if n.op == "Cast"]
    assert {str(n.dtype) for n in casts} == {"bf16", "f32"}
    assert str(model.graph.tensor("y").dtype) == "f32"
    x = np.random.default_rng(1).standard_normal((SEQ, HIDDEN)).astype(np.float32)
    out = run_reference(model.graph, {"x": x}, model.load_weight, {"seq": SEQ})["y"]
    expected = reference(tensors, x)
    error = np.abs(out - expected).max() / np.abs(expected).max()
    assert 1e-4 < error < 5e-2  # bf16 matmuls: visibly rounded, still the same function
