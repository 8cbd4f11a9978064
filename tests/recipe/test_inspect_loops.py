"""`inspect` lists a pipeline's stages with each loop's iteration count, computed from the parameters (with
--set applied), and the loop body's stages below it - not the body's stage count as if it were the steps."""

from __future__ import annotations

import shutil
from pathlib import Path

from luminal_recipes.recipe.commands import _stage_lines
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.recipe.params import ParamResolver

TINY = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny.yaml"
BODY = ["    timestep: run full", "    join_references: run concat", "    transformer: model transformer",
        "    noisy_velocity: run narrow", "    euler: run euler_step"]


def stage_lines(path: Path, sets=()) -> list[str]:
    recipe = load_recipe(path)
    return _stage_lines(recipe.doc.stages, ParamResolver(recipe.params, None, sets).resolve_all().values, "  ")


def test_the_loop_count_comes_from_the_parameters():
    lines = stage_lines(TINY)  # the recipe's default: 4 steps (its body has 5 stages)
    at = lines.index("  denoise: loop over steps: 4 iterations (steps = 4), each running 5 stages:")
    assert lines[at + 1 : at + 6] == BODY and lines[at + 6] == "  unpack: run unpack_latents"
    assert "  denoise: loop over steps: 1 iteration (steps = 1), each running 5 stages:" in stage_lines(
        TINY, ["steps=1"])


def test_a_loop_over_a_run_time_value_says_so(tmp_path):
    base = TINY.parent / "flux2.yaml"  # flux2-tiny.yaml extends it; the loop is written there
    text = base.read_text().replace("loop: {over: steps,", "loop: {over: timesteps,")
    for name in ("mistral3-text-encoder.yaml", "flux2-transformer.yaml", "flux2-transformer-modules.yaml",
                 "flux2-vae-decoder.yaml", "flux2-vae-encoder.yaml"):
        (tmp_path / name).write_text((TINY.parent / name).read_text())
    shutil.copytree(TINY.parent / "lib", tmp_path / "lib")  # the module library the text encoder includes
    path = tmp_path / "flux2.yaml"
    path.write_text(text)
    line = next(s for s in stage_lines(path) if s.startswith("  denoise:"))
    assert line == ("  denoise: loop over timesteps: iterations known when it runs (it loops over a value made "
                    "at run time), each running 5 stages:")
