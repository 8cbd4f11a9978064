"""FLUX.2 editing with reference images (`--image`) against diffusers' Flux2Pipeline(image=...), on tiny checkpoints.

Stage by stage: the reference images fitted to the latent grid as Flux2ImageProcessor does (bit for bit, the
resize-to-area path included), the reference tokens' positions (time coordinate 10 + 10 i), the transformer over
noisy + reference tokens. End to end through `luminal-recipe run`'s own path (files read, parameters derived from
the images, plans, PNG written) with one and two references, the output size taken from the first reference.
The VAE encoder's own parity is in test_flux2_parity.py (five checkpoints). See tests/TOLERANCES.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.utils import load_image as diffusers_load_image
from PIL import Image

from luminal_recipes.errors import LuminalError
from luminal_recipes.image_io import fit_image, fitted_size, load_image
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.pipeline.generate import GenerateRequest, generate
from luminal_recipes.tasks.flux2.latents import initial_noise, latent_ids, reference_ids, text_ids
from luminal_recipes.tasks.flux2.steps import rope_tables

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
SEQ = 64


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def smooth_picture(width: int, height: int, seed: int) -> np.ndarray:
    """A smooth RGB picture with some noise (Lanczos resampling then has real work to do)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([np.sin(x / 7 + seed), np.cos(y / 5), np.sin((x + y) / 11)], -1) * 100 + 128
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    """Reference files: a PNG that is cropped (100x70 -> 96x64), a palette PNG with transparency (converted to RGB
    as load_image does), and a JPEG with an EXIF rotation (applied as load_image does)."""
    folder = tmp_path_factory.mktemp("refs")
    paths = {"crop": folder / "crop.png", "palette": folder / "palette.png", "rotated": folder / "rotated.jpg"}
    Image.fromarray(smooth_picture(100, 70, 1)).save(paths["crop"])
    palette = Image.fromarray(smooth_picture(72, 90, 2)).quantize(64)
    palette.info["transparency"] = 3
    palette.save(paths["palette"])
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise on display
    Image.fromarray(smooth_picture(80, 66, 3)).save(paths["rotated"], exif=exif, quality=95)
    return paths


@pytest.fixture(scope="module")
def reference() -> Flux2Pipeline:
    return Flux2Pipeline.from_pretrained(CHECKPOINT)


def diffusers_fit(image: Image.Image) -> torch.Tensor:
    """What Flux2Pipeline.__call__ does to one reference image before encoding it (diffusers 0.42, step 4)."""
    processor = Flux2ImageProcessor(vae_scale_factor=16)
    processor.check_image_input(image)
    width, height = image.size
    if width * height > 1024 * 1024:
        image = processor._resize_to_target_area(image, 1024 * 1024)
        width, height = image.size
    width, height = width // 16 * 16, height // 16 * 16
    return processor.preprocess(image, height=height, width=width, resize_mode="crop")


def test_images_are_read_and_fitted_bit_for_bit_as_diffusers_does(pictures, tmp_path):
    big = tmp_path / "big.png"  # above 1024 x 1024 pixels: resized (Lanczos) to about that area first
    Image.fromarray(smooth_picture(1400, 900, 4)).save(big)
    for path in [*pictures.values(), big]:
        ours = fit_image(load_image(path), 1024 * 1024, 16)
        want = diffusers_fit(diffusers_load_image(str(path))).numpy()
        assert ours.dtype == np.float32 and ours.shape == want.shape
        assert np.array_equal(ours, want), path.name
        assert fitted_size(*Image.open(path).size[::1], 1024 * 1024, 16) == (want.shape[3], want.shape[2]) or \
            path.name == "rotated.jpg"  # the EXIF rotation swaps the sides


def test_reference_positions_match_prepare_image_ids(reference):
    grids = [(3, 5), (4, 2), (1, 1)]
    latents = [torch.zeros(1, 128, h, w) for h, w in grids]
    want = reference._prepare_image_ids(latents)[0].numpy()
    assert np.array_equal(reference_ids(grids), want)


def test_transformer_with_reference_tokens_matches_diffusers(reference):
    cfg = reference.transformer.config
    rng = np.random.default_rng(5)
    (h, w), refs, t = (2, 3), [(3, 2), (2, 2)], 7
    noisy = rng.standard_normal((1, h * w, cfg.in_channels)).astype(np.float32)
    ref_tokens = rng.standard_normal((1, sum(a * b for a, b in refs), cfg.in_channels)).astype(np.float32)
    c = rng.standard_normal((1, t, cfg.joint_attention_dim)).astype(np.float32)
    img_ids = np.concatenate([latent_ids(h, w), reference_ids(refs)])
    rope = rope_tables(None, np.concatenate([text_ids(t), img_ids]).astype(np.float64), list(cfg.axes_dims_rope),
                       cfg.rope_theta)
    from luminal_recipes.pipeline.driver import Pipeline

    model = Pipeline(RECIPE).model("transformer")
    x = np.concatenate([noisy, ref_tokens], 1)
    got = ModelEngine(model)({"hidden_states": x, "encoder_hidden_states": c, "timestep": np.float32([0.6]),
                              "guidance": np.float32([4.0]), "rope_cos": rope["cos"], "rope_sin": rope["sin"]})
    with torch.no_grad():
        want = reference.transformer(hidden_states=torch.tensor(x), encoder_hidden_states=torch.tensor(c),
                                     timestep=torch.tensor([0.6]), guidance=torch.tensor([4.0]),
                                     img_ids=torch.tensor(img_ids).float(), txt_ids=torch.tensor(text_ids(t)).float(),
                                     return_dict=False)[0]
    assert rel_err(got["velocity"], want.numpy()) <= 1e-4
    assert float(np.abs(got["velocity"] - want.numpy()).max()) <= 1e-4


