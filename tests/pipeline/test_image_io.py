"""PNG output: diffusers' post-processing, atomic writes (never replacing a file unless asked), metadata and
default names."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from PIL import Image

from luminal_recipes import __version__, image_io
from luminal_recipes.errors import PipelineError
from luminal_recipes.pipeline.atomic_file import OutputExistsError
from luminal_recipes.pipeline.outputs import numbered, output_stem, run_text
from luminal_recipes.tasks.flux2 import describe


def vae_like_output(height=24, width=40, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    image = rng.uniform(-1.3, 1.3, (1, 3, height, width)).astype(np.float32)
    # Values that land exactly on .5 after scaling to 0..255, to pin down the rounding rule.
    halves = (np.arange(0, 255, dtype=np.float32) + np.float32(0.5)) / np.float32(255) * 2 - 1
    image.reshape(-1)[: halves.size] = halves
    return image


def test_postprocess_matches_diffusers():
    image = vae_like_output()
    processor = Flux2ImageProcessor(vae_scale_factor=16)
    as_np = processor.postprocess(torch.from_numpy(image), output_type="np")
    as_pil = processor.postprocess(torch.from_numpy(image), output_type="pil")[0]
    np.testing.assert_array_equal(image_io.to_unit_range(image), as_np[0])
    np.testing.assert_array_equal(image_io.to_uint8(image), np.asarray(as_pil))
    np.testing.assert_array_equal(image_io.to_uint8(image[0]), np.asarray(as_pil))


def test_round_trip_with_metadata(tmp_path):
    image = vae_like_output()
    settings = describe({"seed": 7, "steps": 4, "guidance": 2.5, "width": 40, "height": 24}, {})
    text = run_text("ein Fuchs 🦊 im Schnee", "flux2-tiny", "abc123", settings)
    path = image_io.save_image(tmp_path / "sub" / "dir" / "out.png", image, text)
    pixels, chunks = image_io.read_png(path)
    np.testing.assert_array_equal(pixels, image_io.to_uint8(image))
    assert chunks == text
    assert chunks["prompt"] == "ein Fuchs 🦊 im Schnee" and chunks["size"] == "40x24"
    assert chunks["version"] == __version__ and chunks["guidance"] == "2.5" and chunks["seed"] == "7"
    with Image.open(path) as png:
        assert png.format == "PNG" and png.mode == "RGB" and png.size == (40, 24)
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.png"]


def test_overwrite_is_atomic_and_failures_leave_nothing(tmp_path, monkeypatch):
    path = tmp_path / "out.png"
    image_io.save_image(path, vae_like_output(seed=1))
    before = path.read_bytes()

    def broken_save(self, fp, *args, **kwargs):
        fp.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", broken_save)
    with pytest.raises(PipelineError, match=r"out\.png: cannot write the image \(No space left on device\)"):
        image_io.save_image(path, vae_like_output(seed=2))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]
    with pytest.raises(PipelineError, match="new.png"):
        image_io.save_image(tmp_path / "new.png", vae_like_output(seed=2))
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]


def test_without_overwrite_an_existing_file_is_kept(tmp_path):
    path = tmp_path / "out.png"
    image_io.save_image(path, vae_like_output(seed=1))
    before = path.read_bytes()
    with pytest.raises(OutputExistsError, match=r"out\.png exists; pass --overwrite"):
        image_io.save_image(path, vae_like_output(seed=2), overwrite=False)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out.png"]
    image_io.save_image(tmp_path / "new.png", vae_like_output(seed=2), overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.png", "out.png"]


def test_unwritable_paths(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(PipelineError, match=r"a-file/x\.png: cannot write the image"):
        image_io.save_image(blocker / "x.png", vae_like_output())
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(PipelineError, match="is a folder"):
        image_io.save_image(tmp_path / "folder.png", vae_like_output())
    with pytest.raises(PipelineError, match="must end with .png"):
        image_io.save_image(tmp_path / "out.jpg", vae_like_output())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "folder.png"]


@pytest.mark.parametrize(
    ("prompt", "slug"),
    [
        ("A Cat, in a Hat!", "a-cat-in-a-hat"),
        ("  Crème brûlée — à la carte  ", "creme-brulee-a-la-carte"),
        ("🦊🦊", ""),
        ("x" * 60, "x" * 48),
        (
            "a very long prompt about a fluffy purple cat sitting on a windowsill at dawn",
            "a-very-long-prompt-about-a-fluffy-purple-cat",
        ),
    ],
)
def test_slugify(prompt, slug):
    assert image_io.slugify(prompt) == slug


def test_default_output_names():
    assert output_stem("flux2-tiny", 42, "A Cat, in a Hat!") == "flux2-tiny-42-a-cat-in-a-hat"
    assert output_stem("flux2", 0, "🦊") == "flux2-0-prompt"
    assert output_stem("embed", None, "a fox", "prompt_embeds") == "embed-a-fox-prompt-embeds"
    assert output_stem("noise", None, None) == "noise"
    assert str(numbered(Path("outputs"), "flux2-0-a-fox", ".png", 1)) == "outputs/flux2-0-a-fox_00001_.png"
    assert numbered(Path("o"), "x", ".npy", 123456).name == "x_123456_.npy"
