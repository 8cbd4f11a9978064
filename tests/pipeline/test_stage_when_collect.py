"""Pipeline stages that run only when a parameter expression holds (`when:`), loops that gather a value of each
iteration into a list (`loop.collect`), and parameters a plug-in derives from an input (`DERIVE`): what the
driver runs, what the planner plans, what validation refuses at its line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import luminal_recipes.tasks
from luminal_recipes.errors import PipelineError, RecipeError
from luminal_recipes.pipeline import plugins
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.generate import derived_sets, read_file_inputs
from luminal_recipes.pipeline.plan import _running_model_stages
from luminal_recipes.recipe.commands import inspect
from luminal_recipes.recipe.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]

PIPELINE = """\
kind: pipeline
name: gather
params: {n: 3, enabled: true}
models: {}
inputs: {prompt: {type: str}}
stages:
  - name: squares
    when: enabled
    loop: {over: n, var: i, collect: {square: squares}}
    steps:
      - {name: one, run: full, inputs: {value: "i * i", n: 1}, outputs: {value: square}}
  - {name: all, run: concat, inputs: {values: squares, axis: 0}, outputs: {value: joined}}
outputs: {joined: joined}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_a_loop_collects_each_iteration_s_value(tmp_path):
    pipe = Pipeline(write(tmp_path, PIPELINE), weights=tmp_path)
    values = pipe.run({"prompt": "x"}).values
    assert [float(v[0]) for v in values["squares"]] == [0.0, 1.0, 4.0]
    assert values["joined"].tolist() == [0.0, 1.0, 4.0]


def test_a_stage_whose_when_is_false_does_not_run_and_collects_nothing(tmp_path):
    pipe = Pipeline(write(tmp_path, PIPELINE.replace("  - {name: all", "  - {name: all, when: enabled")),
                    weights=tmp_path, sets=["enabled=false"])
    values = pipe.run({"prompt": "x"}).values
    assert values["squares"] == [] and "square" not in values
    # the body's own value has none after a loop that did not run: reading it names the loop
    pipe = Pipeline(write(tmp_path, PIPELINE.replace("values: squares", "values: \"[square]\"")), weights=tmp_path,
                    sets=["enabled=false"])
    with pytest.raises(PipelineError, match="'square' has no value: stage 'squares', which makes it, did not run"):
        pipe.run({"prompt": "x"})


def test_the_planner_leaves_out_model_stages_that_do_not_run():
    pipe = Pipeline(ROOT / "recipes" / "flux2-tiny.yaml")
    names = [stage.name for _, stage in _running_model_stages(pipe, pipe.doc.stages)]
    assert names == ["text_encoder", "transformer", "vae"]  # no reference image: the VAE encoder is not planned
    pipe = Pipeline(ROOT / "recipes" / "flux2-tiny.yaml", sets=["reference_tokens=20", "reference_height=64",
                                                               "reference_width=80"])
    names = [stage.name for _, stage in _running_model_stages(pipe, pipe.doc.stages)]
    assert names == ["text_encoder", "vae_encoder", "transformer", "vae"]


@pytest.mark.parametrize(("old", "new", "message"), [
    ("when: enabled", "when: prompt", "'prompt' is not defined before this point"),  # parameters only
    ("collect: {square: squares}", "collect: {cube: squares}", "collects 'cube', which no stage of its body"),
])
def test_validation_refuses_at_the_line(tmp_path, old, new, message):
    path = write(tmp_path, PIPELINE.replace(old, new))
    with pytest.raises(RecipeError, match=message) as info:
        load_and_check(path)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if new.split(":")[0] in text)
    assert f"p.yaml:{line}:" in str(info.value)


def load_and_check(path: Path) -> None:
    from luminal_recipes.recipe.check import check_pipeline

    check_pipeline(load_recipe(path))


def test_inspect_says_a_stage_does_not_run(tmp_path):
    text = inspect(write(tmp_path, PIPELINE), sets=["enabled=false"])
    assert "  squares: not run (when enabled: false)" in text


DERIVING = '''
def read_sizes(value, params):
    return [int(v) for v in value]

def derive(value, params, set_by):
    out = {"total": (sum(value), "--sizes")}
    if "first" not in set_by:
        out["first"] = (value[0], "the first --sizes")
    return out

DERIVE = {"sizes": derive}
INPUTS = {"sizes": read_sizes}
STEPS = {"noop": lambda ctx: {}}
'''


@pytest.fixture
def deriving_plugin(tmp_path, monkeypatch):
    plugins.discover.cache_clear()
    plugins.registry.cache_clear()
    folder = tmp_path / "tasks"
    (folder / "derivedemo").mkdir(parents=True)
    (folder / "derivedemo" / "__init__.py").write_text(DERIVING)
    monkeypatch.setattr(luminal_recipes.tasks, "__path__", [*luminal_recipes.tasks.__path__, str(folder)])
    yield
    sys.modules.pop("luminal_recipes.tasks.derivedemo", None)
    plugins.discover.cache_clear()
    plugins.registry.cache_clear()


DERIVED_PIPELINE = """\
kind: pipeline
name: derived
params: {first: 1, total: 0, double: "${2 * total}"}
models: {}
inputs: {sizes: {type: "list[int]", optional: true}}
stages:
  - {name: nothing, run: noop}
  - {name: value, run: full, inputs: {value: double}, outputs: {value: out}}
outputs: {out: out}
"""


def test_a_plugin_derives_parameters_from_an_input(deriving_plugin, tmp_path):
    path = write(tmp_path, DERIVED_PIPELINE)
    pipe = Pipeline(path, weights=tmp_path)
    tasks = plugins.tasks_of(pipe.doc)
    inputs = read_file_inputs(pipe, tasks, {"sizes": ["3", "4"]})
    assert inputs == {"sizes": [3, 4]}
    assert pipe.params["total"] == 7 and pipe.params["double"] == 14 and pipe.params["first"] == 3
    assert pipe.resolved.set_by["total"] == "--sizes"
    assert float(pipe.run(inputs).values["out"][0]) == 14.0
    # a parameter the user set is never replaced: the plug-in leaves it, or the clash is refused
    pipe = Pipeline(path, weights=tmp_path, sets=["first=9"])
    read_file_inputs(pipe, plugins.tasks_of(pipe.doc), {"sizes": ["3"]})
    assert pipe.params["first"] == 9
    pipe = Pipeline(path, weights=tmp_path, sets=["total=1"])
    with pytest.raises(PipelineError, match="--sizes sets parameter 'total', which --set total=1 sets too"):
        read_file_inputs(pipe, plugins.tasks_of(pipe.doc), {"sizes": ["3"]})
    assert "total=7" in derived_sets(path, str(tmp_path), [], {"sizes": ["3", "4"]})


def test_pipeline_inputs_may_be_lists_of_arrays(tmp_path):
    pics = "inputs: {prompt: {type: str}, pics: {type: 'list[array]', optional: true}}"
    path = write(tmp_path, PIPELINE.replace("inputs: {prompt: {type: str}}", pics))
    pipe = Pipeline(path, weights=tmp_path)
    pipe.run({"prompt": "x", "pics": [np.zeros(2), np.ones(3)]})
    with pytest.raises(RecipeError, match="declared list\\[array\\]"):
        pipe.run({"prompt": "x", "pics": ["not an array"]})
