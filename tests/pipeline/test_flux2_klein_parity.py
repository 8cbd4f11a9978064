"""FLUX.2 [klein] parity with diffusers' Flux2KleinPipeline, stage by stage and end to end, on tiny checkpoints.

Two checkpoints saved by diffusers/transformers from seeded random initialisation
(recipes/flux2-klein-tiny/make_checkpoint.py): the shipped step-distilled one (model_index.json `is_distilled:
true`: diffusers ignores the guidance scale) and a Base one built here (`is_distilled: false`: diffusers runs
classifier-free guidance with the empty negative prompt). The Base one taps the last hidden state (after the final
norm), slides a 16-token window from layer 3 on (no query of the 32-token prompts loses every key to the
window and the padding: tests/TOLERANCES.md) and unties its embeddings; its transformer has 2 double blocks, RoPE
theta 1000 and MLP ratio 2. Errors are relative to the reference's largest magnitude and absolute (both <= 1e-4,
tests/TOLERANCES.md); images within 40 dB PSNR. Editing (`--image`, one and two reference images) goes through
`luminal-recipe run`'s own path against Flux2KleinPipeline(image=...), guided (Base) and not (distilled).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_files import files
from diffusers import Flux2KleinPipeline
from diffusers.utils import load_image as diffusers_load_image
from PIL import Image

from luminal_recipes.image_io import to_uint8
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.pipeline.generate import GenerateRequest, generate
from luminal_recipes.tasks.flux2.latents import (
    denormalize_latents,
    initial_noise,
    latent_ids,
    load_vae_batch_norm,
    text_ids,
    unpatchify_latents,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-klein-tiny.yaml"
DISTILLED = ROOT / "recipes" / "flux2-klein-tiny" / "checkpoint"
MAX_SEQ = 32
PROMPT = "a red fox in the snow"


def close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4
    assert float(np.abs(got - want).max()) <= 1e-4


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def maker():
    path = DISTILLED.parent / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("flux2_klein_make_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module", params=["distilled", "base"])
def case(request, maker, tmp_path_factory):
    name = request.param
    folder = DISTILLED if name == "distilled" else maker.build(tmp_path_factory.mktemp("klein") / name, name)
    layers = maker.VARIANTS[name].text_encoder_out_layers
    ref = Flux2KleinPipeline.from_pretrained(folder)
    assert ref.config.is_distilled is (name == "distilled")
    return name, folder, layers, ref


def pipeline(folder: Path, layers, **sets) -> Pipeline:
    values = {"text_encoder_out_layers": f"[{','.join(map(str, layers))}]", "max_sequence_length": MAX_SEQ,
              "width": 48, "height": 32, "steps": 2, "seed": 3, **sets}
    return Pipeline(RECIPE, weights=folder, sets=[f"{k}={v}" for k, v in values.items()])


@pytest.mark.parametrize("prompt", [PROMPT, ""])
def test_text_features_match_encode_prompt(case, prompt):
    """The prompt, and the empty negative prompt of classifier-free guidance."""
    from luminal_recipes.tasks.flux2.steps import tokenizer

    name, folder, layers, ref = case
    ours = pipeline(folder, layers)
    tok = tokenizer(ours.context)(prompt, MAX_SEQ, allow_empty=True)
    got = ModelEngine(ours.model("text_encoder"))({"tokens": tok.input_ids, "attention_mask": tok.attention_mask})
    with torch.no_grad():
        want, _ = ref.encode_prompt(prompt, max_sequence_length=MAX_SEQ, text_encoder_out_layers=layers)
    close(got["prompt_embeds"], want.numpy())


def test_transformer_velocity_matches_diffusers_without_guidance_embedding(case):
    name, folder, layers, ref = case
    cfg = ref.transformer.config
    assert cfg.guidance_embeds is False
    rng = np.random.default_rng(1)
    h, w, t = 2, 3, 7
    x = rng.standard_normal((2, h * w, cfg.in_channels)).astype(np.float32)
    c = rng.standard_normal((2, t, cfg.joint_attention_dim)).astype(np.float32)
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    from luminal_recipes.tasks.flux2.steps import rope_tables

    rope = rope_tables(None, ids, list(cfg.axes_dims_rope), cfg.rope_theta)
    timestep = np.float32([0.61, 0.61])
    engine = ModelEngine(pipeline(folder, layers).model("transformer"))
    got = engine({"hidden_states": x, "encoder_hidden_states": c, "timestep": timestep,
                  "rope_cos": rope["cos"], "rope_sin": rope["sin"]})["velocity"]  # no guidance: none is read
    with torch.no_grad():
        want = ref.transformer(hidden_states=torch.tensor(x), encoder_hidden_states=torch.tensor(c),
                               timestep=torch.tensor(timestep), guidance=None,
                               img_ids=torch.tensor(latent_ids(h, w)).float(),
                               txt_ids=torch.tensor(text_ids(t)).float(), return_dict=False)[0]
    close(got, want.numpy())


def reference(ref, latents, guidance: float, layers, output_type: str) -> np.ndarray:
    return ref(prompt=PROMPT, height=32, width=48, num_inference_steps=2, guidance_scale=guidance,
               latents=torch.tensor(latents), max_sequence_length=MAX_SEQ, text_encoder_out_layers=layers,
               output_type=output_type).images


def vae_latents(folder: Path, grid: np.ndarray) -> np.ndarray:
    """Our denoised latents as diffusers' output_type="latent" gives them: de-normalised and unpatchified."""
    mean, var, eps = load_vae_batch_norm(folder / "vae")
    return unpatchify_latents(denormalize_latents(grid, mean, var, eps))


RUNS: dict[tuple, object] = {}  # (checkpoint, guidance, cfg_batch) -> our run's report, shared by the tests


