"""`luminal-recipe validate` accepts every YAML the project ships (a `kind: modules` library is checked as a
library), checks a checkpoint the recipe names itself when it is local, and leaves Hub checkpoints alone unless
asked (saying so)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from luminal_recipes.cli import app

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
SHIPPED = sorted([*RECIPES.rglob("*.yaml"), *RECIPES.rglob("*.yml")])
TINY_CHECKPOINT = RECIPES / "flux2-tiny" / "checkpoint"


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_shipped_recipes_include_every_kind():
    kinds = {line.split(":", 1)[1].strip() for path in SHIPPED for line in path.read_text().splitlines()
             if line.startswith("kind:")}
    assert kinds == {"model", "pipeline", "modules"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(RECIPES)))
def test_every_shipped_yaml_validates(path):
    result = cli("validate", path)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and result.output.startswith(f"{path}: valid ")


def test_a_library_is_checked_as_a_library():
    result = cli("validate", RECIPES / "flux2-transformer-modules.yaml")
    assert result.exit_code == 0, result.output
    assert "valid module library 'flux2-transformer-modules'" in result.output
    assert "syntax, module references, weights and forwards are valid" in result.output
    # the library reads one parameter that each including recipe defines
    assert "the including recipe must define them as parameters): norm_out_shift_first" in result.output


LIBRARY = """\
kind: modules
params:
  hidden: ${{config.hidden_size}}
modules:
  block:
    inputs: [x]
    weights:
      weight: [hidden, hidden]
    forward: |
      y = linear(x, self.weight)
      return {last}
  outer:
    inputs: [x]
    submodules:
      inner: {inner}
    forward: return self.inner(x)
"""


@pytest.mark.parametrize(
    "last, inner, where, message",
    [
        ("y +", "block", "11:", "syntax error in forward"),
        ("no_such_op(y)", "block", "11:14", "unknown op 'no_such_op'"),
        ("y", "blok", "15:14", "unknown module 'blok' (did you mean 'block'?)"),
    ],
)
def test_a_broken_library_is_refused_at_its_line(tmp_path, last, inner, where, message):
    path = tmp_path / "lib.yaml"
    path.write_text(LIBRARY.format(last=last, inner=inner))
    result = cli("validate", path)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"{path}:{where}" in result.stderr and message in result.stderr, result.stderr


def test_a_library_lists_names_it_expects_from_its_includer(tmp_path):
    path = tmp_path / "lib.yaml"
    path.write_text(LIBRARY.format(last="y * scale", inner="block"))
    result = cli("validate", path)
    assert result.exit_code == 0, result.output
    assert "must define them as parameters): scale" in result.output


def test_run_on_a_library_says_what_it_is():
    result = cli("run", RECIPES / "flux2-transformer-modules.yaml", "--prompt", "x")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "`kind: modules` library" in result.stderr


def test_a_local_pipeline_checkpoint_is_checked_by_default():
    result = cli("validate", RECIPES / "flux2-tiny.yaml")
    assert result.exit_code == 0, result.output
    assert "not checked" not in result.output
    for model in ("text_encoder", "transformer", "vae"):
        assert f"{model}: checkpoint {TINY_CHECKPOINT.relative_to(ROOT)}/{model} matches" in result.output or \
            f"{model}: checkpoint {TINY_CHECKPOINT}/{model} matches" in result.output, result.output


def test_a_hub_checkpoint_is_not_downloaded_unless_asked(monkeypatch):
    from luminal_recipes.weights import sources

    def no_download(*args, **kwargs):
        raise AssertionError("validate downloaded a checkpoint it was not asked to check")

    monkeypatch.setattr(sources, "resolve_source", no_download)
    for recipe in ("flux2.yaml", "flux2-vae-decoder.yaml"):
        result = cli("validate", RECIPES / recipe)
        assert result.exit_code == 0, result.output
        assert "checkpoint not checked: hf://black-forest-labs/FLUX.2-dev" in result.output
        assert "on the Hugging Face Hub" in result.output and "pass --weights" in result.output


def test_a_model_recipe_with_a_local_source_is_checked_by_default(tmp_path):
    text = (RECIPES / "flux2-vae-decoder.yaml").read_text()
    text = text.replace("source: hf://black-forest-labs/FLUX.2-dev/vae", "source: checkpoint/vae")
    recipe = tmp_path / "vae.yaml"
    recipe.write_text(text)
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")  # the modules it includes
    shutil.copytree(TINY_CHECKPOINT / "vae", tmp_path / "checkpoint" / "vae")  # a recipe's paths stay in its tree
    result = cli("validate", recipe)
    assert result.exit_code == 0, result.output
    assert "checkpoint/vae matches: 108 weights" in result.output
    assert "(the recipe's weights.source)" in result.output


def test_a_missing_local_pipeline_checkpoint_is_a_located_error(tmp_path):
    text = (RECIPES / "flux2-tiny.yaml").read_text().replace("weights: flux2-tiny/checkpoint", "weights: nowhere")
    for name in ("flux2-tiny.yaml", "flux2.yaml", "mistral3-text-encoder.yaml", "flux2-transformer.yaml",
                 "flux2-transformer-modules.yaml", "flux2-vae-decoder.yaml", "flux2-vae-encoder.yaml"):
        (tmp_path / name).write_text((RECIPES / name).read_text())
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")  # the module library the text encoder includes
    (tmp_path / "flux2-tiny.yaml").write_text(text)
    result = cli("validate", tmp_path / "flux2-tiny.yaml")
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith("weights:"))
    assert f"flux2-tiny.yaml:{line}:" in result.stderr and "'nowhere' does not exist" in result.stderr


def test_no_module_is_written_twice():
    """A module two shipped recipes need lives in one module library (recipes/lib/) that both include."""
    import yaml

    seen: dict[str, str] = {}
    for path in SHIPPED:
        modules = (yaml.safe_load(path.read_text()) or {}).get("modules") or {}
        for name, spec in modules.items():
            body = " ".join(str(spec.get("forward", "")).split())
            where = f"{path.relative_to(RECIPES)}:{name}"
            assert body not in seen, f"{where} repeats {seen[body]}; move it to a library in recipes/lib/"
            seen[body] = where
    library = yaml.safe_load((RECIPES / "lib" / "decoder.yaml").read_text())["modules"]
    assert {"split_half_rotary", "rmsnorm", "gqa_attention", "swiglu_mlp"} <= set(library)
