"""The Python API over a pipeline (``luminal_recipes.Pipeline``, docs/python-api.md) against the CLI it shares its
path with: the same pixels for the same seed (byte for byte, read back from the CLI's PNG), batches of seeds as
``--num-images`` makes them, the provenance text chunks (A1111's ``parameters`` in A1111's format), a second call
that builds, compiles and loads nothing (``instrument`` counts), the denoising callback, reference images given
as PIL images or paths alike, and located errors for bad arguments.

Runs the naive programs (``compile=False``) of the tiny FLUX.2 checkpoint at 32x32, 2 steps, 64 text tokens."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from luminal_recipes import Pipeline, instrument
from luminal_recipes.cli import app
from luminal_recipes.errors import InputError, LuminalError, PipelineError
from luminal_recipes.image_io import read_png

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "flux2-tiny.yaml"
SIZE = {"steps": 2, "width": 32, "height": 32}
PROMPT = "a red fox"


@pytest.fixture(scope="module")
def pipe():
    p = Pipeline.from_recipe(TINY, compile=False, sets=["max_sequence_length=64"])
    yield p
    p.release()


@pytest.fixture(scope="module")
def batch(pipe):
    """Two images of one prompt, seeds 11 and 12, with the denoising callback's calls."""
    calls = []
    out = pipe(PROMPT, num_images=2, seed=11, callback=lambda step, total, latents: calls.append(
        (step, total, np.asarray(latents).shape)), **SIZE)
    return out, calls


def cli_images(tmp_path: Path, *args: str) -> list[tuple[np.ndarray, dict]]:
    result = CliRunner().invoke(app, ["run", str(TINY), "--no-compile", "--set", "max_sequence_length=64",
                                      "--steps", "2", "--width", "32", "--height", "32", "-p", PROMPT, *args])
    assert result.exit_code == 0, result.output
    return [read_png(p) for p in sorted((tmp_path / "outputs").glob("*.png"))]


def test_images_are_the_clis_for_the_same_seeds(pipe, batch, tmp_path, monkeypatch):
    out, _ = batch
    assert out.seeds == [11, 12] and out.prompts == [PROMPT, PROMPT]
    assert all(isinstance(im, Image.Image) and im.mode == "RGB" and im.size == (32, 32) for im in out.images)
    monkeypatch.chdir(tmp_path)
    written = cli_images(tmp_path, "--seed", "11", "--num-images", "2")
    assert [meta["seed"] for _, meta in written] == ["11", "12"]
    for image, (pixels, meta) in zip(out.images, written):
        assert np.asarray(image).tobytes() == pixels.tobytes()  # the CLI's uint8 pixels, clamped as it clamps
        for key in ("prompt", "seed", "steps", "size", "weights", "weights_hash", "runtime", "device",
                    "compute_dtype", "recipe_hash", "version"):
            assert image.info[key] == meta[key], key
        assert meta["command"].startswith("luminal-recipe run ") and "--num-images 2" in meta["command"]
        assert image.info["command"].startswith("Pipeline.from_recipe(")
    assert not np.array_equal(np.asarray(out.images[0]), np.asarray(out.images[1]))  # two seeds, two images


def test_parameters_chunk_is_written_as_a1111_writes_it(batch):
    out, _ = batch
    info = out.images[0].info
    want = (f"{PROMPT}\nSteps: 2, Sampler: Euler, CFG scale: 4.0, Seed: 11, Size: 32x32, "
            f"Model hash: {info['weights_hash']}, Model: flux2-tiny, Version: luminal-recipes {info['version']}")
    assert info["parameters"] == want
    assert re.fullmatch(r"[0-9a-f]{10}", info["weights_hash"])
    assert info["weights"] == str((ROOT / "recipes" / "flux2-tiny" / "checkpoint").resolve())
    assert info["runtime"] == "numpy" and info["compute_dtype"] == "recipe default"


