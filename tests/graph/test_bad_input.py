"""Bad input: each mistake raises its own LuminalError subclass, naming the op, the shapes and the fix.
HLIR never broadcasts or promotes silently."""

from __future__ import annotations

import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.errors import (
    BroadcastError,
    DTypeError,
    GraphError,
    InputError,
    LuminalError,
    ShapeError,
    SliceError,
    UnboundDimError,
)
from luminal_recipes.graph import Graph, run_reference, to_dtype


@pytest.fixture
def g():
    return Graph()


def _x(g, shape=(3, 4), dtype="f32", name="x"):
    return g.input(name, shape, dtype)


# (what is wrong, how to do it, exception class, fragments the message must contain: op, shapes, fix)
CASES = [
    (
        "negative dimension",
        lambda g: g.input("x", (-1, 3)),
        ShapeError,
        ["input 'x'", "(-1, 3)", "sizes are >= 0"],
    ),
    ("non-integer dimension", lambda g: g.weight("w", (2.5, 3)), ShapeError, ["2.5", "int"]),
    (
        "unparsable symbolic dimension",
        lambda g: g.input("x", ("2 ** s", 3)),
        ShapeError,
        ["2 ** s", "+ - * // %"],
    ),
    (
        "dtype mismatch in a binary op",
        lambda g: _x(g) + _x(g, dtype="f16", name="y"),
        DTypeError,
        ["Add", "f32", "f16", "never promotes", "cast"],
    ),
    (
        "dtype mismatch in matmul",
        lambda g: ops.matmul(_x(g), _x(g, (4, 2), "bf16", "y")),
        DTypeError,
        ["matmul", "(3, 4)", "(4, 2)", "bf16", "cast"],
    ),
    (
        "dtype mismatch in concat",
        lambda g: ops.concat([_x(g), _x(g, dtype="f16", name="y")]),
        DTypeError,
        ["concat", "f32", "f16", "(3, 4)", "cast"],
    ),
    (
        "non-bool condition",
        lambda g: ops.where(_x(g), _x(g, name="a"), 0.0),
        DTypeError,
        ["where", "(3, 4)", "bool", "f32"],
    ),
    ("math on integers", lambda g: ops.exp(_x(g, dtype="i32")), DTypeError, ["Exp2", "i32", "cast"]),
    ("reducing booleans", lambda g: ops.sum(_x(g, dtype="bool")), DTypeError, ["SumReduce", "bool", "cast"]),
    ("unknown dtype", lambda g: to_dtype("f128"), DTypeError, ["f128", "f32, f64, f16, bf16"]),
    (
        "unbroadcast binary op",
        lambda g: _x(g) + _x(g, (4,), name="y"),
        BroadcastError,
        ["Add", "(3, 4)", "(4,)", "broadcast_to"],
    ),
    (
        "size-1 axis not stretched",
        lambda g: _x(g) * _x(g, (3, 1), name="y"),
        BroadcastError,
        ["Mul", "(3, 4)", "(3, 1)", "broadcast_to"],
    ),
    (
        "different symbolic dims",
        lambda g: _x(g, ("s", 4)) + _x(g, ("p", 4), name="y"),
        BroadcastError,
        ["Add", "(s, 4)", "(p, 4)"],
    ),
    (
        "impossible broadcast",
        lambda g: _x(g).broadcast_to((2, 3, 5)),
        BroadcastError,
        ["broadcast_to", "(3, 4)", "(2, 3, 5)", "axis 2"],
    ),
    (
        "slice past the end",
        lambda g: _x(g).slice(0, 1, 10),
        SliceError,
        ["slice", "[1:10]", "(3, 4)", "0 <= start <= stop <= 3"],
    ),
    ("slice start after stop", lambda g: _x(g).slice(1, 3, 2), SliceError, ["slice", "[3:2]", "(3, 4)"]),
    ("slice with step 0", lambda g: _x(g).slice(0, 0, 2, 0), SliceError, ["slice", "step", "(3, 4)"]),
    (
        "reshape with the wrong element count",
        lambda g: _x(g).reshape(5, 2),
        ShapeError,
        ["reshape", "(3, 4)", "(5, 2)", "12", "10", "must agree"],
    ),
    (
        "matmul inner-dimension mismatch",
        lambda g: ops.matmul(_x(g), _x(g, name="y")),
        ShapeError,
        ["matmul", "(3, 4)", "4 != 3", "transpose"],
    ),
    (
        "matmul batch mismatch",
        lambda g: ops.matmul(_x(g, (2, 3, 4)), _x(g, (3, 4, 5), name="y")),
        ShapeError,
        ["matmul", "(2, 3, 4)", "(3, 4, 5)", "equal or 1"],
    ),
    ("squeezing a real axis", lambda g: _x(g).squeeze(0), ShapeError, ["squeeze", "(3, 4)", "not 1"]),
    (
        "permutation that repeats an axis",
        lambda g: _x(g).permute(0, 0),
        ShapeError,
        ["permute", "(0, 0)", "(3, 4)"],
    ),
    ("axis out of range", lambda g: ops.softmax(_x(g), 2), ShapeError, ["softmax", "axis 2", "(3, 4)"]),
    ("negative padding", lambda g: _x(g).pad(0, -1, 0), ShapeError, ["pad", ">= 0", "slice"]),
    (
        "split sizes that do not add up",
        lambda g: ops.split(_x(g), [1, 1], 0),
        ShapeError,
        ["split", "[1, 1]", "(3, 4)"],
    ),
    ("uneven chunks", lambda g: ops.chunk(_x(g), 3, 1), ShapeError, ["chunk", "(3, 4)", "3 chunks"]),
    (
        "concat of mismatched shapes",
        lambda g: ops.concat([_x(g), _x(g, (4, 4), name="y")], 1),
        ShapeError,
        ["concat", "(3, 4)", "(4, 4)", "axis 1"],
    ),
    (
        "attention on 2-D tensors",
        lambda g: ops.scaled_dot_product_attention(_x(g), _x(g, name="k"), _x(g, name="v")),
        ShapeError,
        ["attention", "[B, H, S, D]", "(3, 4)"],
    ),
    (
        "conv channel mismatch",
        lambda g: ops.conv2d(_x(g, (1, 3, 5, 5)), _x(g, (2, 4, 3, 3), name="w")),
        ShapeError,
        ["conv2d", "3 channels", "4"],
    ),
    (
        "group norm with uneven groups",
        lambda g: ops.group_norm(_x(g, (1, 6, 2)), 4),
        ShapeError,
        ["group_norm", "6 channels", "4 groups"],
    ),
    (
        "norm weight of the wrong size",
        lambda g: ops.layer_norm(_x(g), _x(g, (3,), name="w")),
        ShapeError,
        ["norm", "(3,)", "(4,)"],
    ),
    ("top-k larger than the axis", lambda g: ops.topk(_x(g), 5), ShapeError, ["topk", "k=5", "1..4"]),
    (
        "unknown gelu variant",
        lambda g: ops.gelu(_x(g), "fast"),
        GraphError,
        ["gelu", "'none' or 'tanh'", "'fast'"],
    ),
    (
        "unknown rope convention",
        lambda g: ops.apply_rope(_x(g), _x(g, name="c"), _x(g, name="s"), "interleaved"),
        GraphError,
        ["apply_rope", "'half'", "'pairs'"],
    ),
    ("tensors of two graphs", lambda g: _x(g) + _x(Graph()), GraphError, ["Add", "different graphs"]),
    ("name declared twice", lambda g: (_x(g), _x(g)), GraphError, ["'x'", "twice"]),
]


