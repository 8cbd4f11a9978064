"""`narrow` has one meaning in the whole recipe language: entries start..stop (exclusive) along an axis, in a
forward and as a pipeline step. The step's old `length` input is refused at its recipe line with the fix, and
any input a step does not take is refused before any work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from luminal_recipes.errors import RecipeError
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.plugins import steps

ROOT = Path(__file__).resolve().parents[2]

PIPELINE = """\
kind: pipeline
name: demo
params: {n: 3}
models: {}
inputs: {prompt: {type: str}}
stages:
  - {name: make, run: full, inputs: {value: 1.0, n: 5}, outputs: {value: x}}
  - name: cut
    run: narrow
    inputs: {value: x, axis: 0, start: 1, stop: n}
    outputs: {value: y}
outputs: {y: {value: y, type: array}}
"""


def test_the_step_takes_what_a_forward_takes():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(steps()["narrow"](None, x, 1, 1, 3)["value"], x[:, 1:3])
    np.testing.assert_array_equal(steps()["narrow"](None, x, -1, 0, 4)["value"], x)


def test_old_length_input_is_refused_at_its_line_with_the_fix(tmp_path):
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(PIPELINE.replace("stop: n}", "length: n}"))
    with pytest.raises(RecipeError) as info:
        Pipeline(recipe)
    message = str(info.value)
    assert message.startswith(f"{recipe}:10:")
    assert "takes no input 'length'" in message and "stop: <start> + <length>" in message


def test_an_input_the_step_does_not_take_is_refused(tmp_path):
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(PIPELINE.replace("stop: n}", "stpo: n}"))
    with pytest.raises(RecipeError, match=r"demo\.yaml:10:\d+: stage 'cut': step 'narrow' takes no input 'stpo' "
                                          r"\(did you mean 'stop'\?\)"):
        Pipeline(recipe)


def test_no_shipped_recipe_uses_the_old_spelling():
    for path in [*ROOT.glob("recipes/**/*.yaml"), *ROOT.glob("tests/**/*.yaml")]:
        text = path.read_text()
        assert "run: narrow" not in text or "length:" not in text.split("run: narrow", 1)[1][:200], path
