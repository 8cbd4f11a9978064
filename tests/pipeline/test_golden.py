"""Golden images of the tiny FLUX.2 recipe: regenerated images match the committed PNGs, the goldens are not
constant, and each golden is itself close to what diffusers' Flux2Pipeline makes from the same latents."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import Flux2Pipeline

from luminal_recipes.image_io import read_png, write_png
from luminal_recipes.pipeline.golden import MIN_PSNR_DB, check, compare, is_near_constant, load_manifest, psnr
from luminal_recipes.tasks.flux2.latents import initial_noise

MANIFEST = Path(__file__).resolve().parents[1] / "golden" / "goldens.yaml"


def test_goldens_regenerate_within_threshold():
    results = check(MANIFEST)
    assert len(results) >= 3
    for r in results:
        assert r.ok, f"{r.case.file}: {r.message}"
        assert r.psnr >= MIN_PSNR_DB


def test_goldens_are_not_constant():
    _, cases = load_manifest(MANIFEST)
    for case in cases:
        pixels, _ = read_png(case.file)
        assert not is_near_constant(pixels), case.file


def test_goldens_match_diffusers():
    recipe, cases = load_manifest(MANIFEST)
    checkpoint = recipe.parent / "flux2-tiny" / "checkpoint"
    pipe = Flux2Pipeline.from_pretrained(checkpoint)
    for case in cases:
        p = dict({"guidance": 4.0}, **case.params)  # flux2-tiny.yaml's default guidance unless the case sets it
        latents = torch.tensor(initial_noise(p["seed"], p["height"], p["width"]))
        ref = pipe(prompt=case.prompt, height=p["height"], width=p["width"], num_inference_steps=p["steps"],
                   guidance_scale=p["guidance"], latents=latents, output_type="np").images[0]
        golden, _ = read_png(case.file)
        assert psnr(golden, (ref * 255).round().astype(np.uint8)) >= 40.0, case.file


@pytest.fixture
def tampered(tmp_path):
    """A copy of the manifest whose first golden was altered (and a constant-image check target)."""
    data = yaml.safe_load(MANIFEST.read_text())
    data["recipe"] = str((MANIFEST.parent / data["recipe"]).resolve())
    data["images"] = data["images"][:1]
    src = MANIFEST.parent / data["images"][0]["file"]
    shutil.copy(src, tmp_path / src.name)
    pixels, _ = read_png(src)
    noisy = np.clip(pixels.astype(np.int16) + np.random.default_rng(0).integers(-60, 60, pixels.shape), 0, 255)
    write_png(tmp_path / src.name, noisy.astype(np.uint8))
    manifest = tmp_path / "goldens.yaml"
    manifest.write_text(yaml.safe_dump(data))
    return manifest, tmp_path / src.name


def test_failing_golden_gets_a_diff_image(tampered):
    manifest, golden = tampered
    (result,) = check(manifest)
    assert not result.ok and result.psnr < MIN_PSNR_DB
    assert golden.with_suffix(".diff.png").exists()


def test_near_constant_images_are_rejected():
    flat = np.full((48, 80, 3), 128, np.uint8)
    flat[0, 0] = 130
    assert is_near_constant(flat)
    assert not is_near_constant(np.random.default_rng(0).integers(0, 255, (48, 80, 3)).astype(np.uint8))


def test_a_one_level_difference_passes_by_psnr(tmp_path):
    """Goldens compare by PSNR, not bytes: another program of the same graph may round one pixel differently."""
    _, cases = load_manifest(MANIFEST)
    case = cases[0]
    pixels, _ = read_png(case.file)
    moved = pixels.copy()
    moved[0, 0, 0] = moved[0, 0, 0] + 1 if moved[0, 0, 0] < 255 else 254
    result = compare(case, moved)
    assert result.ok and MIN_PSNR_DB < result.psnr < float("inf"), result.message
    assert compare(case, pixels).psnr == float("inf")
    far = np.clip(pixels.astype(np.int16) + 40, 0, 255).astype(np.uint8)
    copy = tmp_path / case.file.name
    shutil.copy(case.file, copy)
    failed = compare(type(case)(copy, case.prompt, case.params), far)
    assert not failed.ok and copy.with_suffix(".diff.png").exists()
