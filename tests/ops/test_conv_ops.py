"""conv2d (unfold + matmul) and nearest 2x upsampling against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ml_dtypes import bfloat16

from luminal_recipes import ops


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).astype(np.float64))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize(
    ("hw", "kernel"), [((7, 5), (3, 3)), ((3, 3), (1, 1)), ((1, 1), (1, 1)), ((6, 7), (2, 3))]
)
def test_conv2d(hw, kernel, stride, padding, bias, run_op, assert_close, rng):
    x = rng.standard_normal((2, 3) + hw).astype(np.float32)
    w = rng.standard_normal((4, 3) + kernel).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    if kernel[0] > hw[0] + 2 * padding or kernel[1] > hw[1] + 2 * padding:
        pytest.skip("kernel larger than the padded input")
    if bias:
        got = run_op(lambda t, wt, bt: ops.conv2d(t, wt, bt, stride, padding), x, w, b)
    else:
        got = run_op(lambda t, wt: ops.conv2d(t, wt, None, stride, padding), x, w)
    want = F.conv2d(_t(x), _t(w), _t(b) if bias else None, stride=stride, padding=padding)
    assert_close("conv", got, want)


def test_conv2d_asymmetric_stride_and_padding(run_op, assert_close, rng):
    x = rng.standard_normal((1, 2, 7, 9)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    got = run_op(lambda t, wt: ops.conv2d(t, wt, stride=(2, 1), padding=(1, 0)), x, w)
    assert_close("conv", got, F.conv2d(_t(x), _t(w), stride=(2, 1), padding=(1, 0)))


def test_conv2d_on_a_permuted_input_with_bf16_weight(run_op, assert_close, rng):
    """An NHWC tensor read as NCHW through a permuted view; the bf16 weight is cast to the activations'."""
    x_nhwc = rng.standard_normal((2, 5, 7, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(bfloat16)
    got = run_op(lambda t, wt: ops.conv2d(t.permute(0, 3, 1, 2), wt, padding=1), x_nhwc, w)
    want = F.conv2d(_t(x_nhwc).permute(0, 3, 1, 2), _t(w), padding=1)
    assert_close("conv", got, want)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_conv2d_low_precision(dtype, run_op, assert_close, rng):
    npd = np.float16 if dtype == "f16" else bfloat16
    x = rng.standard_normal((1, 3, 5, 5)).astype(npd)
    w = (rng.standard_normal((2, 3, 3, 3)) * 0.3).astype(npd)
    assert_close(
        "conv",
        run_op(lambda t, wt: ops.conv2d(t, wt, padding=1), x, w),
        F.conv2d(_t(x), _t(w), padding=1),
        dtype,
    )


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 3, 5), (1, 2, 7, 1)])
def test_upsample_nearest2x(shape, run_op, assert_close, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    got = run_op(ops.upsample_nearest2x, x)
    assert_close("resample", got, F.interpolate(torch.from_numpy(x), scale_factor=2, mode="nearest"))


def test_upsample_nearest2x_of_a_sliced_view(run_op, assert_close, rng, viewed):
    v = viewed("sliced", (2, 3, 4, 5), rng)
    got = run_op(ops.upsample_nearest2x, v)
    assert_close(
        "resample", got, F.interpolate(torch.from_numpy(v.value.copy()), scale_factor=2, mode="nearest")
    )
