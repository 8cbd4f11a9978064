"""Elementwise ops against torch: math, activations, min/max, where, comparisons; views, dtypes, symbolic
dims."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ml_dtypes import bfloat16

from luminal_recipes import ops

DTYPES = ("f32", "f16", "bf16")


def _positive(rng, shape):
    return rng.uniform(0.05, 4.0, shape)


def _normal(rng, shape):
    return rng.standard_normal(shape) * 2.0


def _nonzero(rng, shape):
    x = rng.uniform(0.2, 3.0, shape)
    return x * rng.choice([-1.0, 1.0], shape)


# name -> (our op, torch reference, input domain)
UNARY = {
    "exp": (ops.exp, torch.exp, _normal),
    "exp2": (ops.exp2, torch.exp2, _normal),
    "log": (ops.log, torch.log, _positive),
    "log2": (ops.log2, torch.log2, _positive),
    "sqrt": (ops.sqrt, torch.sqrt, _positive),
    "rsqrt": (ops.rsqrt, torch.rsqrt, _positive),
    "recip": (ops.recip, torch.reciprocal, _nonzero),
    "sin": (ops.sin, torch.sin, _normal),
    "cos": (ops.cos, torch.cos, _normal),
    "tanh": (ops.tanh, torch.tanh, _normal),
    "sigmoid": (ops.sigmoid, torch.sigmoid, _normal),
    "silu": (ops.silu, F.silu, _normal),
    "gelu": (ops.gelu, F.gelu, _normal),
    "gelu_tanh": (
        lambda x: ops.gelu(x, approximate="tanh"),
        lambda x: F.gelu(x, approximate="tanh"),
        _normal,
    ),
    "erf": (ops.erf, torch.erf, _normal),
    "relu": (ops.relu, F.relu, _normal),
    "abs": (ops.abs, torch.abs, _normal),
    "sign": (ops.sign, torch.sign, _normal),
    "square": (ops.square, torch.square, _normal),
    "clamp": (lambda x: ops.clamp(x, -0.5, 1.25), lambda x: torch.clamp(x, -0.5, 1.25), _normal),
}


@pytest.fixture
def np_dtypes():
    return {"f32": np.float32, "f16": np.float16, "bf16": bfloat16}


def _as(values: np.ndarray, dtype: str, np_dtypes) -> np.ndarray:
    """The graph input: ``values`` rounded to ``dtype`` (the reference then reads exactly these values)."""
    return values.astype(np_dtypes[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_matches_torch(name, dtype, run_op, assert_close, rng, np_dtypes):
    ours, ref, domain = UNARY[name]
    x = _as(domain(rng, (3, 17)), dtype, np_dtypes)
    got = run_op(ours, x)
    want = ref(torch.from_numpy(x.astype(np.float64)))
    assert_close("elementwise", got, want, dtype)


@pytest.mark.parametrize("p", [0, 1, 2, 3, 0.5, 2.5, -1.5])
def test_pow_matches_torch(p, run_op, assert_close, rng):
    x = _positive(rng, (7, 3)).astype(np.float32)
    assert_close(
        "elementwise", run_op(lambda t: ops.pow(t, p), x), torch.from_numpy(x.astype(np.float64)) ** p
    )


def test_pow_integer_exponent_takes_negative_bases(run_op, assert_close, rng):
    x = _normal(rng, (17,)).astype(np.float32)
    assert_close(
        "elementwise", run_op(lambda t: ops.pow(t, 3), x), torch.from_numpy(x.astype(np.float64)) ** 3
    )


@pytest.mark.parametrize("kind", ["contiguous", "transposed", "sliced", "padded", "broadcast"])
@pytest.mark.parametrize("name", ["exp", "tanh", "silu", "gelu", "relu", "abs"])
def test_unary_on_views(name, kind, run_op, assert_close, rng, viewed):
    ours, ref, _ = UNARY[name]
    v = viewed(kind, (3, 7), rng)
    got = run_op(ours, v)
    assert_close("elementwise", got, ref(torch.from_numpy(v.value.astype(np.float64))))


@pytest.mark.parametrize("kinds", [("transposed", "sliced"), ("padded", "broadcast"), ("sliced", "padded")])
def test_binary_on_views(kinds, run_op, assert_close, rng, viewed):
    a, b = (viewed(k, (3, 7), rng) for k in kinds)
    ta, tb = (torch.from_numpy(v.value.astype(np.float64)) for v in (a, b))
    assert_close("elementwise", run_op(lambda x, y: x * y + x, a, b), ta * tb + ta)
    assert_close("elementwise", run_op(ops.maximum, a, b), torch.maximum(ta, tb))
    assert_close("elementwise", run_op(ops.minimum, a, b), torch.minimum(ta, tb))


@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_rows(s, run_op, assert_close, rng, symbolic_input):
    """One graph shape ('s', 8), bound to several values of s."""
    x = rng.standard_normal((s, 8)).astype(np.float32)
    y = rng.standard_normal((s, 8)).astype(np.float32)
    got = run_op(
        lambda a, b: ops.silu(a) * b - a,
        symbolic_input(x, ("s", 8)),
        symbolic_input(y, ("s", 8)),
        dims={"s": s},
    )
    tx, ty = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y.astype(np.float64))
    assert_close("elementwise", got, F.silu(tx) * ty - tx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_minimum_maximum(dtype, run_op, assert_close, rng, np_dtypes):
    a = _as(_normal(rng, (7, 3)), dtype, np_dtypes)
    b = _as(_normal(rng, (7, 3)), dtype, np_dtypes)
    b[0] = a[0]  # ties
    ta, tb = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
    assert_close("elementwise", run_op(ops.maximum, a, b), torch.maximum(ta, tb), dtype)
    assert_close("elementwise", run_op(ops.minimum, a, b), torch.minimum(ta, tb), dtype)


def test_maximum_with_infinities(run_op, assert_close):
    a = np.array([-np.inf, np.inf, 1.0, -2.0], dtype=np.float32)
    b = np.array([0.0, 3.0, np.inf, -np.inf], dtype=np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_close("elementwise", run_op(ops.maximum, a, b), torch.maximum(ta, tb))
    assert_close("elementwise", run_op(ops.minimum, a, b), torch.minimum(ta, tb))


def test_where_selects_exactly(run_op, assert_close, rng):
    cond = rng.random((3, 7)) < 0.5
    a = _normal(rng, (3, 7)).astype(np.float32)
    b = np.full((3, 7), np.inf, dtype=np.float32)  # an inf in the unselected branch must not leak
    got = run_op(ops.where, cond, a, b)
    want = torch.where(torch.from_numpy(cond), torch.from_numpy(a), torch.from_numpy(b))
    assert_close("elementwise", got, want)
    got_scalar = run_op(lambda c, x: ops.where(c, x, -1.5), cond, a)
    assert_close("elementwise", got_scalar, torch.where(torch.from_numpy(cond), torch.from_numpy(a), -1.5))


def test_where_broadcasts_a_condition_view(run_op, assert_close, rng):
    cond = rng.random((1, 7)) < 0.5
    a, b = (_normal(rng, (3, 7)).astype(np.float32) for _ in range(2))
    got = run_op(lambda c, x, y: ops.where(c.broadcast_to((3, 7)), x, y), cond, a, b)
    want = torch.where(torch.from_numpy(cond), torch.from_numpy(a), torch.from_numpy(b))
    assert_close("elementwise", got, want)


COMPARISONS = {
    "less": (ops.less, torch.lt),
    "greater": (ops.greater, torch.gt),
    "less_equal": (ops.less_equal, torch.le),
    "greater_equal": (ops.greater_equal, torch.ge),
    "equal": (ops.equal, torch.eq),
    "not_equal": (ops.not_equal, torch.ne),
}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i32"])
@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_comparisons(name, dtype, run_op, assert_close, rng, np_dtypes):
    ours, ref = COMPARISONS[name]
    # small integers so that ties (equal elements) occur often
    a, b = (rng.integers(-3, 4, (7, 3)) for _ in range(2))
    npd = np.int32 if dtype == "i32" else np_dtypes[dtype]
    a, b = a.astype(npd), b.astype(npd)
    got = run_op(ours, a, b)
    assert got.dtype == np.bool_
    want = ref(torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64)))
    assert_close("compare", got, want, "bool")
    got_scalar = run_op(lambda x: ours(x, 1), a)
    assert_close("compare", got_scalar, ref(torch.from_numpy(a.astype(np.float64)), 1.0), "bool")


def test_logical_ops(run_op, assert_close, rng):
    a, b = rng.random((3, 7)) < 0.5, rng.random((3, 7)) < 0.5
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_close("compare", run_op(ops.logical_and, a, b), ta & tb, "bool")
    assert_close("compare", run_op(ops.logical_or, a, b), ta | tb, "bool")
    assert_close("compare", run_op(ops.logical_not, a), ~ta, "bool")


INTEGER_OPS = {
    "maximum": (lambda a, b: ops.maximum(a, b), torch.maximum),
    "minimum": (lambda a, b: ops.minimum(a, b), torch.minimum),
    "abs": (lambda a, b: ops.abs(a), lambda a, b: torch.abs(a)),
    "sign": (lambda a, b: ops.sign(a), lambda a, b: torch.sign(a)),
    "where": (lambda a, b: ops.where(ops.less(a, b), a, b), lambda a, b: torch.where(a < b, a, b)),
    "sum": (lambda a, b: ops.sum(a, -1), lambda a, b: torch.sum(a, -1)),
    "max": (lambda a, b: ops.max(a, 0), lambda a, b: torch.amax(a, 0)),
    "min": (lambda a, b: ops.min(a, 0), lambda a, b: torch.amin(a, 0)),
    "argmax": (lambda a, b: ops.argmax(a, -1), lambda a, b: torch.argmax(a, -1)),
    "concat": (lambda a, b: ops.concat([a, b], 0), lambda a, b: torch.cat([a, b], 0)),
    "mod": (lambda a, b: a % b, torch.fmod),
}


@pytest.mark.parametrize("name", sorted(INTEGER_OPS))
def test_integer_inputs(name, run_op, assert_close, rng):
    """Ops that accept i32 compute exactly on it (no float detour that could round large values)."""
    ours, ref = INTEGER_OPS[name]
    a = rng.integers(-(2**24) - 9, 2**24 + 9, (3, 7)).astype(np.int32)  # beyond f32's exact integers
    b = rng.integers(1, 50, (3, 7)).astype(np.int32)
    got = run_op(ours, a, b)
    assert got.dtype in (np.int32, np.bool_)
    assert_close("index", got, ref(torch.from_numpy(a), torch.from_numpy(b)).long(), "i32")
