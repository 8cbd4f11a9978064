"""LoRA on FLUX.2 (`--lora PATH[:SCALE]`, a pipeline's `loras:`) against diffusers' `load_lora_weights`.

One random LoRA of the tiny transformer, written in each key format by lora_files.py (diffusers' own
save_lora_weights, PEFT, fal/ai-toolkit in two spellings, ComfyUI/kohya). Each file is loaded by diffusers (the
reference) and by us: the transformer's velocity within 1e-4, the image at PSNR >= 40 dB.
Merged into the weights (the default for f32), and added in the graph (for quantized weights: an FP8 transformer
or NVFP4 transformer keeps its packed weights and gains x @ A.T @ B.T * scale, against diffusers over the same
weights dequantized).
"""

from __future__ import annotations

import itertools
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.models import Flux2Transformer2DModel
from lora_files import make_lora, write_formats  # tests/pipeline/lora_files.py
from safetensors.numpy import save_file

from luminal_recipes.errors import LoraError
from luminal_recipes.image_io import to_uint8
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.recipe.builder import build_model
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.recipe.lora import LoraSpec
from luminal_recipes.tasks.flux2.latents import initial_noise, latent_ids, text_ids
from luminal_recipes.tasks.flux2.steps import rope_tables
from luminal_recipes.weights.formats import dequantize_fp8, dequantize_nvfp4
from luminal_recipes.weights.quantize import quantize_checkpoint
from luminal_recipes.weights.safetensors_io import Checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
SETS = ["steps=2", "width=48", "height=32", "max_sequence_length=32"]


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, Path]:
    state, config, _ = make_lora()
    return write_formats(state, config, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def reference() -> Flux2Pipeline:
    return Flux2Pipeline.from_pretrained(CHECKPOINT)


@contextmanager
def adapted(ref: Flux2Pipeline, paths: list[Path], scales: list[float]):
    """``ref`` with the LoRA files loaded by diffusers' ``load_lora_weights`` at ``scales``; removed after."""
    names = []
    for path in paths:
        names.append(f"a{next(_ADAPTERS)}")
        ref.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=names[-1])
    ref.set_adapters(names, adapter_weights=scales)
    try:
        yield ref
    finally:
        ref.delete_adapters(names)


_ADAPTERS = itertools.count()


def velocity_inputs(config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    h, w, t = 2, 3, 5
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, list(config.axes_dims_rope), config.rope_theta)
    return {"hidden_states": rng.standard_normal((1, h * w, config.in_channels)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, t, config.joint_attention_dim)).astype(np.float32),
            "timestep": np.float32([0.7]), "guidance": np.float32([4.0]),
            "rope_cos": rope["cos"], "rope_sin": rope["sin"], "h": h, "w": w, "t": t}


def diffusers_velocity(transformer, x: dict) -> np.ndarray:
    with torch.no_grad():
        return transformer(hidden_states=torch.tensor(x["hidden_states"]),
                           encoder_hidden_states=torch.tensor(x["encoder_hidden_states"]),
                           timestep=torch.tensor(x["timestep"]), guidance=torch.tensor(x["guidance"]),
                           img_ids=torch.tensor(latent_ids(x["h"], x["w"])).float(),
                           txt_ids=torch.tensor(text_ids(x["t"])).float(), return_dict=False)[0].numpy()


def our_velocity(model, x: dict, compile: bool = False) -> np.ndarray:
    inputs = {k: v for k, v in x.items() if k not in ("h", "w", "t")}
    return ModelEngine(model, compile=compile)(inputs)["velocity"]


def close(got: np.ndarray, want: np.ndarray) -> float:
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= 1e-4 and float(np.abs(got - want).max()) <= 1e-4, err
    return err


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


# ---- parity ------------------------------------------------------------------------------------------------------
FORMATS = ["diffusers", "peft", "fal", "fal-down-up", "kohya"]


@pytest.mark.parametrize(("fmt", "mode"), [*((fmt, "merge") for fmt in FORMATS), ("diffusers", "graph"),
                                           ("fal", "graph"), ("kohya", "graph")])
def test_velocity_with_lora_matches_diffusers(fmt, mode, loras, reference):
    """Every format merged; added in the graph (mode-independent of the format but for fused QKV's rows, and the
    alpha scale): diffusers', fal's and kohya's."""
    x = velocity_inputs(reference.transformer.config)
    base = diffusers_velocity(reference.transformer, x)
    # diffusers reads a `diffusion_model.` file spelt lora_down/lora_up as kohya and loads nothing from it (no
    # `lora_unet_` keys): its reference is the same LoRA spelt lora_A/lora_B
    with adapted(reference, [loras["fal" if fmt == "fal-down-up" else fmt]], [0.7]) as ref:
        want = diffusers_velocity(ref.transformer, x)
    assert np.abs(want - base).max() / np.abs(want).max() > 0.01, "the LoRA changes nothing: a vacuous test"
    spec = LoraSpec(loras[fmt], 0.7, f"test {fmt}", mode)
    recipe = load_recipe(ROOT / "recipes" / "flux2-transformer.yaml")
    folder = CHECKPOINT / "transformer"
    model = build_model(recipe, checkpoint=Checkpoint.open(folder), config=json.loads((folder / "config.json")
                        .read_text()), loras=[spec])
    if mode == "graph":
        assert any(".lora0.down" in name for name in model.weights)
    else:
        assert not any(".lora" in name for name in model.weights)
    # the compiler's search over the low-rank adds once (diffusers' file in the graph)
    close(our_velocity(model, x, compile=(fmt, mode) == ("diffusers", "graph")), want)


