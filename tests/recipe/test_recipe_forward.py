"""The forward language: what it accepts, and each rejection located at file:line:col in the YAML file."""

from __future__ import annotations

import textwrap

import pytest

from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe.commands import validate

TEMPLATE = """\
kind: model
name: t
params: {{hidden: 8, layers: 3, every: 2}}
dims: [seq]
inputs:
  x: {{shape: [seq, hidden]}}
modules:
  m:
    inputs: [x]
    options: {{scale: 1.0}}
    weights:
      w: [hidden, hidden]
      norm.weight: [hidden]
    submodules:
      blocks: {{module: block, repeat: layers}}
      head: block
    forward: |
{body}
  block:
    inputs: [x]
    options: {{window: null}}
    weights:
      weight: [hidden]
    forward: return rms_norm(x, self.weight)
"""


def recipe(write, body: str):
    body = textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 6)
    return write("r.yaml", TEMPLATE.format(body=body))


def error_of(write, body: str) -> tuple[str, str]:
    path, text = recipe(write, body)
    with pytest.raises(RecipeError) as info:
        validate(path)
    return str(info.value), text


def test_valid_forward_with_loops_conditionals_and_submodules(write, position):
    path, _ = recipe(
        write,
        """
        h = linear(x, self.w)
        a, b = h, x
        for i in range(layers):
            window = 4 if i % every == 0 else None
            h = self.blocks[i](h, window=window)
        if layers > 2 and not False:
            h = h + a * scale
        else:
            h = h - b
        n = shape(h)[0]
        return self.head(rms_norm(h, self.norm.weight)), n
    """,
    )
    report = validate(path)
    assert "valid model recipe" in str(report)


@pytest.mark.parametrize(
    "body, needle, phrase",
    [
        ("import os\nreturn x", "import os", "imports are not allowed"),
        ("from os import path\nreturn x", "from os", "imports are not allowed"),
        ("f = lambda y: y\nreturn x", "lambda", "write a module under `modules:`"),
        ("ys = [y for y in range(3)]\nreturn x", "[y for", "use a `for i in range(n):` loop"),
        ("while True:\n    pass\nreturn x", "while", "for i in range(n)"),
        ("y = x.__class__\nreturn x", "x.__class__", "attributes starting with '_'"),
        ("y = x.shape\nreturn x", "x.shape", "only allowed on self"),
        ("y = __import__('os')\nreturn x", "__import__", "names starting with '__'"),
        ("def f(y):\n    return y\nreturn x", "def f", "function definitions are not allowed"),
        ("y = {'a': 1}\nreturn x", "{'a'", "dict literals are not allowed"),
        ("y = x[0:2]\nreturn x", "0:2", "use narrow(x, axis, start, stop)"),
        ("y = f'{x}'\nreturn x", "f'{x}'", "f-strings are not allowed"),
        ("linear(x, self.w)\nreturn x", "linear(x, self.w)", "assign it"),
        ("try:\n    y = x\nexcept Exception:\n    y = x\nreturn y", "try:", "try/except is not allowed"),
        ("y = linear(x, self.w)", "y = linear", "must end with `return"),
    ],
)
def test_forbidden_syntax_is_located_with_an_alternative(write, position, body, needle, phrase):
    message, text = error_of(write, body)
    assert (
        message.startswith(f"r.yaml:{position(text, needle)}:")
        or f"r.yaml:{position(text, needle)}:" in message
    )
    assert phrase in message


def test_undefined_name_points_inside_the_block_scalar(write, position):
    message, text = error_of(
        write,
        """
        h = linear(x, self.w)
        return linear(hh, self.w)
    """,
    )
    assert f"r.yaml:{position(text, 'hh')}: undefined name 'hh' (did you mean 'h'?)" in message


def test_unknown_op_with_did_you_mean(write, position):
    message, text = error_of(write, "return lienar(x, self.w)")
    assert f"r.yaml:{position(text, 'lienar')}: unknown op 'lienar' (did you mean 'linear'?)" in message


def test_eval_and_open_are_not_functions_of_the_language(write, position):
    for name in ("eval", "exec", "open", "getattr"):
        message, text = error_of(write, f"y = {name}('1')\nreturn x")
        assert f"r.yaml:{position(text, name + '(')}: unknown op '{name}'" in message


def test_unknown_member_of_self(write, position):
    message, text = error_of(write, "return linear(x, self.wieght)")
    assert f"r.yaml:{position(text, 'self.wieght')}: 'self' has no weight or submodule 'wieght'" in message


def test_repeated_submodule_must_be_indexed_and_arity_checked(write, position):
    message, text = error_of(write, "return self.blocks(x)")
    assert position(text, "self.blocks") in message and "self.blocks[i](...)" in message
    message, text = error_of(write, "return self.head(x, x)")
    assert (
        position(text, "self.head(x, x)") in message and "takes 1 positional input(s) (x), got 2" in message
    )
    message, text = error_of(write, "return self.head(x, windw=2)")
    assert (
        position(text, "windw=2") in message and "has no option 'windw' (did you mean 'window'?)" in message
    )


def test_name_assigned_in_one_branch_only_is_undefined_after(write, position):
    message, text = error_of(
        write,
        """
        if layers > 2:
            y = x
        return y
    """,
    )
    assert (
        f"r.yaml:{position(text, 'return y').split(':')[0]}:" in message and "undefined name 'y'" in message
    )


def test_syntax_error_in_forward_is_located(write, position):
    message, text = error_of(write, "y = linear(x,, self.w)\nreturn y")
    assert (
        f"r.yaml:{position(text, 'y = linear').split(':')[0]}:" in message
        and "syntax error in forward" in message
    )


def test_one_line_forward_maps_columns(write, position):
    path, text = write(
        "one.yaml",
        """
        kind: model
        name: t
        params: {hidden: 8}
        inputs: {x: {shape: [2, hidden]}}
        modules:
          m:
            inputs: [x]
            forward: return rms_nrm(x)
    """,
    )
    with pytest.raises(RecipeError) as info:
        validate(path)
    assert f"one.yaml:{position(text, 'rms_nrm')}: unknown op 'rms_nrm'" in str(info.value)


def test_language_functions_match_what_the_interpreter_provides():
    from luminal_recipes.graph import Graph
    from luminal_recipes.recipe.expr import BUILTINS
    from luminal_recipes.recipe.interpreter import NUMERIC, movement_functions

    assert set(movement_functions(Graph())) | set(NUMERIC) | {"range"} == BUILTINS