@pytest.mark.parametrize("names", [("crop",), ("palette", "rotated")], ids=["one-reference", "two-references"])
def test_editing_image_matches_diffusers(names, pictures, reference, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = [pictures[n] for n in names]
    first = diffusers_fit(diffusers_load_image(str(paths[0])))
    height, width = first.shape[2], first.shape[3]  # the output takes the first reference's size
    latents = initial_noise(7, height, width)
    np.save(tmp_path / "latents.npy", latents)
    out = tmp_path / "edit.png"
    summary = generate(GenerateRequest(RECIPE, ["make it a watercolor"], params={"steps": 2},
                                       files={"init_latents": tmp_path / "latents.npy", "images": paths},
                                       output=out, sets=[f"max_sequence_length={SEQ}"],
                                       compile=len(paths) == 1))  # the compiler's search once is enough
    assert summary["params"]["width"] == width and summary["params"]["height"] == height
    tokens = sum((s.shape[2] // 16) * (s.shape[3] // 16) for s in
                 (diffusers_fit(diffusers_load_image(str(p))) for p in paths))
    assert summary["params"]["reference_tokens"] == tokens
    plans = summary["memory"]["plans"]
    assert plans["transformer"]["dims"]["img"] == (height // 16) * (width // 16) + tokens
    got = np.asarray(Image.open(out).convert("RGB"))
    want = reference(image=[diffusers_load_image(str(p)) for p in paths], prompt="make it a watercolor",
                     num_inference_steps=2, guidance_scale=4.0, latents=torch.tensor(latents),
                     max_sequence_length=SEQ, output_type="np").images[0]
    want = (want * 255).round().astype(np.uint8)
    assert got.shape == want.shape == (height, width, 3)
    assert got.std() > 5
    print(f"{len(paths)} reference(s): PSNR {psnr(got, want):.1f} dB against diffusers")
    assert psnr(got, want) >= 40.0


def test_bad_references_are_refused_before_any_work(pictures, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not a picture")
    small = tmp_path / "small.png"
    Image.fromarray(smooth_picture(40, 80, 5)).save(small)
    thin = tmp_path / "thin.png"
    Image.fromarray(smooth_picture(600, 70, 6)).save(thin)
    cases = [
        ([junk], {}, "not an image Pillow can read"),
        ([tmp_path / "missing.png"], {}, "file not found"),
        ([small], {}, "at least 64 pixels a side"),
        ([thin], {}, "aspect ratio of 8.6:1"),
        ([pictures["crop"]] * 3, {"sets": ["max_images=2"]}, "at most 2 reference images"),
        ([pictures["crop"]], {"sets": ["reference_tokens=3"]}, "follows from the reference images"),
    ]
    for images, extra, message in cases:
        req = GenerateRequest(RECIPE, ["x"], files={"images": images}, sets=extra.get("sets", []))
        with pytest.raises(LuminalError, match=message):
            generate(req)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("case", ["unreadable", "over-budget"])
def test_run_refuses_a_bad_reference_with_exit_2_and_writes_nothing(case, tmp_path, monkeypatch):
    """Through the command line: the file and the fix named, no traceback, no PNG. A reference too large for
    --max-memory is refused while planning, naming the stage and the parameter the image set."""
    from typer.testing import CliRunner

    from luminal_recipes.cli import app

    monkeypatch.chdir(tmp_path)
    picture = tmp_path / "ref.png"
    if case == "unreadable":
        picture.write_bytes(b"\x89PNG\r\n\x1a\n but not a picture")
        extra, message = [], "--image ref.png"
    else:
        Image.fromarray(smooth_picture(512, 512, 7)).save(picture)
        extra, message = ["--max-memory", "48MiB", "--no-compile", "--width", "64", "--height", "64"], \
            "stage 'vae_encoder' needs at least"
    result = CliRunner().invoke(app, ["run", str(RECIPE), "--prompt", "x", "--image", "ref.png", "--output",
                                      "edit.png", "--set", f"max_sequence_length={SEQ}", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output, result.output
    assert case == "unreadable" or "reference_height = 512 from --image" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.png"]
