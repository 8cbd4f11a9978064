"""`luminal-recipe validate RECIPE --draft-config CLASS` drafts a recipe's `config:` section from a transformers
config class: the fields its parameters read under `read`, fields that never change outputs under `ignore` with a
reason, every other field under `require` with the class's default only. The draft, pasted in, classifies every
field of the class, passes the static check, accepts the class's defaults and refuses another value."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig, Phi3Config
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe import load_recipe
from luminal_recipes.recipe.check import check_recipe
from luminal_recipes.recipe.config_fields import check_config, config_report

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PLAIN = (Path(__file__).resolve().parents[1] / "tasks" / "generation" / "test_plain_decoder.py").read_text()
PLAIN = PLAIN.split('PLAIN = """\\\n', 1)[1].split('"""', 1)[0]


@pytest.fixture
def plain(tmp_path):
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")
    path = tmp_path / "plain.yaml"
    path.write_text(PLAIN)
    return path


def draft(path, name):
    result = CliRunner().invoke(app, ["validate", str(path), "--draft-config", name])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize(("name", "cls"), [("LlamaConfig", LlamaConfig), ("transformers.Phi3Config", Phi3Config),
                                           ("phi3", Phi3Config)])
def test_the_draft_classifies_every_field_and_holds_the_defaults(plain, name, cls):
    text = draft(plain, name)
    section = yaml.safe_load(text)["config"]
    assert {"vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings"} <= \
        set(section["read"])
    assert section["require"]["model_type"] == [cls.model_type]
    assert "dropout is off" in section["ignore"]["attention_dropout"]
    plain.write_text(plain.read_text() + text)
    recipe = load_recipe(plain)
    check_recipe(recipe)  # the parameters read only declared fields
    defaults = cls().to_dict()
    assert config_report(recipe, defaults, "config.json").unknown == []
    check_config(recipe, defaults, "config.json")
    with pytest.raises(RecipeError, match=r"plain\.yaml:\d+:\d+: config\.json: 'hidden_act' is \"gelu\""):
        check_config(recipe, {**defaults, "hidden_act": "gelu"}, "config.json")


def test_a_classified_field_keeps_its_rule():
    section = yaml.safe_load(draft(RECIPES / "llama.yaml", "llama"))["config"]
    assert section["require"]["rope_parameters.rope_type"] == ["default", "llama3"]
    assert section["ignore"]["pretraining_tp"].startswith("transformers 5 no longer reads it")


def test_an_unknown_class_or_a_pipeline_is_refused(plain):
    result = CliRunner().invoke(app, ["validate", str(plain), "--draft-config", "LlamaConfg"])
    assert result.exit_code == 2 and "did you mean 'LlamaConfig'" in result.stderr, result.output
    result = CliRunner().invoke(app, ["validate", str(RECIPES / "flux2-tiny.yaml"), "--draft-config", "llama"])
    assert result.exit_code == 2 and "pipeline recipe" in result.stderr, result.output