def test_a_second_call_builds_compiles_and_loads_nothing(pipe, batch):
    out, _ = batch
    before = instrument.snapshot()
    again = pipe(PROMPT, seed=12, **SIZE)  # the batch's second seed, alone
    counted = instrument.snapshot()
    counted.subtract(before)
    for event in (instrument.GRAPH_BUILD, instrument.SEARCH, instrument.PLAN_CACHE_HIT, instrument.LOAD):
        assert counted[event] == 0, (event, dict(counted))
    assert again.seeds == [12] and again.timings["compile_s"] == 0.0
    assert np.asarray(again.images[0]).tobytes() == np.asarray(out.images[1]).tobytes()
    other = pipe(PROMPT, seed=12, steps=1, width=32, height=32)  # a per-run parameter: still nothing rebuilt
    counted = instrument.snapshot()
    counted.subtract(before)
    assert counted[instrument.GRAPH_BUILD] == 0 and counted[instrument.LOAD] == 0
    assert other.images[0].info["steps"] == "1"
    assert np.asarray(other.images[0]).tobytes() != np.asarray(again.images[0]).tobytes()


def test_callback_sees_every_denoising_step(batch):
    _, calls = batch
    assert [(step, total) for step, total, _ in calls] == [(1, 2), (2, 2), (1, 2), (2, 2)]
    assert all(shape == (1, 4, 128) for _, _, shape in calls)  # packed latents: (32/16)^2 tokens of 128 channels


def test_output_save_keeps_the_text_chunks(batch, tmp_path):
    out, _ = batch
    paths = out.save(tmp_path)
    pixels, meta = read_png(paths[1])
    assert pixels.tobytes() == np.asarray(out.images[1]).tobytes()
    assert meta["parameters"] == out.images[1].info["parameters"] and meta["seed"] == "12"


def test_reference_images_as_pil_or_path_make_the_same_image(pipe, tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)
    path = tmp_path / "ref.png"
    Image.fromarray(pixels).save(path)
    a = pipe(PROMPT, seed=1, image=Image.fromarray(pixels), **SIZE)
    b = pipe(PROMPT, seed=1, image=[str(path)], **SIZE)
    assert np.asarray(a.images[0]).tobytes() == np.asarray(b.images[0]).tobytes()
    assert a.images[0].info["image_hashes"] != b.images[0].info["image_hashes"]  # pixels vs. the file's bytes
    assert re.fullmatch(r"[0-9a-f]{10}", b.images[0].info["image_hashes"])


@pytest.mark.parametrize(("call", "fragment"), [
    (dict(prompt=3), "prompt=3: expected a str or a list of str"),
    (dict(prompt="x", stepz=2), None),  # a Python TypeError: not a parameter of __call__
    (dict(prompt="x", params={"stepz": 2}), "has no parameter 'stepz'"),
    (dict(prompt="x", seed=-1), "seed -1: expected a whole number"),
    (dict(prompt="x", seed=[1, 2], num_images=3), "2 seeds for num_images 3"),
    (dict(prompt="x", image=[42]), "image[0]=42: expected a PIL image or a path"),
    (dict(prompt="x", steps=0, width=32, height=32), "steps"),
])
def test_bad_arguments_are_located_errors(pipe, call, fragment):
    if fragment is None:
        with pytest.raises(TypeError):
            pipe(**call)
        return
    with pytest.raises(LuminalError) as info:
        pipe(**call)
    assert fragment in str(info.value)
    assert isinstance(info.value, InputError | PipelineError) or "steps" in fragment


def test_embed_on_an_image_pipeline_is_refused(pipe):
    with pytest.raises(InputError, match="does not return one array"):
        pipe.embed(["a", "b"])


def test_a_list_of_prompts_makes_an_image_each(pipe):
    out = pipe(["a red fox", "a blue bird"], seed=[3], **SIZE)
    assert out.prompts == ["a red fox", "a blue bird"] and out.seeds == [3, 3]
    assert [im.info["prompt"] for im in out.images] == out.prompts
    assert np.asarray(out.images[0]).tobytes() != np.asarray(out.images[1]).tobytes()


def test_loras_with_scales_are_the_clis_and_recorded(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from lora_files import make_lora, write_formats

    state, config, _ = make_lora()
    lora = write_formats(state, config, tmp_path / "loras")["diffusers"]
    with Pipeline.from_recipe(TINY, compile=False, sets=["max_sequence_length=64"], loras=[(lora, 0.5)]) as p:
        out = p(PROMPT, seed=2, **SIZE)
    assert out.images[0].info["loras"] == f"{lora}:0.5 (transformer)"
    monkeypatch.chdir(tmp_path)
    ((pixels, meta),) = cli_images(tmp_path, "--seed", "2", "--lora", f"{lora}:0.5")
    assert meta["loras"] == out.images[0].info["loras"]
    assert np.asarray(out.images[0]).tobytes() == pixels.tobytes()
