"""Task plug-ins: found by listing luminal_recipes/tasks/ (a package dropped there is used without being listed
anywhere), one namespace of step names (a clash names both plug-ins), unknown steps refused at their recipe line
before any work, and the plug-ins' parameter checks applied to the pipelines that run their steps."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

import luminal_recipes.tasks
from luminal_recipes.errors import PluginError, RecipeError
from luminal_recipes.pipeline import plugins
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.recipe.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

DEMO = '''
def shout(ctx, text):
    return {"text": text.upper() + "!"}

def check_times(value, given):
    from luminal_recipes.errors import PipelineError
    if value < 1:
        raise PipelineError(f"{given}: times must be at least 1")

STEPS = {"shout": shout}
PARAM_CHECKS = {"times": check_times}
'''
PIPELINE = """\
kind: pipeline
name: demo
params: {times: 2}
models: {}
inputs: {prompt: {type: str}}
stages:
  - {name: shout, run: shout, inputs: {text: prompt}, outputs: {text: loud}}
outputs: {loud: {value: loud, type: text}}
"""


@pytest.fixture
def fresh_registry():
    plugins.discover.cache_clear()
    plugins.registry.cache_clear()
    yield
    plugins.discover.cache_clear()
    plugins.registry.cache_clear()


@pytest.fixture
def demo_plugin(tmp_path, monkeypatch, fresh_registry):
    """A plug-in package `demo` in a second folder of the luminal_recipes.tasks package."""
    folder = tmp_path / "tasks"
    (folder / "demo").mkdir(parents=True)
    (folder / "demo" / "__init__.py").write_text(DEMO)
    monkeypatch.setattr(luminal_recipes.tasks, "__path__", [*luminal_recipes.tasks.__path__, str(folder)])
    yield folder
    sys.modules.pop("luminal_recipes.tasks.demo", None)


def test_shipped_plugins_define_every_step_the_shipped_pipelines_run():
    names = [task.name for task in plugins.discover()]
    assert "flux2" in names and "common" in names
    pipelines = [path for path in RECIPES.glob("*.yaml") if "kind: pipeline" in path.read_text()]
    assert len(pipelines) >= 5
    for path in pipelines:
        recipe = load_recipe(path)
        plugins.check_steps_known(recipe)
        expected = {"embedding"} if recipe.doc.name == "minilm" else {"flux2", "common"}
        assert {t.name for t in plugins.tasks_of(recipe.doc)} == expected, path.name


def test_a_plugin_package_is_discovered_and_runs(demo_plugin, tmp_path):
    assert "shout" in plugins.registry() and plugins.registry()["shout"].name == "demo"
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(PIPELINE)
    pipe = Pipeline(recipe, weights=tmp_path)
    assert pipe.run({"prompt": "hi"}).values["loud"] == "HI!"
    assert [t.name for t in plugins.tasks_of(pipe.doc)] == ["demo"]


def test_a_plugins_parameter_checks_apply_to_run(demo_plugin, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from luminal_recipes.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo.yaml").write_text(PIPELINE)
    result = CliRunner().invoke(app, ["run", "demo.yaml", "-p", "hi", "--set", "times=0", "--weights", "."])
    assert result.exit_code == 2 and "--set times=0: times must be at least 1" in result.stderr
    result = CliRunner().invoke(app, ["run", "demo.yaml", "-p", "hi", "--weights", ".", "-q"])
    assert result.exit_code == 0 and result.stdout == "HI!\n"


def test_a_step_defined_twice_names_both_plugins():
    one = plugins.Task("one", {"tokenize": print})
    two = plugins.Task("two", {"other": print, "tokenize": print})
    with pytest.raises(PluginError, match="step 'tokenize' is defined by two task plug-ins, 'one' and 'two'"):
        plugins.build_registry([one, two])


def test_a_clash_with_a_shipped_step_is_refused_at_discovery(demo_plugin):
    (demo_plugin / "demo" / "__init__.py").write_text("STEPS = {'full': lambda ctx: {}}\n")
    with pytest.raises(PluginError, match="'common' and 'demo'"):
        plugins.registry()


def test_a_plugin_may_define_no_steps():
    """A task that runs its models itself (text generation) is a plug-in without pipeline steps."""
    task = plugins._read("runner", SimpleNamespace(__file__="x.py"))
    assert task.steps == {} and plugins.build_registry([task]) == {}


@pytest.mark.parametrize(("module", "words"), [
    (SimpleNamespace(__file__="x.py", STEPS=[print]), "STEPS must map names to functions"),
    (SimpleNamespace(__file__="x.py", STEPS={"a": 1}), "STEPS must map names to functions"),
    (SimpleNamespace(__file__="x.py", STEPS={"a": print}, INPUTS=[]), "INPUTS must map names to functions"),
])
def test_malformed_plugins_are_refused(module, words):
    with pytest.raises(PluginError, match=words):
        plugins._read("bad", module)


def test_an_unknown_step_is_refused_at_its_line(tmp_path):
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(PIPELINE.replace("run: shout", "run: tokenise"))
    with pytest.raises(RecipeError, match=r"demo\.yaml:7:\d+: stage 'shout' runs unknown step 'tokenise' "
                                          r"\(did you mean 'tokenize'\?\)"):
        Pipeline(recipe)


def test_every_package_is_listed_in_pyproject():
    """A regular install gets only the packages pyproject lists: a new plug-in (or any package) must be there."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"luminal_recipes": ROOT / "luminal_recipes", "luminal_recipes.compiler": ROOT / "compiler",
             "luminal_recipes.runtimes": ROOT / "runtimes"}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            if not any(re.match(r"^(__pycache__|\.)", p) for p in parts):
                found.add(".".join((name, *parts)))
    assert found - listed == set(), "add these packages to pyproject.toml [tool.setuptools] packages"
