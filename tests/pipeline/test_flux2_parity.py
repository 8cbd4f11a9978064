"""FLUX.2 parity with diffusers, stage by stage and end to end, on two tiny configurations.

The references are diffusers' own ``Flux2Pipeline`` and models loaded from the same checkpoint folders (saved by
diffusers/transformers from seeded random initialisation, recipes/flux2-tiny/make_checkpoint.py). Errors are
relative to the reference's largest magnitude (see tests/TOLERANCES.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline

from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.pipeline.image_io import to_uint8
from luminal_recipes.pipeline.latents import initial_noise, latent_ids, text_ids

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
CHECKPOINT_A = ROOT / "recipes" / "flux2-tiny" / "checkpoint"


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_checkpoint", CHECKPOINT_A.parent / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        return module.build(tmp_path_factory.mktemp("flux2") / "b", "b", tokenizer_from=CHECKPOINT_A)
    finally:
        del sys.modules[spec.name]


# (checkpoint, text_encoder_out_layers, seed, width, height)
CONFIGS = {
    "a": (None, (10, 20, 30), 0, 80, 48),
    "b": ("b", (2, 5, 8), 3, 48, 64),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, checkpoint_b):
    which, layers, seed, width, height = CONFIGS[request.param]
    folder = CHECKPOINT_A if which is None else checkpoint_b
    sets = [f"text_encoder_out_layers=[{','.join(map(str, layers))}]", f"seed={seed}", f"width={width}",
            f"height={height}", "steps=3", "max_sequence_length=64"]
    ours = Pipeline(RECIPE, weights=folder, sets=sets)
    ref = Flux2Pipeline.from_pretrained(folder)
    return ours, ref, layers, seed, width, height


def test_text_features_match_encode_prompt(case):
    ours, ref, layers, *_ = case
    prompt = "a lighthouse on a cliff at dusk, oil painting"
    tok = ours.context.tokenizer(prompt, 64)
    engine = ModelEngine(ours.model("text_encoder"))
    got = engine({"tokens": tok.input_ids, "attention_mask": tok.attention_mask})["prompt_embeds"]
    with torch.no_grad():
        want, _ = ref.encode_prompt(prompt, max_sequence_length=64, text_encoder_out_layers=layers)
    assert got.shape == tuple(want.shape)
    assert rel_err(got, want.numpy()) <= 1e-4


def test_transformer_velocity_matches_diffusers(case):
    ours, ref, *_ = case
    cfg = ref.transformer.config
    rng = np.random.default_rng(1)
    h, w, t = 3, 4, 9
    x = rng.standard_normal((1, h * w, cfg.in_channels)).astype(np.float32)
    c = rng.standard_normal((1, t, cfg.joint_attention_dim)).astype(np.float32)
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    from luminal_recipes.pipeline.steps import rope_tables

    rope = rope_tables(None, ids, list(cfg.axes_dims_rope), cfg.rope_theta)
    timestep, guidance = np.float32([0.73]), np.float32([4.0])
    engine = ModelEngine(ours.model("transformer"))
    got = engine({"hidden_states": x, "encoder_hidden_states": c, "timestep": timestep, "guidance": guidance,
                  "rope_cos": rope["cos"], "rope_sin": rope["sin"]})["velocity"]
    with torch.no_grad():
        want = ref.transformer(hidden_states=torch.tensor(x), encoder_hidden_states=torch.tensor(c),
                               timestep=torch.tensor(timestep), guidance=torch.tensor(guidance),
                               img_ids=torch.tensor(latent_ids(h, w)).float(),
                               txt_ids=torch.tensor(text_ids(t)).float(), return_dict=False)[0]
    assert rel_err(got, want.numpy()) <= 1e-4


def test_vae_decode_matches_diffusers(case):
    ours, ref, *_ = case
    rng = np.random.default_rng(2)
    latents = rng.standard_normal((1, 128, 3, 5)).astype(np.float32)
    engine = ModelEngine(ours.model("vae"))
    got = engine({"latents": latents})["image"]
    vae = ref.vae
    with torch.no_grad():
        lat = torch.tensor(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        want = vae.decode(Flux2Pipeline._unpatchify_latents(lat * std + mean), return_dict=False)[0]
    assert rel_err(got, want.numpy()) <= 1e-4


def test_whole_pipeline_image_matches_diffusers(case):
    ours, ref, layers, seed, width, height = case
    prompt = "a red fox in the snow"
    latents = initial_noise(seed, height, width)
    image = ours.run({"prompt": prompt, "init_latents": latents}).values["image"]
    got = to_uint8(image)
    assert got.std() > 5, "the image is (nearly) constant"
    want = ref(prompt=prompt, height=height, width=width, num_inference_steps=3, guidance_scale=4.0,
               latents=torch.tensor(latents), max_sequence_length=64, text_encoder_out_layers=layers,
               output_type="np").images[0]
    want = (want * 255).round().astype(np.uint8)
    assert got.shape == want.shape == (height, width, 3)
    assert psnr(got, want) >= 40.0
