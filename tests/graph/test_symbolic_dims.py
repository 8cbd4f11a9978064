"""Symbolic dimension algebra: canonical forms, evaluation, and the str/parse round trip."""

from __future__ import annotations

import operator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_recipes.errors import ShapeError, UnboundDimError
from luminal_recipes.graph import Expr, to_dim
from luminal_recipes.graph.symbolic import evaluate, parse_dim

s, p = Expr.symbol("s"), Expr.symbol("p")


def test_canonical_forms_compare_equal():
    assert s + p == p + s
    assert hash(s + p) == hash(p + s)
    assert 2 * s == s + s
    assert s * p == p * s
    assert (s + 1) * (s - 1) == s * s - 1
    assert s - s == 0 and isinstance(s - s, int)
    assert (2 * s + 4) // 2 == s + 2
    assert (4 * s) % 2 == 0
    assert s + p != s + 2 * p
    assert to_dim("p + s") == to_dim("s+p") == s + p


def test_floor_division_and_remainder_evaluate():
    half = s // 2
    assert isinstance(half, Expr)
    assert [half.evaluate({"s": v}) for v in (0, 1, 7, 8)] == [0, 0, 3, 4]
    assert ((s + p) % 3).evaluate({"s": 5, "p": 3}) == 2
    assert (2 * (s // 2) + s % 2).evaluate({"s": 9}) == 9
    assert evaluate(to_dim("s // 2 + 1"), {"s": 17}) == 9


def test_free_symbols_and_unbound_evaluation():
    e = (s + p) // 2 * 3
    assert e.free_symbols() == {"s", "p"}
    with pytest.raises(UnboundDimError, match=r"'p'.*dims=\{'p': 16\}"):
        e.evaluate({"s": 3})


def test_substitute_partially():
    e = 2 * s + p // 2
    assert e.substitute({"p": 8}) == 2 * s + 4
    assert e.substitute({"s": p}) == 2 * p + p // 2


@pytest.mark.parametrize("text", ["s +", "s / 2", "s ** 2", "f(s)", "s // p", "1.5 * s", "s.real"])
def test_parse_rejects_unsupported_syntax(text):
    with pytest.raises(ShapeError, match="dimension"):
        parse_dim(text)


@pytest.mark.parametrize("name", ["1s", "s-p", ""])
def test_symbol_names_must_be_identifiers(name):
    with pytest.raises(ShapeError):
        Expr.symbol(name)


# ---- property: random expression trees ---------------------------------------------------------------------
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _trees(depth: int = 3):
    leaves = st.one_of(st.sampled_from(["s", "p"]), st.integers(-3, 5))
    return st.recursive(
        leaves,
        lambda sub: st.one_of(
            st.tuples(st.sampled_from(sorted(_BINARY)), sub, sub),
            st.tuples(st.sampled_from(["//", "%"]), sub, st.integers(1, 4)),
        ),
        max_leaves=6,
    )


def _build(tree):
    if isinstance(tree, str):
        return Expr.symbol(tree)
    if isinstance(tree, int):
        return tree
    op, a, b = tree
    if op in _BINARY:
        return _BINARY[op](_build(a), _build(b))
    return _build(a) // b if op == "//" else _build(a) % b


def _python(tree, env):
    if isinstance(tree, str):
        return env[tree]
    if isinstance(tree, int):
        return tree
    op, a, b = tree
    if op in _BINARY:
        return _BINARY[op](_python(a, env), _python(b, env))
    return _python(a, env) // b if op == "//" else _python(a, env) % b


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tree=_trees(), sv=st.integers(0, 40), pv=st.integers(0, 40))
def test_expressions_evaluate_like_python_and_survive_str_parse(tree, sv, pv):
    expr = _build(tree)
    env = {"s": sv, "p": pv}
    assert evaluate(expr, env) == _python(tree, env)
    back = parse_dim(str(expr))
    assert back == expr, f"{tree} printed as {str(expr)!r} parses back as {back}"
    assert evaluate(back, env) == _python(tree, env)
