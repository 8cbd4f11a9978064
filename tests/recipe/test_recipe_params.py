"""Parameters: defaults, ${...} expressions over config.json and other parameters, types, --set overrides."""

from __future__ import annotations

import pytest

from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe.builder import resolve_params
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.recipe.params import ParamResolver

CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "rope_parameters": {"rope_theta": 500000.0},
    "text_config": {"num_hidden_layers": 40, "layer_types": ["sliding", "full"]},
    "rms_norm_eps": 1e-5,
}

PARAMS = """
kind: model
name: t
params:
  hidden: ${config.hidden_size}
  heads: ${config.num_attention_heads}
  head_dim: ${hidden // heads}
  theta: ${config.get('rope_parameters.rope_theta', 10000.0)}
  missing_ok: ${config.get('sliding_window', None)}
  depth: ${config.text_config.num_hidden_layers}
  first_type: ${config.text_config.layer_types[0]}
  taps: {type: "list[int]", default: [10, 20, 30]}
  deepest: ${max(taps) + 1}
  eps: ${config.rms_norm_eps}
  scale: ${head_dim ** -0.5}
  use_bias: false
  mode: {default: fast, choices: [fast, exact]}
  window: {type: int | None, default: null}
modules:
  m:
    forward: return 1
"""


def resolved(write, text=PARAMS, config=CONFIG, sets=()):
    path, _ = write("r.yaml", text)
    return resolve_params(load_recipe(path), config, sets)


def test_expressions_over_config_and_params(write):
    params = resolved(write)
    assert params.values == {
        "hidden": 64,
        "heads": 4,
        "head_dim": 16,
        "theta": 500000.0,
        "missing_ok": None,
        "depth": 40,
        "first_type": "sliding",
        "taps": [10, 20, 30],
        "deepest": 31,
        "eps": 1e-5,
        "scale": 0.25,
        "use_bias": False,
        "mode": "fast",
        "window": None,
    }
    assert str(params.types["taps"]) == "list[int]" and str(params.types["head_dim"]) == "int"
    assert params.origins["hidden"] == "config" and params.origins["use_bias"] == "default"


def test_set_overrides_are_typed(write):
    params = resolved(
        write, sets=["heads=8", "taps=[1, 2]", "use_bias=true", "mode=exact", "window=512", "eps=1e-6"]
    )
    assert params["head_dim"] == 8 and params["taps"] == [1, 2] and params["deepest"] == 3
    assert params["use_bias"] is True and params["window"] == 512 and params["eps"] == 1e-6
    assert params.origins["heads"] == "--set"
    assert resolved(write, sets=["taps=4,5,6", "window=none"]).values["taps"] == [4, 5, 6]
    assert resolved(write, sets={"heads": 2}).values["head_dim"] == 32


@pytest.mark.parametrize(
    "sets, phrase",
    [
        (["hiden=3"], "--set hiden=...: unknown parameter 'hiden' (did you mean 'hidden'?)"),
        (["heads=four"], "--set heads=four: parameter 'heads' is int"),
        (["heads=2.5"], "--set heads=2.5: parameter 'heads' is int"),
        (["use_bias=maybe"], "--set use_bias=maybe: parameter 'use_bias' is bool"),
        (["taps=[1, x]"], "parameter 'taps' is list[int]"),
        (["mode=slow"], "--set mode=slow: must be one of ['fast', 'exact']"),
        (["heads"], "expected name=value"),
    ],
)
def test_bad_overrides(write, sets, phrase):
    with pytest.raises(RecipeError) as info:
        resolved(write, sets=sets)
    assert phrase in str(info.value)


def test_overrides_are_checked_without_a_config(write):
    path, _ = write("r.yaml", PARAMS)
    recipe = load_recipe(path)
    ParamResolver(recipe.params, None, ["taps=[1,2]"]).check_static()
    with pytest.raises(RecipeError, match="parameter 'taps' is list\\[int\\]"):
        ParamResolver(recipe.params, None, ["taps=abc"]).check_static()


def test_missing_config_key_is_located_with_suggestion(write, position):
    text = PARAMS.replace("config.num_attention_heads", "config.num_attention_head")
    path, text = write("r.yaml", text)
    with pytest.raises(RecipeError) as info:
        resolve_params(load_recipe(path), CONFIG)
    message = str(info.value)
    assert f"r.yaml:{position(text, 'config.num_attention_head')}:" in message
    assert (
        "config.json has no key 'config.num_attention_head' (did you mean 'num_attention_heads'?)" in message
    )


