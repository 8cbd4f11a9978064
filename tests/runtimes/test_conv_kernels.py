"""The numpy runtime's Conv2d against torch's conv2d: the im2col + BLAS path and the compiled direct convolution
(numba, wide rows and few output channels), each on odd sizes, a batch of two, stride 2 with the encoder's
one-sided padding, with and without bias, and fewer output windows than fit (the rule may give that)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fused_programs import Fused

from luminal_recipes.graph import Graph
from luminal_recipes.runtimes import jit, numpy_kernels
from luminal_recipes.runtimes.kernels.fused import conv_windows

# (batch, in channels, out channels, height, width, stride, padding (top/left, bottom/right), bias, crop)
CASES = {
    "direct, padded, bias, batch 2": (2, 5, 8, 7, 100, 1, (1, 1), True, 0),
    "direct, no bias": (1, 3, 4, 4, 97, 1, (1, 1), False, 0),
    "direct, unpadded, cropped windows": (1, 2, 8, 6, 101, 1, (0, 0), True, 1),
    "direct, out channels not a multiple of 4": (1, 3, 6, 5, 100, 1, (1, 1), True, 0),
    "direct, three out channels (an image)": (1, 4, 3, 3, 96, 1, (1, 1), True, 0),
    "im2col, narrow rows": (2, 3, 4, 9, 11, 1, (1, 1), True, 0),
    "im2col, stride 2, encoder padding": (2, 3, 4, 9, 100, 2, (0, 1), True, 0),
}
DIRECT = {name for name in CASES if name.startswith("direct")}


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
@pytest.mark.parametrize("case", list(CASES))
def test_conv2d_kernel_matches_torch(case, compiled, numpy_runtime, monkeypatch, rng, assert_close):
    if compiled and not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    monkeypatch.setattr(jit, "AVAILABLE", compiled)
    direct = []
    prepare = numpy_kernels._prepare_direct_conv
    monkeypatch.setattr(numpy_kernels, "_prepare_direct_conv", lambda ctx: direct.append(ctx) or prepare(ctx))
    n, c, o, h, w, stride, (lo, hi), bias, crop = CASES[case]
    g = Graph()
    x = g.input("x", (n, c, h, w))
    wt, b = g.weight("w", (o, c, 3, 3)), g.weight("b", (o,))
    xp = x.pad(2, lo, hi).pad(3, lo, hi)
    ho, wo = (h + lo + hi - 3) // stride + 1 - crop, (w + lo + hi - 3) // stride + 1 - crop
    operands = [xp, wt] + ([b.reshape(1, o, 1, 1).broadcast_to((n, o, ho, wo))] if bias else [])
    f = Fused(g)
    y = f.add("Conv2d", operands, (n, o, ho, wo), stride=stride)
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32)}
    weights = {"w": (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32),
               "b": rng.standard_normal(o).astype(np.float32)}
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    want = F.conv2d(F.pad(t["x"], (lo, hi, lo, hi)), t["w"], t["b"] if bias else None, stride=stride)
    want = want[:, :, :ho, :wo].numpy()
    assert_close("conv", got, want)
    assert bool(direct) == (compiled and case in DIRECT)


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
def test_conv2d_kernel_bf16_weights_and_output(compiled, numpy_runtime, monkeypatch, rng, assert_close):
    """bf16 weight and bias read by the f32 kernel, the result rounded once to a bf16 output."""
    if compiled and not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    monkeypatch.setattr(jit, "AVAILABLE", compiled)
    n, c, o, h, w = 1, 3, 8, 4, 100
    g = Graph()
    x, wt, b = g.input("x", (n, c, h, w)), g.weight("w", (o, c, 3, 3), "bf16"), g.weight("b", (o,), "bf16")
    f = Fused(g)
    y = f.add("Conv2d", [x.pad(2, 1, 1).pad(3, 1, 1), wt, b.reshape(1, o, 1, 1).broadcast_to((n, o, h, w))],
              (n, o, h, w), "bf16", stride=1)
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32)}
    weights = {"w": (rng.standard_normal((o, c, 3, 3)) / 5).astype(ml_dtypes.bfloat16),
               "b": rng.standard_normal(o).astype(ml_dtypes.bfloat16)}
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    assert got.dtype == ml_dtypes.bfloat16
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    want = F.conv2d(t["x"], t["w"], t["b"], padding=1)
    assert_close("conv", got, want, "bf16")


def test_conv_windows_must_lie_inside_the_input():
    assert conv_windows((1, 3, 9, 8), (4, 3, 3, 3), 2, (1, 4, 4, 3)) == (2, 2)
    assert conv_windows((1, 3, 9, 8), (4, 3, 3, 3), (2, 1), (1, 4, 3, 2)) == (2, 1)  # fewer windows than fit
    for bad in [(1, 4, 5, 3), (1, 4, 4, 4), (2, 4, 4, 3), (1, 5, 4, 3)]:
        with pytest.raises(ValueError, match="do not give"):
            conv_windows((1, 3, 9, 8), (4, 3, 3, 3), 2, bad)
