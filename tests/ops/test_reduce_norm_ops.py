"""Reductions, softmax/log_softmax and the normalisation layers against torch."""

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


REDUCTIONS = {
    "sum": (ops.sum, lambda t, axis, keepdim: torch.sum(t, axis, keepdim=keepdim)),
    "mean": (ops.mean, lambda t, axis, keepdim: torch.mean(t, axis, keepdim=keepdim)),
    "max": (ops.max, lambda t, axis, keepdim: torch.amax(t, axis, keepdim=keepdim)),
    "min": (ops.min, lambda t, axis, keepdim: torch.amin(t, axis, keepdim=keepdim)),
}


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", [0, -1, (0, 2), (1,), None])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions(name, axis, keepdim, run_op, assert_close, rng):
    ours, ref = REDUCTIONS[name]
    x = rng.standard_normal((3, 7, 5)).astype(np.float32)
    got = run_op(lambda t: ours(t, axis, keepdim), x)
    dims = tuple(range(3)) if axis is None else axis
    assert_close("reduce", got, ref(_t(x), dims, keepdim))


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("axis", [-1, (0, 1)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_var(correction, axis, keepdim, run_op, assert_close, rng):
    x = rng.standard_normal((7, 3, 17)).astype(np.float32) + 3.0
    got = run_op(lambda t: ops.var(t, axis, keepdim, correction), x)
    assert_close("reduce", got, torch.var(_t(x), axis, correction=correction, keepdim=keepdim))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions_low_precision(name, dtype, run_op, assert_close, rng):
    ours, ref = REDUCTIONS[name]
    x = rng.standard_normal((3, 17)).astype(NP[dtype])
    assert_close("reduce", run_op(lambda t: ours(t, -1), x), ref(_t(x), -1, False), dtype)


@pytest.mark.parametrize("kind", ["transposed", "sliced", "padded", "broadcast"])
def test_reductions_on_views(kind, run_op, assert_close, rng, viewed):
    v = viewed(kind, (4, 7), rng)
    for axis in (0, 1):
        assert_close("reduce", run_op(lambda t, a=axis: ops.sum(t, a), v), torch.sum(_t(v.value), axis))
        assert_close("reduce", run_op(lambda t, a=axis: ops.max(t, a), v), torch.amax(_t(v.value), axis))
        assert_close(
            "reduce",
            run_op(lambda t, a=axis: ops.var(t, a, correction=1), v),
            torch.var(_t(v.value), axis, correction=1),
        )


@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_mean_and_var(s, run_op, assert_close, rng, symbolic_input):
    """Reducing over a symbolic axis divides by the bound size, not a build-time guess."""
    x = rng.standard_normal((s, 8)).astype(np.float32)
    sx = symbolic_input(x, ("s", 8))
    assert_close("reduce", run_op(lambda t: ops.mean(t, 0), sx, dims={"s": s}), torch.mean(_t(x), 0))
    if s > 1:
        got = run_op(lambda t: ops.var(t, 0, correction=1), sx, dims={"s": s})
        assert_close("reduce", got, torch.var(_t(x), 0, correction=1))
    assert_close(
        "reduce", run_op(lambda t: ops.var(t, -1), sx, dims={"s": s}), torch.var(_t(x), -1, correction=0)
    )


# ---- softmax -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax(axis, dtype, run_op, assert_close, rng):
    x = (rng.standard_normal((3, 7, 17)) * 4).astype(NP[dtype])
    assert_close("softmax", run_op(lambda t: ops.softmax(t, axis), x), torch.softmax(_t(x), axis), dtype)
    assert_close(
        "softmax", run_op(lambda t: ops.log_softmax(t, axis), x), torch.log_softmax(_t(x), axis), dtype
    )


def test_softmax_is_stable_for_large_logits(run_op, assert_close):
    x = np.array([[1000.0, 999.0, -1000.0], [-1e30, 0.0, 1e30]], dtype=np.float32)
    assert_close("softmax", run_op(ops.softmax, x), torch.softmax(_t(x), -1))
    assert_close("softmax", run_op(ops.log_softmax, x[:1]), torch.log_softmax(_t(x[:1]), -1))


@pytest.mark.parametrize("kind", ["transposed", "sliced", "padded", "broadcast"])
def test_softmax_on_views(kind, run_op, assert_close, rng, viewed):
    v = viewed(kind, (3, 7), rng)
    assert_close("softmax", run_op(ops.softmax, v), torch.softmax(_t(v.value), -1))


@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_softmax(s, run_op, assert_close, rng, symbolic_input):
    x = rng.standard_normal((2, s)).astype(np.float32)
    got = run_op(ops.softmax, symbolic_input(x, (2, "s")), dims={"s": s})
    assert_close("softmax", got, torch.softmax(_t(x), -1))


# ---- normalisation layers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("affine", [False, True])
def test_rms_norm(affine, dtype, run_op, assert_close, rng):
    x = rng.standard_normal((3, 5, 17)).astype(NP[dtype])
    w = rng.standard_normal(17).astype(NP[dtype])
    if affine:
        got = run_op(lambda t, wt: ops.rms_norm(t, wt, eps=1e-6), x, w)
    else:
        got = run_op(lambda t: ops.rms_norm(t, eps=1e-6), x)
    want = F.rms_norm(_t(x), (17,), _t(w) if affine else None, eps=1e-6)
    assert_close("norm", got, want, dtype)


def test_rms_norm_with_bf16_weight_on_f32_activations(run_op, assert_close, rng):
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(bfloat16)
    assert_close(
        "norm",
        run_op(lambda t, wt: ops.rms_norm(t, wt, 1e-5), x, w),
        F.rms_norm(_t(x), (16,), _t(w), eps=1e-5),
    )


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm(affine, dtype, run_op, assert_close, rng):
    x = (rng.standard_normal((3, 7, 16)) * 2 + 1).astype(NP[dtype])
    w, b = (rng.standard_normal(16).astype(NP[dtype]) for _ in range(2))
    if affine:
        got = run_op(lambda t, wt, bt: ops.layer_norm(t, wt, bt, eps=1e-5), x, w, b)
    else:
        got = run_op(lambda t: ops.layer_norm(t, eps=1e-6), x)
    want = F.layer_norm(
        _t(x), (16,), _t(w) if affine else None, _t(b) if affine else None, eps=1e-5 if affine else 1e-6
    )
    assert_close("norm", got, want, dtype)


def test_layer_norm_over_two_axes(run_op, assert_close, rng):
    x = rng.standard_normal((2, 3, 7)).astype(np.float32)
    w, b = (rng.standard_normal((3, 7)).astype(np.float32) for _ in range(2))
    got = run_op(lambda t, wt, bt: ops.layer_norm(t, wt, bt, axes=2), x, w, b)
    assert_close("norm", got, F.layer_norm(_t(x), (3, 7), _t(w), _t(b)))


@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_norms(s, run_op, assert_close, rng, symbolic_input):
    x = rng.standard_normal((s, 8)).astype(np.float32)
    sx = symbolic_input(x, ("s", 8))
    assert_close("norm", run_op(ops.layer_norm, sx, dims={"s": s}), F.layer_norm(_t(x), (8,)))
    assert_close("norm", run_op(ops.rms_norm, sx, dims={"s": s}), F.rms_norm(_t(x), (8,), eps=1e-6))


@pytest.mark.parametrize("kind", ["transposed", "sliced", "padded", "broadcast"])
def test_norms_on_views(kind, run_op, assert_close, rng, viewed):
    v = viewed(kind, (3, 7), rng)
    assert_close("norm", run_op(ops.layer_norm, v), F.layer_norm(_t(v.value), (7,)))
    assert_close("norm", run_op(ops.rms_norm, v), F.rms_norm(_t(v.value), (7,), eps=1e-6))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize(
    ("shape", "groups"), [((2, 6, 3, 5), 3), ((1, 4, 7), 2), ((3, 8, 1, 1), 8), ((2, 4, 3, 3), 1)]
)
@pytest.mark.parametrize("affine", [False, True])
def test_group_norm(shape, groups, affine, dtype, run_op, assert_close, rng):
    x = (rng.standard_normal(shape) * 3 - 1).astype(NP[dtype])
    c = shape[1]
    w, b = (rng.standard_normal(c).astype(NP[dtype]) for _ in range(2))
    if affine:
        got = run_op(lambda t, wt, bt: ops.group_norm(t, groups, wt, bt, eps=1e-6), x, w, b)
    else:
        got = run_op(lambda t: ops.group_norm(t, groups, eps=1e-6), x)
    want = F.group_norm(_t(x), groups, _t(w) if affine else None, _t(b) if affine else None, eps=1e-6)
    assert_close("norm", got, want, dtype)
