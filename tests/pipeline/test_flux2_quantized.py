"""FLUX.2 quantized variants (recipes/flux2-fp8.yaml, flux2-nvfp4.yaml, flux2-nvfp4-bfl.yaml), tiny.

Each variant's transformer is made from the tiny f32 one by the quantize tool (for the BFL layout, first
renamed to Black Forest Labs' tensor names with packed QKV by inverting diffusers' own conversion). Checks:

* the transformer's velocity equals that of the unquantized recipe over the same checkpoint dequantized in
  numpy (weights.formats): loading, splitting and dequantizing in the graph lose nothing beyond the format.
  The image alone could not show that: on this random-weight model a text prompt barely moves the image
  (PSNR 60 dB between two prompts), and comfy block scales applied to the wrong rows of the packed QKV leave
  it within 0.2 dB;
* the pipeline at 80x48, 3 steps, fixed latents: the image against the f32 recipe's image. Measured on this
  checkpoint: FP8 64.6 dB, NVFP4 ModelOpt 57.8 dB, NVFP4 BFL/comfy 57.9 dB; a wrong transformer (rows
  permuted) gives 17 dB, a zero velocity 19 dB. The floors keep about 8 dB of margin;
* a checkpoint in the other NVFP4 layout is refused.

Runs use the naive primitive program (compile=False): a cold compiler search over the dequantized graphs
takes minutes, and what is checked here is the weights path, not the compiler.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flux2_bfl import to_bfl
from safetensors.numpy import load_file, save_file

from luminal_recipes.errors import CheckpointError, QuantizationError
from luminal_recipes.image_io import to_uint8
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.recipe.builder import build
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.tasks.flux2.latents import initial_noise, latent_ids, text_ids
from luminal_recipes.tasks.flux2.steps import rope_tables
from luminal_recipes.weights.formats import dequantize_fp8, dequantize_nvfp4
from luminal_recipes.weights.quantize import quantize_checkpoint
from luminal_recipes.weights.safetensors_io import Checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CHECKPOINT = RECIPES / "flux2-tiny" / "checkpoint"
SETS = ["steps=3", "width=80", "height=48", "seed=0", "max_sequence_length=64"]
PROMPT = "a red fox in the snow"

# variant -> (pipeline recipe, PSNR floor in dB against the f32 image)
VARIANTS = {
    "fp8": ("flux2-fp8.yaml", 56.0),
    "nvfp4": ("flux2-nvfp4.yaml", 50.0),
    "nvfp4-bfl": ("flux2-nvfp4-bfl.yaml", 50.0),
}

# What black-forest-labs/FLUX.2-dev-NVFP4 keeps in BF16, in its own names (see recipes/flux2-nvfp4-bfl.yaml)
BFL_DENSE = [
    "img_in",
    "txt_in",
    "time_in.*",
    "guidance_in.*",
    "*modulation*",
    "final_layer.*",
    "double_blocks.*.txt_attn.*",
]



def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def with_transformer(folder: Path, transformer: Path) -> Path:
    """A pipeline checkpoint folder: the tiny checkpoint's components with ``transformer`` as transformer/."""
    folder.mkdir()
    for item in CHECKPOINT.iterdir():
        if item.name != "transformer":
            (folder / item.name).symlink_to(item)
    (folder / "transformer").symlink_to(transformer)
    return folder


def run_image(recipe: str, weights: Path) -> np.ndarray:
    pipeline = Pipeline(RECIPES / recipe, weights=weights, sets=SETS, compile=False)
    image = pipeline.run({"prompt": PROMPT, "init_latents": initial_noise(0, 48, 80)}).values["image"]
    return to_uint8(image)


def modelopt_exclude(recipe: str) -> list[str]:
    """A variant's transformer exclude list (diffusers names): the quantize tool gets the recipe's own."""
    return load_recipe(RECIPES / recipe).doc.models["transformer"].quantization.exclude


@pytest.fixture(scope="module")
def bfl_f32(tmp_path_factory) -> Path:
    """The tiny f32 transformer in BFL's names (as black-forest-labs/FLUX.2-dev's flux2-dev.safetensors)."""
    folder = tmp_path_factory.mktemp("bfl-f32")
    state = load_file(CHECKPOINT / "transformer" / "diffusion_pytorch_model.safetensors")
    save_file(to_bfl(state), folder / "flux2-dev.safetensors")
    (folder / "config.json").write_bytes((CHECKPOINT / "transformer" / "config.json").read_bytes())
    return folder


@pytest.fixture(scope="module")
def transformers(tmp_path_factory, bfl_f32) -> dict[str, Path]:
    """Quantized transformer folders made by the quantize tool: one per variant, and the wrong layouts."""
    out = tmp_path_factory.mktemp("quantized")
    src = CHECKPOINT / "transformer"
    exclude = modelopt_exclude("flux2-nvfp4.yaml")
    made = {
        "fp8": quantize_checkpoint(src, out / "fp8", "fp8", exclude=modelopt_exclude("flux2-fp8.yaml")),
        "nvfp4": quantize_checkpoint(src, out / "nvfp4", "nvfp4", "modelopt", exclude=exclude),
        "nvfp4-bfl": quantize_checkpoint(bfl_f32, out / "nvfp4-bfl", "nvfp4", "comfy", exclude=BFL_DENSE),
        "comfy-diffusers": quantize_checkpoint(
            src, out / "comfy-diffusers", "nvfp4", "comfy", exclude=exclude
        ),
        "modelopt-bfl": quantize_checkpoint(
            bfl_f32, out / "modelopt-bfl", "nvfp4", "modelopt", exclude=BFL_DENSE
        ),
    }
    # BFL's file quantizes the packed image QKV as one tensor: the recipe must split it with its scales
    assert "double_blocks.0.img_attn.qkv" in made["nvfp4-bfl"].quantized
    assert "double_blocks.0.txt_attn.qkv.weight" in made["nvfp4-bfl"].kept
    return {name: summary.dst for name, summary in made.items()}