@pytest.mark.parametrize("fmt", ["diffusers", "peft", "fal", "kohya"])
def test_image_with_lora_matches_diffusers(fmt, loras, reference):
    """Each format end to end. Merged LoRAs leave the graph as it was (only weights change), so the naive program
    is enough here; the compiled one is the plain pipeline's parity (test_flux2_parity.py)."""
    scale = 12.0 if fmt == "peft" else 0.8  # the PEFT file: the blocks only, at alpha / rank 1 (no metadata)
    ours = Pipeline(RECIPE, sets=SETS, loras=[(loras[fmt], scale)], compile=False)
    latents = initial_noise(3, 32, 48)
    got = to_uint8(ours.run({"prompt": "a fox", "init_latents": latents}).values["image"])

    def image() -> np.ndarray:
        out = reference(prompt="a fox", height=32, width=48, num_inference_steps=2, guidance_scale=4.0,
                        latents=torch.tensor(latents), max_sequence_length=32, output_type="np").images[0]
        return (out * 255).round().astype(np.uint8)

    with adapted(reference, [loras[fmt]], [scale]):
        want = image()
    plain = image()
    assert psnr(plain, want) < 30, "the LoRA barely changes the image: a vacuous test"
    print(f"{fmt}: PSNR {psnr(got, want):.1f} dB against diffusers (without the LoRA: {psnr(plain, want):.1f} dB)")
    assert psnr(got, want) >= 40.0


def test_two_loras_at_once_match_diffusers(loras, reference):
    x = velocity_inputs(reference.transformer.config)
    with adapted(reference, [loras["diffusers"], loras["kohya"]], [1.0, -0.5]) as ref:
        want = diffusers_velocity(ref.transformer, x)
    ours = Pipeline(RECIPE, loras=[(loras["diffusers"], 1.0), (loras["kohya"], -0.5)])
    close(our_velocity(ours.model("transformer"), x), want)


QUANTIZED = {"fp8": (dict(format="fp8", scale="per_tensor"), "f8e4m3"),
             "nvfp4": (dict(format="nvfp4", layout="modelopt"), "u8")}


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_lora_on_a_quantized_transformer_stays_packed_and_matches_diffusers(fmt, loras, tmp_path):
    """FP8 / NVFP4 weights with the LoRA added in the graph, against diffusers over the same weights
    dequantized; merging into a quantized weight is refused."""
    from luminal_recipes.recipe.schema import QuantizationSpec

    exclude = ["x_embedder", "context_embedder", "time_guidance_embed.*", "*stream_modulation*", "norm_out.*",
               "proj_out"]
    packed = tmp_path / fmt
    quantize_checkpoint(CHECKPOINT / "transformer", packed, fmt, "modelopt", exclude=exclude)
    dense = tmp_path / "dense"
    dense.mkdir()
    stored = Checkpoint.open(packed)
    out = {}
    for name in stored.names:
        owner = name.removesuffix(".weight")
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if f"{owner}.weight_scale" not in stored:
            out[name] = stored.load(name)
        elif fmt == "nvfp4":
            out[name] = dequantize_nvfp4(stored.load(name), stored.load(f"{owner}.weight_scale"),
                                         stored.load(f"{owner}.weight_scale_2"), "modelopt")
        else:
            out[name] = dequantize_fp8(stored.load(name), stored.load(f"{owner}.weight_scale"))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()},
              dense / "diffusion_pytorch_model.safetensors")
    (dense / "config.json").write_text((CHECKPOINT / "transformer" / "config.json").read_text())
    ref = Flux2Pipeline.from_pretrained(CHECKPOINT, transformer=Flux2Transformer2DModel.from_pretrained(dense))
    ref.load_lora_weights(str(loras["diffusers"].parent), weight_name=loras["diffusers"].name, adapter_name="a")
    ref.set_adapters(["a"], adapter_weights=[0.9])
    x = velocity_inputs(ref.transformer.config)
    want = diffusers_velocity(ref.transformer, x)
    recipe = load_recipe(ROOT / "recipes" / "flux2-transformer.yaml")
    spec, dtype = QUANTIZED[fmt]

    def build(mode: str):
        return build_model(recipe, checkpoint=Checkpoint.open(packed),
                           config=json.loads((packed / "config.json").read_text()),
                           quantization=QuantizationSpec(**spec, exclude=exclude),
                           loras=[LoraSpec(loras["diffusers"], 0.9, "test", mode)])

    model = build("auto")
    q = "transformer_blocks.0.attn.to_q"
    assert str(model.weights[f"{q}.weight"].dtype) == dtype and f"{q}.weight.lora0.down" in model.weights
    assert "x_embedder.weight.lora0.down" not in model.weights  # a dense weight: merged at load
    close(our_velocity(model, x), want)
    with pytest.raises(LoraError, match="mode merge cannot add .* stored quantized"):
        build("merge")
