"""The reference interpreter, primitive by primitive, against torch; its f64 mode; low-precision rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ml_dtypes import bfloat16

from luminal_recipes import ops
from luminal_recipes.graph import Graph, binary, cast, gather, reduce, run_reference, scatter, unary


def _run(build, feed: dict, mode: str = "native", dims=None) -> np.ndarray:
    g = Graph()
    tensors = {name: g.input(name, value.shape, value.dtype) for name, value in feed.items()}
    g.mark_output("y", build(g, **tensors))
    return run_reference(g, feed, dims=dims, mode=mode)["y"]


@pytest.fixture
def x():
    return np.random.default_rng(0).uniform(0.1, 4.0, (3, 7)).astype(np.float32)


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        ("Log2", torch.log2),
        ("Exp2", torch.exp2),
        ("Sin", torch.sin),
        ("Sqrt", torch.sqrt),
        ("Recip", torch.reciprocal),
    ],
)
def test_unary_primitives(op, ref, x, assert_close):
    assert_close("elementwise", _run(lambda g, a: unary(op, a), {"a": x}), ref(torch.from_numpy(x).double()))


@pytest.mark.parametrize(
    ("op", "ref"), [("Add", torch.add), ("Mul", torch.mul), ("Mod", torch.fmod), ("LessThan", torch.lt)]
)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_binary_primitives(op, ref, dtype, assert_close):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((4, 5)) * 6).astype(dtype)
    b = (rng.standard_normal((4, 5)) * 3).astype(dtype)
    b[b == 0] = 1  # fmod by 0 is not a test of anything
    got = _run(lambda g, a, b: binary(op, a, b), {"a": a, "b": b})
    want = ref(torch.from_numpy(a).double(), torch.from_numpy(b).double())
    assert_close(
        "compare" if op == "LessThan" else "elementwise", got, want, "bool" if op == "LessThan" else "f32"
    )


def test_mod_truncates_like_c(assert_close):
    """Mod follows C's fmod (the sign of the dividend), not Python's floor modulo."""
    a = np.array([-7, 7, -7, 7], np.int32)
    b = np.array([3, -3, -3, 3], np.int32)
    got = _run(lambda g, a, b: a % b, {"a": a, "b": b})
    assert got.tolist() == [-1, 1, -1, 1]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reduce_primitives(axis, assert_close):
    a = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    ta = torch.from_numpy(a).double()
    assert_close("reduce", _run(lambda g, a: reduce("SumReduce", a, axis), {"a": a}), ta.sum(axis))
    assert_close("reduce", _run(lambda g, a: reduce("MaxReduce", a, axis), {"a": a}), ta.amax(axis))


def test_max_reduce_over_an_empty_axis_is_minus_infinity():
    a = np.zeros((3, 4), np.float32)
    got = _run(lambda g, a: reduce("MaxReduce", a.slice(1, 2, 2), 1), {"a": a})
    assert got.tolist() == [-np.inf] * 3


def test_iota_gather_scatter_cast_constant(assert_close):
    table = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    idx = np.array([4, 0, 0, 2], np.int32)
    got = _run(lambda g, t, i: gather(t, i), {"t": table, "i": idx})
    assert_close("index", got, torch.from_numpy(table)[torch.from_numpy(idx).long()])
    rows = np.ones((2, 3), np.float32)
    got = _run(lambda g, t, r: scatter(t, g.iota(2) * 2, r), {"t": table, "r": rows})
    want = torch.from_numpy(table).index_copy(0, torch.tensor([0, 2]), torch.from_numpy(rows))
    assert_close("index", got, want)
    got = _run(lambda g, i: cast(g.iota(4), "f32") + g.constant(np.array([0.5, 1, 2, 3])), {"i": idx})
    assert_close("index", got, torch.arange(4) + torch.tensor([0.5, 1, 2, 3]))


def test_f64_mode_removes_rounding(assert_close):
    """One bf16 graph: native mode rounds every node to bf16, f64 mode computes exactly (vs torch f64)."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(bfloat16) for _ in range(3))
    feed = {"q": q, "k": k, "v": v}

    def build(g, q, k, v):
        return ops.scaled_dot_product_attention(q, k, v, causal=True)

    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a.astype(np.float64)) for a in (q, k, v)), is_causal=True
    )
    exact = _run(build, feed, mode="f64")
    assert exact.dtype == np.float64
    np.testing.assert_allclose(exact, want.numpy(), rtol=1e-12, atol=1e-12)
    native = _run(build, feed)
    assert native.dtype == bfloat16
    assert not np.allclose(native.astype(np.float64), want.numpy(), rtol=1e-6, atol=1e-6)
    assert_close("attention", native, want, "bf16")


def test_fp8_nodes_are_rounded_after_each_op():
    """f8 arithmetic is held in f32 but rounded to the f8 grid after every op, as a device stores it."""
    a = np.array([1.0, 1.125, 448.0], dtype=np.float32)
    b = np.full(3, 1.125, dtype=np.float32)
    got = _run(lambda g, a, b: (a.cast("f8e4m3") * b.cast("f8e4m3")).cast("f32"), {"a": a, "b": b})
    # 1.125 * 1.125 = 1.265625 lies between the e4m3 neighbours 1.25 and 1.375; 504 overflows e4m3fn (NaN)
    assert got[:2].tolist() == [1.125, 1.25]
    assert np.isnan(got[2])