def run_ours(case, guidance: float, cfg_batch: int = 2):
    name, folder, layers, ref = case
    key = (name, guidance, cfg_batch)
    if key not in RUNS:
        ours = pipeline(folder, layers, guidance=guidance, cfg_batch=cfg_batch)
        RUNS[key] = ours.run({"prompt": PROMPT, "init_latents": initial_noise(3, 32, 48)})
    return RUNS[key]


@pytest.mark.parametrize("guidance, cfg_batch", [(4.0, 2), (4.0, 1), (1.0, 2)])
def test_whole_pipeline_matches_diffusers(case, guidance, cfg_batch, caplog):
    """Base checkpoints run classifier-free guidance when guidance > 1 (batched or in two calls); distilled ones
    and guidance 1 do not, exactly as Flux2KleinPipeline decides. The denoised latents agree within 1e-4 and the
    image within 40 dB."""
    name, folder, layers, ref = case
    if name == "distilled" and (cfg_batch, guidance) != (2, 4.0):
        pytest.skip("a distilled checkpoint ignores guidance and cfg_batch (test_guidance_changes_a_base_image)")
    latents = initial_noise(3, 32, 48)
    report = run_ours(case, guidance, cfg_batch)
    got = to_uint8(report.values["image"])
    assert got.std() > 5, "the image is (nearly) constant"
    guided = name == "base" and guidance > 1
    assert ("negative_text_encoder" in report.stage_seconds) is guided
    assert ("negative_prompt_embeds" in report.values) is guided
    with caplog.at_level(logging.WARNING):  # diffusers warns that a distilled checkpoint ignores guidance
        close(vae_latents(folder, report.values["grid"]), reference(ref, latents, guidance, layers, "latent").numpy())
        want = (reference(ref, latents, guidance, layers, "np")[0] * 255).round().astype(np.uint8)
    assert got.shape == want.shape == (32, 48, 3)
    assert psnr(got, want) >= 40.0


def test_guidance_changes_a_base_image(case):
    """Guided and unguided Base latents differ far beyond the parity tolerance, so the parity above checks the
    guidance (a distilled checkpoint's do not differ at all)."""
    name, folder, layers, ref = case
    grids = [run_ours(case, g).values["grid"] for g in (1.0, 4.0)]
    change = float(np.abs(grids[1] - grids[0]).max() / np.abs(grids[0]).max())
    assert change > 1e-2 if name == "base" else change == 0.0


def test_memory_plan_covers_the_stages_that_run(case):
    """A Base checkpoint plans the transformer at batch 2 (one guided call), a distilled one at batch 1."""
    from luminal_recipes.pipeline.plan import plan_stages

    name, folder, layers, ref = case
    plans = plan_stages(pipeline(folder, layers, guidance=4.0), compile=False, from_checkpoint=True)
    batches = {p.stage: p.dims["batch"] for p in plans if p.model == "transformer"}
    assert batches == ({"transformer_paired": 2} if name == "base" else {"transformer": 1})


def test_committed_checkpoint_is_what_the_script_writes(maker, tmp_path):
    assert files(maker.build(tmp_path / "distilled", "distilled")) == files(DISTILLED)


def picture(path: Path, width: int, height: int, seed: int) -> Path:
    """A smooth RGB picture with some noise, saved as a PNG."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([np.sin(x / 7 + seed), np.cos(y / 5), np.sin((x + y) / 11)], -1) * 100 + 128
    Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)).save(path)
    return path


@pytest.mark.parametrize("sizes", [[(100, 70)], [(72, 90), (80, 66)]], ids=["one-reference", "two-references"])
def test_editing_matches_diffusers(case, sizes, tmp_path, monkeypatch):
    """Reference images (cropped to the 16-pixel grid; the output takes the first one's size) appended to every
    transformer call, the guided Base one of batch 2 included; the image within 40 dB of Flux2KleinPipeline's."""
    name, folder, layers, ref = case
    monkeypatch.chdir(tmp_path)
    paths = [picture(tmp_path / f"ref{k}.png", w, h, k + 1) for k, (w, h) in enumerate(sizes)]
    width, height = sizes[0][0] // 16 * 16, sizes[0][1] // 16 * 16
    latents = initial_noise(5, height, width)
    np.save(tmp_path / "latents.npy", latents)
    out = tmp_path / "edit.png"
    sets = [f"text_encoder_out_layers=[{','.join(map(str, layers))}]", f"max_sequence_length={MAX_SEQ}"]
    summary = generate(GenerateRequest(RECIPE, [PROMPT], params={"steps": 2, "guidance": 4.0}, weights=folder,
                                       files={"init_latents": tmp_path / "latents.npy", "images": paths},
                                       output=out, sets=sets, compile=False))
    tokens = sum((w // 16) * (h // 16) for w, h in sizes)
    assert summary["params"]["reference_tokens"] == tokens
    stage = "transformer_paired" if name == "base" else "transformer"
    assert summary["memory"]["plans"]["transformer"]["dims"] == {
        "batch": 2 if name == "base" else 1, "img": (height // 16) * (width // 16) + tokens, "txt": MAX_SEQ}, stage
    got = np.asarray(Image.open(out).convert("RGB"))
    want = ref(image=[diffusers_load_image(str(p)) for p in paths], prompt=PROMPT, num_inference_steps=2,
               guidance_scale=4.0, latents=torch.tensor(latents), max_sequence_length=MAX_SEQ,
               text_encoder_out_layers=layers, output_type="np").images[0]
    want = (want * 255).round().astype(np.uint8)
    assert got.shape == want.shape == (height, width, 3)
    assert got.std() > 5
    print(f"{name}, {len(paths)} reference(s): PSNR {psnr(got, want):.1f} dB against diffusers")
    assert psnr(got, want) >= 40.0
