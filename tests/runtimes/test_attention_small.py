"""Attention over 16-dim heads runs the compiled kernel (``kernels/attention_small.py``, ``jit/attention_small.py``)
instead of BLAS's products, and gives PyTorch's SDPA values (float64, tests/TOLERANCES.md "attention"): query
lengths that are not multiples of the kernel's 4-row groups, q_len != kv_len, token-major views of a fused qkv
projection (strided rows, as FLUX.2's blocks read them), several blocks per head taken by both cores, the
key-blocked variant, and the 1088-token shape of the tiny FLUX.2 transformer. A spy on the kernel's module makes
sure it ran (a case falling back to BLAS would pass the comparison without testing it)."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu.kernels import attention as numpy_attention
from luminal_recipes.runtimes.cpu.kernels import attention_small

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="the compiled kernel needs numba")

def _case(s: int, t: int, token_major: bool, H: int = 3, D: int = 16):
    """SDPA over ``H`` heads of 16; with ``token_major`` q, k and v are views of one ``[T, 3, H, D]`` tensor (the
    heads' rows 3 * H * D apart), else contiguous ``[1, H, S, D]`` inputs."""
    g = Graph()
    if token_major:
        assert s == t
        qkv = g.input("qkv", (1, t, 3, H, D))
        q, k, v = (qkv.slice(2, i, i + 1).reshape((1, t, H, D)).permute((0, 2, 1, 3)) for i in range(3))
    else:
        q, k, v = g.input("q", (1, H, s, D)), g.input("k", (1, H, t, D)), g.input("v", (1, H, t, D))
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, scale=0.3))
    rng = np.random.default_rng(s * 1000 + t)
    if token_major:
        inputs = {"qkv": (2 * rng.standard_normal((1, t, 3, H, D))).astype(np.float32)}
    else:
        inputs = {n: (2 * rng.standard_normal((1, H, m, D))).astype(np.float32) for n, m in zip("qkv", (s, t, t))}
    return g, (q, k, v), inputs


def _torch_sdpa(inputs) -> np.ndarray:
    if "qkv" in inputs:
        qkv = torch.from_numpy(inputs["qkv"]).double()
        q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    else:
        q, k, v = (torch.from_numpy(inputs[n]).double() for n in "qkv")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3).numpy()


def _run(numpy_runtime, op: str, s: int, t: int, token_major: bool, monkeypatch, H: int = 3,
         D: int = 16) -> tuple[np.ndarray, dict, list]:
    monkeypatch.setattr(numpy_attention, "MIN_ROWS", 1)  # several query blocks per head: tasks of both cores
    calls = []
    kernels = attention_small._kernels

    def spy():
        calls.append(1)
        return kernels()

    monkeypatch.setattr(attention_small, "_kernels", spy)
    g, (q, k, v), inputs = _case(s, t, token_major, H, D)
    f = Fused(g)
    y = f.add(op, [q, k, v], (1, H, s, D), scale=0.3, **({"block": 8} if op == "AttentionBlocked" else {}))
    program = f.program(y=y)
    return numpy_runtime.run(program, inputs)["y"], inputs, calls


@pytest.mark.parametrize("op", ["Attention", "AttentionBlocked"])
@pytest.mark.parametrize(("s", "t", "token_major"), [
    (37, 37, False),    # 37 rows: groups of 4 leave one row
    (13, 40, False),    # fewer queries than keys
    (42, 9, False),     # more queries than keys
    (6, 6, True),       # strided rows of a fused projection
    (130, 130, True),
])
def test_16_dim_heads_give_torch_sdpa_values(op, s, t, token_major, numpy_runtime, assert_close, monkeypatch):
    got, inputs, calls = _run(numpy_runtime, op, s, t, token_major, monkeypatch)
    assert calls, "the compiled 16-dim kernel did not run"
    assert_close("attention", got, _torch_sdpa(inputs))


def test_flux2_tiny_shape(numpy_runtime, assert_close, monkeypatch):
    """4 heads x 1088 tokens read from a fused projection, as in the tiny FLUX.2 transformer's blocks."""
    got, inputs, calls = _run(numpy_runtime, "Attention", 1088, 1088, True, monkeypatch, H=4)
    assert calls
    assert_close("attention", got, _torch_sdpa(inputs))