@pytest.fixture(scope="module")
def reference_image() -> np.ndarray:
    return run_image("flux2-tiny.yaml", CHECKPOINT)


def velocity(model) -> np.ndarray:
    """The transformer's velocity on fixed random inputs (3x5 latent tokens, 7 text tokens)."""
    rng = np.random.default_rng(1)
    h, w, t = 3, 5, 7
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, [4, 4, 4, 4], 2000)
    inputs = {
        "hidden_states": rng.standard_normal((1, h * w, 128)).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal((1, t, 48)).astype(np.float32),
        "timestep": np.float32([0.6]),
        "guidance": np.float32([4.0]),
        "rope_cos": rope["cos"],
        "rope_sin": rope["sin"],
    }
    return ModelEngine(model, compile=False)(inputs)["velocity"]


def dequantized(folder: Path, layout: str, out: Path) -> Path:
    """The quantized checkpoint ``folder`` dequantized to f32 in numpy, same tensor names."""
    checkpoint = Checkpoint.open(folder)  # safetensors.numpy cannot read F8_E4M3
    state = {name: checkpoint.load(name) for name in checkpoint.names}
    dense = {}
    for name, value in state.items():
        owner = name.removesuffix(".weight")
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if f"{owner}.weight_scale" not in state:
            dense[name] = value
        elif value.dtype == np.uint8:
            dense[name] = dequantize_nvfp4(
                value, state[f"{owner}.weight_scale"], state[f"{owner}.weight_scale_2"], layout
            )
        else:
            dense[name] = dequantize_fp8(value, state[f"{owner}.weight_scale"])
    out.mkdir()
    save_file(dense, out / "model.safetensors")
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    return out


def test_bfl_names_map_onto_the_diffusers_transformer(bfl_f32):
    """Unquantized, the BFL recipe over BFL names computes exactly what the diffusers recipe computes (QKV
    split, final norm halves in BFL's order)."""
    ours = build(RECIPES / "flux2-transformer-bfl.yaml", weights=bfl_f32)
    ref = build(RECIPES / "flux2-transformer.yaml", weights=CHECKPOINT / "transformer")
    np.testing.assert_array_equal(velocity(ours), velocity(ref))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_transformer_is_its_dequantized_weights(variant, transformers, tmp_path):
    recipe, _ = VARIANTS[variant]
    pipeline = Pipeline(RECIPES / recipe, weights=with_transformer(tmp_path / "ckpt", transformers[variant]))
    model = pipeline.model("transformer")
    quant = pipeline.doc.models["transformer"].quantization
    packed = {name for name, b in model.weights.items() if str(b.dtype) in ("u8", "f8e4m3")}
    assert "transformer_blocks.0.attn.to_q.weight" in packed  # the quantized path is what is compared
    reference = build(
        RECIPES / pipeline.doc.models["transformer"].recipe,
        weights=dequantized(transformers[variant], quant.layout or "modelopt", tmp_path / "dense"),
    )
    got, want = velocity(model), velocity(reference)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"{variant}: velocity relative error vs numpy-dequantized weights {error:.2e}")
    assert error <= 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_image_close_to_f32(variant, transformers, reference_image, tmp_path):
    recipe, floor = VARIANTS[variant]
    image = run_image(recipe, with_transformer(tmp_path / "ckpt", transformers[variant]))
    assert image.shape == reference_image.shape == (48, 80, 3)
    assert image.std() > 5, f"{variant}: the image is (nearly) constant"
    value = psnr(image, reference_image)
    print(f"{variant}: PSNR {value:.2f} dB vs the f32 image")
    assert value >= floor, f"{variant}: PSNR {value:.2f} dB < {floor} dB against the f32 recipe's image"


@pytest.mark.parametrize(
    ("recipe", "stored"),
    [("flux2-nvfp4.yaml", "comfy-diffusers"), ("flux2-nvfp4-bfl.yaml", "modelopt-bfl")],
)
def test_wrong_nvfp4_layout_fails_loudly(recipe, stored, transformers, tmp_path):
    """A checkpoint in the other NVFP4 layout is refused: the run raises, never returns an image."""
    weights = with_transformer(tmp_path / "ckpt", transformers[stored])
    pipeline = Pipeline(RECIPES / recipe, weights=weights, sets=SETS, compile=False)
    with pytest.raises((CheckpointError, QuantizationError)) as error:
        pipeline.run({"prompt": PROMPT, "init_latents": initial_noise(0, 48, 80)})
    assert "layout" in str(error.value)
