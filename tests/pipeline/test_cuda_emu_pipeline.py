"""`luminal-recipe run recipes/flux2-tiny.yaml --runtime cuda-emu` (reduced: 32x32, 2 steps, 64 text tokens): the
programs the compiler picks for the GPU, run as their generated CUDA C on the CPU, give an image within 40 dB PSNR
of the numpy runtime's (its naive programs: the same functions, no search to wait for)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.pipeline.golden import psnr

ROOT = Path(__file__).resolve().parents[2]
REDUCED = ["--steps", "2", "--width", "32", "--height", "32", "--set", "max_sequence_length=64", "--seed", "3",
           "--prompt", "a lighthouse at dusk", "--json"]


@pytest.mark.skipif(not shutil.which("g++"), reason="cuda-emu needs g++")
def test_tiny_flux2_on_cuda_emu_matches_the_numpy_runtime(tmp_path):
    images, summaries = {}, {}
    for runtime, extra in (("numpy", ["--no-compile"]), ("cuda-emu", [])):  # the reference needs no search
        out = tmp_path / f"{runtime}.png"
        result = CliRunner().invoke(app, ["run", str(ROOT / "recipes" / "flux2-tiny.yaml"), *REDUCED, *extra,
                                          "--runtime", runtime, "-o", str(out)])
        assert result.exit_code == 0, result.output
        images[runtime], summaries[runtime] = np.asarray(Image.open(out)), json.loads(result.stdout)
    assert images["numpy"].std() > 5  # not a constant image
    assert psnr(images["cuda-emu"], images["numpy"]) >= 40.0
    emu = summaries["cuda-emu"]["memory"]
    assert emu["runtime"] == "cuda-emu" and emu["device"].startswith("cpu (CUDA C through g++")
