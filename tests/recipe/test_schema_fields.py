"""Every schema field is read by something: keys that were never read are refused with what to write instead;
pipeline input types are checked when the pipeline runs; `loop.carry` says exactly which values an iteration
reads from the one before; `doc:` is what `inspect` shows; `validate` knows the steps of the task plug-ins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import RecipeError
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.recipe.commands import inspect, validate
from luminal_recipes.recipe.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

PIPELINE = """\
kind: pipeline
name: p
params: {steps: 3}
models: {}
inputs:
  prompt: {type: str, doc: what to say}
  scale: {type: float, optional: true}
  counts: {type: "list[int]", optional: true}
stages:
  - {name: start, run: full, inputs: {value: 1.0}, outputs: {value: x}}
  - name: loop
    loop: {over: steps, var: i, carry: [x]}
    steps:
      - {name: grow, run: full, inputs: {value: "x[0] * 2"}, outputs: {value: x}}
outputs: {x: {value: x, type: array}}
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(("old", "new", "words"), [
    ("params: {steps: 3}\n", "params: {steps: 3}\nscheduler: {name: flow_match_euler}\n",
     "key 'name' is no longer read: the scheduler is what the pipeline's steps implement"),
])
def test_removed_pipeline_keys_say_what_to_do(tmp_path, old, new, words):
    path = write(tmp_path, PIPELINE.replace(old, new))
    with pytest.raises(RecipeError, match=rf"p\.yaml:{line_of(path, 'name: flow')}:\d+: ") as info:
        load_recipe(path)
    assert words in str(info.value) and "delete the key" in str(info.value)


def test_a_weight_doc_is_refused_with_what_to_do(tmp_path):
    path = write(tmp_path, "kind: model\nname: m\nmodules:\n  m:\n    weights:\n"
                           "      w: {shape: [2], doc: the scale}\n    forward: return self.w\n", "m.yaml")
    with pytest.raises(RecipeError, match=r"m\.yaml:6:\d+: key 'doc' is no longer read: .*YAML comment"):
        load_recipe(path)


def test_pipeline_input_types_are_a_vocabulary_checked_at_run(tmp_path):
    bad = write(tmp_path, PIPELINE.replace("type: float", "type: tensor"), "bad.yaml")
    with pytest.raises(RecipeError, match=rf"bad\.yaml:{line_of(bad, 'tensor')}:\d+: unknown input type 'tensor'"):
        load_recipe(bad)
    path = write(tmp_path, PIPELINE)
    pipe = Pipeline(path, weights=tmp_path)
    result = pipe.run({"prompt": "hi", "scale": 2, "counts": [1, 2]}).values["x"]
    np.testing.assert_array_equal(result, [8.0])  # 1 -> 2 -> 4 -> 8: each iteration reads the one before
    for given, words in (({"prompt": 3}, "input 'prompt' is declared str, but was given int"),
                         ({"prompt": "hi", "scale": "x"}, "input 'scale' is declared float, but was given str"),
                         ({"prompt": "hi", "counts": [1, 2.5]}, "input 'counts' is declared list[int]"),
                         ({"prompt": None}, "input 'prompt' (str) is not optional; it was given null")):
        with pytest.raises(RecipeError, match=rf"p\.yaml:{line_of(path, 'prompt:')}|p\.yaml:\d+") as info:
            pipe.run(given)
        assert words in str(info.value)


@pytest.mark.parametrize(("old", "new", "words"), [
    ("carry: [x]", "carry: []", "stage 'grow' of loop 'loop' reads 'x' and then rewrites it, so each iteration"),
    ("carry: [x]", "carry: [x, y]", "loop 'loop' carries 'y', which has no value before the loop starts"),
    ("carry: [x]", "carry: [x, steps]", "loop 'loop' carries 'steps', but no stage of its body rewrites it"),
], ids=["undeclared", "no-value-before", "not-rewritten"])
def test_loop_carry_is_checked(tmp_path, old, new, words):
    path = write(tmp_path, PIPELINE.replace(old, new))
    with pytest.raises(RecipeError, match=r"p\.yaml:\d+:\d+: ") as info:
        validate(path)
    assert words in str(info.value)


def test_shipped_flux2_loop_carries_its_latents():
    recipe = load_recipe(RECIPES / "flux2.yaml")
    (loop,) = [stage for stage in recipe.doc.stages if stage.name == "denoise"]
    assert loop.loop.carry == ["latents"]
    validate(RECIPES / "flux2.yaml")


def test_docs_are_what_inspect_shows(tmp_path):
    library = inspect(RECIPES / "lib" / "decoder.yaml")
    assert "split-half convention (transformers' default RoPE)" in library and "LLM recipes" in library
    path = write(tmp_path, PIPELINE)
    text = inspect(path)
    assert "prompt                 str  # what to say" in text and "scale                  float (optional)" in text
    vae = inspect(RECIPES / "flux2-vae-decoder.yaml")
    assert "FLUX.2 latents [batch" in vae and "# decoder blocks (each but the last upsamples 2x)" in vae
    assert "latents: denoised latents, unpacked to a grid" in vae


def test_validate_refuses_a_step_no_plugin_defines(tmp_path):
    path = write(tmp_path, PIPELINE.replace("run: full, inputs: {value: 1.0}", "run: ful, inputs: {value: 1.0}"))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and f"p.yaml:{line_of(path, 'run: ful,')}:" in result.stderr
    assert "runs unknown step 'ful' (did you mean 'full'?)" in result.stderr


def test_schema_lists_no_removed_key():
    import json

    schema = json.loads(CliRunner().invoke(app, ["schema"]).stdout)
    assert "name" not in schema["$defs"]["SchedulerSpec"]["properties"]
    assert "doc" not in schema["$defs"]["WeightSpec"]["properties"]
    assert set(schema["$defs"]["SchedulerSpec"]["properties"]) == {"config", "options"}