def test_undefined_name_in_a_parameter_is_located(write, position):
    path, text = write("r.yaml", PARAMS.replace("${hidden // heads}", "${hidden // haeds}"))
    with pytest.raises(RecipeError) as info:
        resolve_params(load_recipe(path), CONFIG)
    assert (
        f"r.yaml:{position(text, 'haeds')}: parameter 'head_dim': undefined name 'haeds' (did you mean "
        f"'heads'?)" in str(info.value)
    )
    with pytest.raises(RecipeError, match="undefined name 'haeds'"):
        ParamResolver(load_recipe(path).params, None).check_static()


def test_wrong_declared_type(write, position):
    path, text = write("r.yaml", PARAMS.replace("default: [10, 20, 30]", "default: [10, twenty]"))
    with pytest.raises(RecipeError) as info:
        resolve_params(load_recipe(path), CONFIG)
    assert (
        f"r.yaml:{position(text, '[10, twenty]')}: parameter 'taps' has the wrong type: expected int, got "
        f"'twenty'" in str(info.value)
    )


def test_parameter_cycle(write):
    text = PARAMS.replace("${config.hidden_size}", "${head_dim * heads}")
    with pytest.raises(RecipeError, match="cycle: hidden -> head_dim -> hidden"):
        resolved(write, text)


def test_parameter_expressions_are_not_python(write):
    for expr, phrase in [
        ("${__import__('os')}", "'__import__' cannot be called"),
        ("${open('/etc/passwd')}", "cannot be called"),
        ("${(1).__class__}", "only allowed on config"),
        ("${[x for x in taps]}", "is not allowed in a value expression"),
    ]:
        with pytest.raises(RecipeError, match=phrase.replace("(", r"\(")):
            resolved(write, PARAMS.replace("${max(taps) + 1}", expr))


def test_config_needed_but_absent(write):
    with pytest.raises(RecipeError, match="no checkpoint was given; pass --weights"):
        resolved(write, config=None)


BOUNDED = """
kind: model
name: t
params:
  depth: ${config.text_config.num_hidden_layers}
  taps:
    type: list[int]
    default: [1, -2]
    min: -(depth + 1)
    max: depth
    doc: indices into the hidden states
  ratio: {default: 0.5, min: 0, max: 1}
modules:
  m:
    forward: return 1
"""


def test_bounds_accept_values_inside_them(write):
    assert resolved(write, BOUNDED).values["taps"] == [1, -2]
    assert resolved(write, BOUNDED, sets=["taps=[-41, 40]", "ratio=1"]).values["taps"] == [-41, 40]


def test_a_default_outside_its_bounds_is_located_at_the_default(write, position):
    path, text = write("r.yaml", BOUNDED.replace("default: [1, -2]", "default: [1, 41]"))
    with pytest.raises(RecipeError) as info:
        resolve_params(load_recipe(path), CONFIG)
    message = str(info.value)
    assert message.startswith(f"{path}:{position(text, '[1, 41]')}: parameter 'taps' is out of range: item 41 ")
    assert f"above its maximum 40 (max: depth), declared at {path}:{position(text, 'depth', 3)}" in message
    assert "taps: indices into the hidden states." in message


@pytest.mark.parametrize(
    "sets, phrase",
    [
        (["taps=[-42]"], "--set taps=[-42]: parameter 'taps' is out of range: item -42 of [-42] is below its minimum "
                         "-41 (min: -(depth + 1))"),
        (["ratio=1.5"], "--set ratio=1.5: parameter 'ratio' is out of range: 1.5 is above its maximum 1, declared"),
        ({"taps": [50]}, "--set taps=[50]: parameter 'taps' is out of range"),
    ],
)
def test_an_override_outside_its_bounds_names_the_set(write, sets, phrase):
    with pytest.raises(RecipeError) as info:
        resolved(write, BOUNDED, sets=sets)
    assert phrase in str(info.value)


def test_an_override_from_elsewhere_names_where_it_was_written(write):
    path, _ = write("r.yaml", BOUNDED)
    with pytest.raises(RecipeError, match=r"^pipeline.yaml:7:9: models.x.set.taps: parameter 'taps' is out of range"):
        resolve_params(load_recipe(path), CONFIG, {"taps": [99]}, {"taps": "pipeline.yaml:7:9: models.x.set.taps"})


def test_bound_expressions_are_checked(write, position):
    path, text = write("r.yaml", BOUNDED.replace("max: depth", "max: dpth"))
    with pytest.raises(RecipeError, match="`max` of parameter 'taps': undefined name 'dpth'") as info:
        ParamResolver(load_recipe(path).params, None).check_static()
    assert str(info.value).startswith(f"{path}:{position(text, 'dpth')}:")
    path, _ = write("r.yaml", BOUNDED.replace("max: depth", "max: \"'deep'\""))
    with pytest.raises(RecipeError, match="`max` of parameter 'taps' must be a number, got 'deep'"):
        resolve_params(load_recipe(path), CONFIG)