@pytest.mark.parametrize(("what", "build", "error", "fragments"), CASES, ids=[c[0] for c in CASES])
def test_bad_graph_construction(what, build, error, fragments, g):
    with pytest.raises(error) as info:
        build(g)
    assert isinstance(info.value, LuminalError)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{what}: {fragment!r} missing from: {message}"


def _symbolic_graph():
    g = Graph()
    x = g.input("tokens", ("s", 4))
    g.mark_output("y", x * 2.0)
    return g


def test_unbound_symbolic_dim_at_run_time():
    with pytest.raises(UnboundDimError) as info:
        run_reference(_symbolic_graph(), {"tokens": np.zeros((3, 4), np.float32)})
    message = str(info.value)
    for fragment in ("'tokens'", "(s, 4)", "dims={'s': ...}"):
        assert fragment in message, message


@pytest.mark.parametrize(
    ("feed", "fragments"),
    [
        ({"tokens": np.zeros((3, 5), np.float32)}, ["'tokens'", "(3, 5)", "(s, 4) = (3, 4)"]),
        ({"tokens": np.zeros((3, 4), np.float64)}, ["'tokens'", "float64", "f32", "convert"]),
        ({}, ["'tokens'", "not provided", "inputs"]),
    ],
)
def test_bad_run_inputs(feed, fragments):
    with pytest.raises(InputError) as info:
        run_reference(_symbolic_graph(), feed, dims={"s": 3})
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_no_silent_broadcast_or_promotion_for_python_scalars():
    """A Python number is lifted to an explicit broadcast constant of the tensor's own dtype."""
    g = Graph()
    y = g.input("x", (2, 3), "f16") * 3.0
    assert y.dtype.value == "f16"
    consts = [n for n in g.nodes if n.op == "Constant"]
    assert len(consts) == 1 and consts[0].dtype.value == "f16" and consts[0].shape == ()
