"""Loading recipes: YAML syntax, schema errors located at their node, includes kept inside the folder tree,
module reference cycles, the pipeline schema, and the published JSON Schema."""

from __future__ import annotations

import json

import pytest

from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe.commands import validate
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.recipe.schema import json_schema

MODEL = """
kind: model
name: t
params: {hidden: 8}
inputs: {x: {shape: [2, hidden]}}
modules:
  norm:
    inputs: [x]
    weights: {weight: [hidden]}
    forward: return rms_norm(x, self.weight)
"""


def test_yaml_syntax_error_is_located(write):
    path, text = write(
        "bad.yaml",
        """
        kind: model
        name: t
        modules:
          m:
            inputs: [x, y
            forward: return x
    """,
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "bad.yaml:6:12: YAML syntax error: expected ',' or ']'" in message
    assert "while parsing a flow sequence" in message and "unbalanced brackets" in message


def test_unknown_key_with_did_you_mean_at_the_key(write, position):
    path, text = write("r.yaml", MODEL.replace("    inputs: [x]\n", "    inptus: [x]\n"))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert f"r.yaml:{position(text, 'inptus')}: unknown key 'inptus' (did you mean 'inputs'?)" in str(
        info.value
    )


def test_unknown_top_level_key_and_kind(write, position):
    path, text = write("r.yaml", MODEL.replace("params:", "parms:"))
    with pytest.raises(RecipeError, match=r"r\.yaml:3:1: unknown key 'parms' \(did you mean 'params'\?\)"):
        load_recipe(path)
    path, text = write("k.yaml", MODEL.replace("kind: model", "kind: modle"))
    with pytest.raises(
        RecipeError,
        match=r"k\.yaml:1:7: `kind` must be one of model, pipeline, got 'modle' "
        r"\(did you mean 'model'\?\)",
    ):
        load_recipe(path)


@pytest.mark.parametrize(
    "old, new, needle, phrase",
    [
        ("inputs: [x]", "inputs: x", "inputs: x", "should be a valid list"),
        ("weights: {weight: [hidden]}", "weights: {weight: [[1], 2]}", "[1]", "wrong type: got a list [1]"),
        ("name: t", "name: [t]", "[t]", "should be a valid string"),
        (
            "weights: {weight: [hidden]}",
            "weights: {weight: {shape: [hidden], dtype: f33}}",
            "f33",
            "unknown dtype 'f33' (did you mean 'f32'?)",
        ),
    ],
)
def test_wrong_types_are_located(write, position, old, new, needle, phrase):
    path, text = write("r.yaml", MODEL.replace(old, new))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    line = position(text, needle).split(":")[0]
    assert f"r.yaml:{line}:" in str(info.value) and phrase in str(info.value)


def test_missing_required_key(write):
    path, _ = write("r.yaml", MODEL.replace("    forward: return rms_norm(x, self.weight)\n", ""))
    with pytest.raises(RecipeError, match=r"r\.yaml:7:5: missing required key 'forward'"):
        load_recipe(path)


def test_include_merges_modules_from_the_folder_tree(write):
    write(
        "lib/norms.yaml",
        """
        kind: modules
        modules:
          norm:
            inputs: [x]
            weights: {weight: [hidden]}
            forward: return rms_norm(x, self.weight)
    """,
    )
    path, _ = write(
        "r.yaml",
        """
        kind: model
        name: t
        include: [lib/norms.yaml]
        params: {hidden: 8}
        inputs: {x: {shape: [2, hidden]}}
        root: top
        modules:
          top:
            inputs: [x]
            submodules: {n: norm}
            forward: return self.n(x)
    """,
    )
    loaded = load_recipe(path)
    assert set(loaded.modules) == {"top", "norm"}
    assert loaded.modules["norm"].origin.loc().file.endswith("norms.yaml")
    validate(path)


@pytest.mark.parametrize("target", ["../outside.yaml", "sub/../../outside.yaml", "/etc/passwd"])
def test_include_outside_the_folder_tree_is_rejected(tmp_path, write, target):
    (tmp_path / "outside.yaml").write_text("kind: modules\nmodules: {}\n")
    path, text = write("recipes/r.yaml", MODEL.replace("name: t\n", f"name: t\ninclude: ['{target}']\n"))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "r.yaml:3:11:" in str(info.value) and "outside this recipe's folder tree" in str(info.value)


def test_include_through_a_symlink_out_of_the_tree_is_rejected(tmp_path, write):
    (tmp_path / "outside.yaml").write_text("kind: modules\nmodules: {}\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    path, _ = write("recipes/r.yaml", MODEL.replace("name: t\n", "name: t\ninclude: [link.yaml]\n"))
    with pytest.raises(RecipeError, match="outside this recipe's folder tree"):
        load_recipe(path)


def test_include_cycle_is_reported_with_its_path(write):
    write("a.yaml", "kind: modules\ninclude: [b.yaml]\nmodules: {}\n")
    write("b.yaml", "kind: modules\ninclude: [a.yaml]\nmodules: {}\n")
    path, _ = write("r.yaml", MODEL.replace("name: t\n", "name: t\ninclude: [a.yaml]\n"))
    with pytest.raises(RecipeError, match=r"b\.yaml:2:11: include cycle: a\.yaml -> b\.yaml -> a\.yaml"):
        load_recipe(path)


def test_module_reference_cycle_is_reported_with_its_path(write, position):
    path, text = write(
        "r.yaml",
        """
        kind: model
        name: t
        root: top
        modules:
          top:
            submodules: {body: a}
            forward: return 1
          a:
            submodules: {inner: b}
            forward: return 1
          b:
            submodules: {back: a}
            forward: return 1
    """,
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert (
        f"r.yaml:{position(text, 'back')}: module reference cycle: a (submodule 'inner') -> b (submodule "
        f"'back') -> a" in message
    )


def test_unknown_module_reference(write, position):
    path, text = write(
        "r.yaml",
        MODEL.replace(
            "modules:\n", "root: top\nmodules:\n  top:\n    submodules: {n: nrom}\n    forward: return 1\n"
        ),
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert (
        f"r.yaml:{position(text, 'nrom')}: submodule 'n' of module 'top' uses unknown module 'nrom' (did you "
        f"mean 'norm'?)" in str(info.value)
    )


PIPELINE = """
kind: pipeline
name: p
params: {steps: 4, guidance: 4.0}
models:
  denoiser: {recipe: model.yaml, weights: transformer, set: {hidden: 8}}
inputs:
  prompt: {type: str}
tokenizer: {path: tokenizer, chat_template: "[INST]{{ messages[-1]['content'][0]['text'] }}[/INST]", system: Be brief.}
scheduler: {config: scheduler/scheduler_config.json}
stages:
  - {name: encode, run: tokenize, inputs: {text: prompt}, outputs: {ids: tokens}}
  - {name: noise, run: full, inputs: {value: 0.0}, outputs: {value: latents}}
  - name: denoise
    loop: {over: steps, var: t, carry: [latents]}
    steps:
      - {name: velocity, model: denoiser, inputs: {x: tokens * guidance}, outputs: {output: v}}
      - name: step
        run: scheduler_step
        inputs: {sample: latents, model_output: v}
        outputs: {prev: latents}
outputs: {image: latents}
"""


def test_pipeline_schema_validates_models_and_wiring(write):
    write("model.yaml", MODEL)
    path, _ = write("p.yaml", PIPELINE)
    report = validate(path)
    assert "valid pipeline recipe 'p'" in str(report)
    assert any(line.startswith("denoiser:") for line in report.checks)


@pytest.mark.parametrize(
    "old, new, phrase",
    [
        ("model: denoiser", "model: denoise", "runs unknown model 'denoise' (did you mean 'denoiser'?)"),
        (
            "tokens * guidance",
            "tokns * guidance",
            "'tokns' is not defined before this point (did you mean 'tokens'?)",
        ),
        ("set: {hidden: 8}", "set: {hiden: 8}", "unknown parameter 'hiden' (did you mean 'hidden'?)"),
        ("recipe: model.yaml", "recipe: ../model.yaml", "outside this recipe's folder tree"),
        ("run: tokenize,", "run: tokenize, model: denoiser,", "a stage does exactly one thing"),
    ],
)
def test_pipeline_errors(write, old, new, phrase):
    write("model.yaml", MODEL)
    path, _ = write("sub/p.yaml", PIPELINE.replace(old, new))
    write("sub/model.yaml", MODEL)
    with pytest.raises(RecipeError) as info:
        validate(path)
    assert phrase in str(info.value)


def test_json_schema_covers_both_kinds():
    schema = json_schema()
    text = json.dumps(schema)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert set(schema["discriminator"]["mapping"]) == {"model", "pipeline"}
    for name in (
        "ModelRecipe",
        "PipelineRecipe",
        "ModuleSpec",
        "WeightsSection",
        "QuantizationSpec",
        "StageSpec",
    ):
        assert name in schema["$defs"]
    assert schema["$defs"]["ModuleSpec"]["additionalProperties"] is False
    assert "hf://org/repo" in text