def test_other_head_dims_keep_blas(numpy_runtime, assert_close, monkeypatch):
    """Heads of 8 dims are not the kernel's: the BLAS path runs them (the same values)."""
    got, inputs, calls = _run(numpy_runtime, "Attention", 21, 21, False, monkeypatch, D=8)
    assert not calls
    assert_close("attention", got, _torch_sdpa(inputs))


def test_values_do_not_depend_on_the_blocks(numpy_runtime, monkeypatch):
    """Each row is computed on its own, in the compiled code's fixed order: cutting a head into other blocks of
    query rows (other tasks, other cores) gives the same bits."""
    g, (q, k, v), inputs = _case(50, 50, True)
    H, D = 3, 16
    results = []
    for rows in (1, 256):
        monkeypatch.setattr(numpy_attention, "MIN_ROWS", rows)
        f = Fused(g)
        y = f.add("Attention", [q, k, v], (1, H, 50, D), scale=0.3)
        results.append(numpy_runtime.run(f.program(y=y), inputs)["y"])
    assert np.array_equal(results[0], results[1])


def test_exponential_against_float64():
    """The kernel's exponential (``exp_row_sum``: e^(x - m) in place, and the sum) against numpy's float64 exp over
    f32's whole normal range below the maximum: relative error <= 5e-7 (its docstring's 4e-7 bound), e^0 = 1 exactly
    (the row's maximum weighs exactly 1), and 0 for masked (-inf) keys, for scores more than 87.34 below the maximum
    (f32's normal range ends there) and for NaN. A polynomial a term short or a wrong reduction constant fails."""
    k = attention_small._kernels()
    m = np.float32(3.5)  # a maximum that is not 0: the subtraction is the kernel's
    x = np.concatenate([np.linspace(-87.3, 0.0, 400_003), -np.logspace(-9, 0, 20_001)]).astype(np.float32) + m
    row = np.concatenate([x, np.array([m, -np.inf, m - 87.4, m - 200.0, -3.4e38, np.nan], np.float32)])
    got = row.copy()
    total = k.exp_row_sum(got, m, len(got))
    want = np.exp(x.astype(np.float64) - np.float64(m))
    n = len(x)
    assert np.abs(got[:n] - want).max() <= 5e-7 * want.max()
    assert (np.abs(got[:n] - want) <= 5e-7 * want).all()
    assert got[n] == 1.0
    assert (got[n + 1:] == 0).all()
    assert abs(total - (want.sum() + 1)) <= 1e-5 * want.sum()  # an f32 sum of 420k terms (and the maximum's 1)


@pytest.mark.parametrize("T", [45, 80, 200])
@pytest.mark.parametrize("scale", [0.01, 0.3, 4.0, 60.0])
def test_kernel_over_score_ranges(scale, T, assert_close):
    """``attention16`` against float64 SDPA with scores from near-uniform weights (0.01) to rows where every
    exponential but the maximum's underflows (60: score gaps of hundreds); 37 rows (a partial group); 45 keys (two
    16-key blocks, then the last 16 overlapping them), 80 (a 64-key tile and a block), 200 (3 tiles, an overlap)."""
    k_ = attention_small._kernels()
    rng = np.random.default_rng(7)
    H, S, D = 2, 37, 16
    q, k, v = (rng.standard_normal((H, n, D)).astype(np.float32) for n in (S, T, T))
    out = np.full((H, S, D), np.nan, np.float32)
    scratch = [np.zeros(shape, np.float32) for shape in ((D, T), (T, D), (4, T), (4, D))]
    for h in range(H):
        k_.attention16(q, k, v, out, h, 0, S, True, np.float32(scale), *scratch)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a).double() for a in (q, k, v)), scale=scale).numpy()
    if scale < 60.0:
        assert_close("attention", out, want)
        return
    # scores of ~100-300 carry f32 rounding of ~1e-5 into their exponentials, beyond the family's tolerance for any
    # f32 kernel: no worse than PyTorch's own f32 SDPA (twice its error), and the rows whose other weights all
    # underflow (the test's premise) are exactly that key's value row
    theirs = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), scale=scale)
    assert np.abs(out - want).max() <= 2 * np.abs(theirs.numpy() - want).max()
    scores = np.einsum("hsd,htd->hst", q.astype(np.float64), k.astype(np.float64)) * scale
    top = np.sort(scores, -1)
    alone = top[..., -1] - top[..., -2] > 88
    assert alone.sum() >= 10
    assert np.array_equal(out[alone], np.take_along_axis(v, scores.argmax(-1)[..., None], 1)[alone])
