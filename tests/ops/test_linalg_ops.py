"""matmul / batched matmul in all four transpose layouts with broadcast batches, and linear, against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ml_dtypes import bfloat16

from luminal_recipes import ops

NP = {"f32": np.float32, "f16": np.float16, "bf16": bfloat16}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).astype(np.float64))


def _operand(rng, batch, rows, cols, transposed, dtype="f32"):
    """A logical [*batch, rows, cols] operand; if ``transposed``, stored [*batch, cols, rows], read as .T."""
    if transposed:
        stored = rng.standard_normal(batch + (cols, rows)).astype(NP[dtype])
        return stored, np.swapaxes(stored, -1, -2)
    stored = rng.standard_normal(batch + (rows, cols)).astype(NP[dtype])
    return stored, stored


@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (3, 7, 17), (17, 3, 1), (7, 17, 3)])
def test_matmul_layouts(ta, tb, m, k, n, run_op, assert_close, rng):
    a_stored, a = _operand(rng, (), m, k, ta)
    b_stored, b = _operand(rng, (), k, n, tb)

    def build(x, y):
        return ops.matmul(x.T if ta else x, y.T if tb else y)

    assert_close("matmul", run_op(build, a_stored, b_stored), _t(a) @ _t(b))


@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(
    ("batch_a", "batch_b"), [((2, 3), (2, 3)), ((2, 1), (1, 3)), ((3,), (2, 3)), ((), (2,)), ((2, 3), ())]
)
def test_batched_matmul_broadcast(ta, tb, batch_a, batch_b, run_op, assert_close, rng):
    a_stored, a = _operand(rng, batch_a, 3, 7, ta)
    b_stored, b = _operand(rng, batch_b, 7, 5, tb)

    def build(x, y):
        return ops.bmm(x.transpose(-1, -2) if ta else x, y.transpose(-1, -2) if tb else y)

    assert_close("matmul", run_op(build, a_stored, b_stored), torch.matmul(_t(a), _t(b)))


@pytest.mark.parametrize(
    ("a_shape", "b_shape"), [((7,), (7, 3)), ((3, 7), (7,)), ((7,), (7,)), ((2, 3, 7), (7,))]
)
def test_matmul_vectors(a_shape, b_shape, run_op, assert_close, rng):
    a, b = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
    assert_close("matmul", run_op(ops.matmul, a, b), torch.matmul(_t(a), _t(b)))


@pytest.mark.parametrize("kinds", [("sliced", "padded"), ("broadcast", "transposed"), ("padded", "sliced")])
def test_matmul_on_views(kinds, run_op, assert_close, rng, viewed):
    a = viewed(kinds[0], (5, 7), rng)
    b_raw = viewed(kinds[1], (3, 7), rng)  # used as b.T: [7, 3]
    got = run_op(lambda x, y: ops.matmul(x, y.T), a, b_raw)
    assert_close("matmul", got, _t(a.value) @ _t(b_raw.value).T)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_matmul_low_precision(dtype, run_op, assert_close, rng):
    a_stored, a = _operand(rng, (2,), 5, 16, False, dtype)
    b_stored, b = _operand(rng, (2,), 16, 3, True, dtype)
    got = run_op(lambda x, y: ops.matmul(x, y.transpose(-1, -2)), a_stored, b_stored)
    assert_close("matmul", got, _t(a) @ _t(b), dtype)


@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_matmul(s, run_op, assert_close, rng, symbolic_input):
    x = rng.standard_normal((2, s, 8)).astype(np.float32)
    y = rng.standard_normal((2, 8, s)).astype(np.float32)
    got = run_op(ops.matmul, symbolic_input(x, (2, "s", 8)), symbolic_input(y, (2, 8, "s")), dims={"s": s})
    assert_close("matmul", got, _t(x) @ _t(y))


# ---- linear ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape", [(7,), (3, 7), (2, 3, 7)])
def test_linear(bias, x_shape, run_op, assert_close, rng):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    got = run_op(ops.linear, x, w, b) if bias else run_op(ops.linear, x, w)
    assert_close("matmul", got, F.linear(_t(x), _t(w), _t(b) if bias else None))


def test_linear_casts_bf16_weight_to_activation_dtype(run_op, assert_close, rng):
    """A bf16 checkpoint weight on f32 activations: an explicit Cast, then an f32 product (exact weights)."""
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal((4, 16)).astype(bfloat16)
    b = rng.standard_normal(4).astype(bfloat16)
    got = run_op(ops.linear, x, w, b)
    want = F.linear(
        torch.from_numpy(x),
        torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16).float(),
        torch.from_numpy(b.astype(np.float32)),
    )
    assert_close("matmul", got, want)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_linear_low_precision(dtype, run_op, assert_close, rng):
    x = rng.standard_normal((3, 16)).astype(NP[dtype])
    w = rng.standard_normal((5, 16)).astype(NP[dtype])
    b = rng.standard_normal(5).astype(NP[dtype])
    assert_close("matmul", run_op(ops.linear, x, w, b), F.linear(_t(x), _t(w), _t(b)), dtype)
