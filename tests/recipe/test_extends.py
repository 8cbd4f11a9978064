"""`extends:` for pipeline recipes: the shipped FLUX.2 variants state only what differs from flux2.yaml and load to
exactly the documents they were before (tests/recipe/expanded/ holds those, verbatim but for the scheduler's
`name`, a key no longer read); mappings merge key by key,
lists and other values are replaced whole; every error points into the file that wrote the value; cycles, bases
outside the recipe's folder and bases that are no pipeline are refused; validate, inspect and schema know it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe.commands import inspect, validate
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.recipe.params import ParamResolver

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
EXPANDED = Path(__file__).resolve().parent / "expanded"
VARIANTS = ["flux2-tiny.yaml", "flux2-fp8.yaml", "flux2-nvfp4.yaml", "flux2-nvfp4-bfl.yaml"]


@pytest.fixture
def tree(tmp_path) -> Path:
    """The shipped recipes (and module libraries) in a folder of the test's own."""
    folder = tmp_path / "recipes"
    shutil.copytree(RECIPES, folder, ignore=shutil.ignore_patterns("flux2-tiny", "flux2-dev-configs", "*.md"))
    return folder


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_equals_its_old_expanded_form(tree, name):
    shipped = load_recipe(RECIPES / name)
    assert shipped.extends == [(RECIPES / "flux2.yaml").resolve()] and shipped.doc.extends == "flux2.yaml"
    (tree / f"expanded-{name}").write_text((EXPANDED / name).read_text())
    old = load_recipe(tree / f"expanded-{name}")
    assert old.extends == [] and old.doc.extends is None
    assert shipped.doc.model_dump(exclude={"extends"}) == old.doc.model_dump(exclude={"extends"})
    values = [ParamResolver(r.params, None, ()).resolve_all().values for r in (shipped, old)]
    assert values[0] == values[1] and list(values[0]) == list(values[1])  # same values, same order
    assert len((RECIPES / name).read_text()) < len((EXPANDED / name).read_text())


def test_mappings_merge_and_other_values_replace(tree):
    (tree / "child.yaml").write_text(
        "kind: pipeline\nextends: flux2-tiny.yaml\nname: child\n"
        "params:\n  steps: {default: 2}\n  extra: 7\n"          # one field of a parameter; a new parameter
        "models:\n  vae: {weights: other}\n"                    # one key of one model
        "stages:\n  - {name: only, run: full, inputs: {value: 1.0}, outputs: {value: one}}\n"  # a list: whole
        "outputs: {one: one}\n"
        "scheduler: null\n")                                    # null replaces too
    recipe = load_recipe(tree / "child.yaml")
    doc = recipe.doc
    assert recipe.extends == [(tree / "flux2-tiny.yaml").resolve(), (tree / "flux2.yaml").resolve()]
    assert doc.params["steps"].default == 2 and doc.params["steps"].doc == "number of denoising steps"
    assert doc.params["width"].default == 80 and doc.params["extra"].default == 7
    assert list(doc.params)[-1] == "extra" and list(doc.params)[0] == "steps"  # the base's order, then new keys
    assert doc.models["vae"].weights == "other" and doc.models["vae"].recipe == "flux2-vae-decoder.yaml"
    assert [s.name for s in doc.stages] == ["only"] and doc.scheduler is None and doc.weights is not None
    assert recipe.files[:3] == [tree / "child.yaml", *recipe.extends]


def test_errors_point_into_the_file_that_wrote_the_value(tree):
    base = tree / "flux2.yaml"
    base.write_text(base.read_text().replace("config: scheduler/scheduler_config.json", "config: /etc/passwd"))
    with pytest.raises(RecipeError, match=rf"/flux2\.yaml:{line_of(base, '/etc/passwd')}:\d+: '/etc/passwd' is an "
                                          "absolute path"):
        load_recipe(tree / "flux2-tiny.yaml")
    shutil.copy(RECIPES / "flux2.yaml", base)
    tiny = tree / "flux2-tiny.yaml"
    tiny.write_text(tiny.read_text().replace("steps: {default: 4}", "steps: {defualt: 4}"))
    with pytest.raises(RecipeError, match=rf"/flux2-tiny\.yaml:{line_of(tiny, 'defualt')}:\d+: unknown key "
                                          "'defualt'"):
        load_recipe(tiny)
    shutil.copy(RECIPES / "flux2-tiny.yaml", tiny)
    base.write_text(base.read_text().replace("image_seq_len: h * w}", "image_seq_len: h * wdth}"))
    line = line_of(base, "h * wdth")
    col = base.read_text().splitlines()[line - 1].index("wdth") + 1
    result = CliRunner().invoke(app, ["validate", str(tiny)])
    assert result.exit_code == 2 and f"/flux2.yaml:{line}:{col}: stage 'schedule' input 'image_seq_len': " \
        "'wdth' is not defined" in result.stderr


@pytest.mark.parametrize(("text", "words"), [
    ("extends: a.yaml", "extends cycle: a.yaml -> a.yaml"),
    ("extends: ../flux2.yaml", "is outside this recipe's folder tree"),
    ("extends: sub/base.yaml", "is not in this recipe's folder"),
    ("extends: flux2-vae-decoder.yaml", "is a `kind: model` recipe; `extends` takes a pipeline recipe"),
    ("extends: nowhere.yaml", "'nowhere.yaml' does not exist"),
    ("extends: [flux2.yaml]", "`extends` names one pipeline recipe file"),
    ("kind: model\nextends: flux2.yaml", "`extends` is for pipeline recipes"),
], ids=["self", "outside", "subfolder", "model", "missing", "list", "in-a-model"])
def test_bad_extends_are_refused_at_their_line(tree, text, words):
    (tree / "sub").mkdir()
    shutil.copy(RECIPES / "flux2.yaml", tree / "sub" / "base.yaml")
    path = tree / "a.yaml"
    path.write_text(("kind: pipeline\n" if not text.startswith("kind") else "") + text + "\nname: a\n")
    with pytest.raises(RecipeError, match="a.yaml:") as info:
        load_recipe(path)
    assert words in str(info.value) and f"a.yaml:{line_of(path, 'extends')}:" in str(info.value)


def test_a_cycle_through_two_files_is_refused(tree):
    (tree / "a.yaml").write_text("kind: pipeline\nextends: b.yaml\nname: a\n")
    (tree / "b.yaml").write_text("kind: pipeline\nname: b\nextends: a.yaml\n")
    with pytest.raises(RecipeError, match=r"/b\.yaml:3:\d+: extends cycle: a\.yaml -> b\.yaml -> a\.yaml"):
        load_recipe(tree / "a.yaml")


def test_validate_inspect_and_schema_know_extends():
    report = validate(RECIPES / "flux2-fp8.yaml")
    assert any("(extends: flux2.yaml)" in line for line in report.checks)
    text = inspect(RECIPES / "flux2-fp8.yaml")  # no checkpoint: the stages, without a memory plan
    assert "flux2-fp8.yaml, extends flux2.yaml)" in text and "denoise: loop over steps: 50" in text
    schema = json.loads(CliRunner().invoke(app, ["schema"]).stdout)
    pipeline = next(d for k, d in schema["$defs"].items() if k == "PipelineRecipe")
    assert "extends" in pipeline["properties"] and "merge" in pipeline["properties"]["extends"]["description"]
