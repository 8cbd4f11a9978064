"""``DequantMatMul`` on AMX tiles (``runtimes/cpu/amx/dequant.py``: the weight decoded exactly into bf16, x in three
bf16 parts, three tile products): against the float64 product of the decoded weight (ml_dtypes' values), as
accurate as numpy's f32 product of the decoded weight (tests/TOLERANCES.md, matmul f32: rtol 1e-5, atol 1e-5, and
within a few times numpy's own error), through the numpy runtime's kernel: FP8 (e4m3 and e5m2, per-tensor and
per-channel scales, odd K), NVFP4 in both layouts (ModelOpt; comfy's nibble order, padded rows and 128x4 scale
tiles), a bias, a bf16 output, M, N and K off the tiles' multiples, several k and column blocks, 1 and 2 cores; and
the fallbacks (x not finite, an infinite weight, AMX or numba off) giving the band path's values. Skipped, with the
reason, where the CPU (or the process) cannot run AMX."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import amx, jit
from luminal_recipes.runtimes.cpu import threads as cpu_threads
from luminal_recipes.runtimes.cpu.amx import dequant as amx_dequant

needs_amx = pytest.mark.skipif(not amx.available(), reason=f"no AMX here: {amx.reason_unavailable()}")

E2M1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _case(rng, fmt, m, k, n, *, scale="channel", layout="modelopt", fp8=ml_dtypes.float8_e4m3fn, bias=False,
          dtype="f32"):
    """(program, inputs, weights, the decoded weight in float64 [n, k], the same as ops.quant decodes it in f32)."""
    g = Graph()
    x = g.input("x", (m, k))
    weights = {}
    if fmt == "fp8":
        s_shape = {"tensor": (), "one": (1,), "channel": (n,), "column": (n, 1)}[scale]
        w, s = g.weight("w", (n, k), np.dtype(fp8).name), g.weight("s", s_shape)
        weights["w"] = (rng.standard_normal((n, k)) * 4).astype(fp8)
        weights["s"] = (rng.random(s_shape) + 0.5).astype(np.float32)
        operands = [x, w, s]
        col = np.broadcast_to(weights["s"].astype(np.float64).reshape(-1, 1), (n, 1))
        dense64 = weights["w"].astype(np.float64) * col
        dense32 = weights["w"].astype(np.float32) * weights["s"].reshape(-1, 1)
    else:
        blocks = k // 16
        if layout == "modelopt":
            w_shape, s_shape = (n, k // 2), (n, blocks)
        else:
            w_shape, s_shape = (-(-n // 16) * 16, k // 2), (-(-n // 128) * 128, -(-blocks // 4) * 4)
        w, s, s2 = g.weight("w", w_shape, "u8"), g.weight("ws", s_shape, "f8e4m3"), g.weight("ws2", ())
        weights["w"] = rng.integers(0, 256, w_shape).astype(np.uint8)
        weights["ws"] = (rng.random(s_shape) * 4 + 0.01).astype(ml_dtypes.float8_e4m3fn)
        weights["ws"].view(np.uint8)[0, :2] = (0x00, 0x01)  # a zero and a subnormal scale
        weights["ws2"] = np.asarray(0.37, np.float32)
        operands = [x, w, s, s2]
        codes = weights["w"][:n]
        first, second = (codes & 15, codes >> 4) if layout == "modelopt" else (codes >> 4, codes & 15)
        e2m1 = np.stack([E2M1[first], E2M1[second]], axis=-1).reshape(n, k)
        scales = weights["ws"].astype(np.float64)
        if layout == "comfy":  # cuBLAS' 128x4 tiles: logical row 128 i + 32 a + b, block 4 j + c at [i, j, b, a, c]
            rp, cp = s_shape
            scales = scales.reshape(rp // 128, cp // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(rp, cp)
        block_scale = np.repeat(scales[:n, :blocks], 16, axis=1)
        dense64 = e2m1 * block_scale * 0.37
        dense32 = ((e2m1 * block_scale).astype(np.float32) * np.float32(0.37)).astype(np.float32)
    if bias:
        operands.append(g.weight("b", (n,)).broadcast_to((m, n)))
        weights["b"] = rng.standard_normal(n).astype(np.float32)
    f = Fused(g)
    y = f.add("DequantMatMul", operands, (m, n), dtype, format=fmt, layout=layout if fmt == "nvfp4" else "",
              out_features=n, in_features=k)
    inputs = {"x": rng.standard_normal((m, k)).astype(np.float32)}
    return f.program(y=y), inputs, weights, dense64, dense32


def _on_tiles(monkeypatch, calls):
    """Every product large enough for the tiles, parts of any size; ``calls`` counts the AMX products bound."""
    monkeypatch.setattr(amx_dequant, "MIN_MACS", 1)
    monkeypatch.setattr(amx_dequant, "FP8_MIN_ROWS", 1)
    monkeypatch.setattr(amx, "MACS_PER_PART", 1)
    product = amx_dequant.product
    monkeypatch.setattr(amx_dequant, "product", lambda *args: calls.append(1) or product(*args))


def _reference(inputs, weights, dense64, dense32):
    x = inputs["x"]
    exact = x.astype(np.float64) @ dense64.T
    numpy_f32 = x @ dense32.T
    if "b" in weights:
        exact = exact + weights["b"]
        numpy_f32 = numpy_f32 + weights["b"]
    return exact, np.abs(numpy_f32 - exact).max()


CASES = [
    ("fp8", dict(scale="channel"), (33, 80, 45)),
    ("fp8", dict(scale="tensor"), (70, 112, 100)),
    ("fp8", dict(scale="one", bias=True), (1, 96, 64)),
    ("fp8", dict(scale="column", fp8=ml_dtypes.float8_e5m2), (40, 47, 70)),  # odd K: a lone last element
    ("nvfp4", dict(layout="modelopt"), (33, 80, 45)),
    ("nvfp4", dict(layout="modelopt", bias=True), (1, 160, 200)),
    ("nvfp4", dict(layout="comfy"), (70, 112, 200)),  # rows padded to 208, scales to 256 x 8
    ("nvfp4", dict(layout="comfy", bias=True), (17, 48, 33)),
    ("nvfp4", dict(layout="modelopt"), (1, 6144, 40)),  # long sums: k blocks summed apart, then added
    ("fp8", dict(scale="channel"), (3, 4128, 40)),
    ("nvfp4", dict(layout="modelopt"), (100, 64, 40)),  # more rows of x than of W: the cores split x's rows
    ("fp8", dict(scale="tensor", bias=True), (75, 96, 50)),
]


@needs_amx
@pytest.mark.parametrize(("fmt", "kw", "mkn"), CASES)
def test_dequant_matmul_on_amx_is_as_accurate_as_f32(fmt, kw, mkn, numpy_runtime, monkeypatch):
    """The kernel takes the tiles (one and two cores: the same bits) and lands within the f32 matmul tolerance
    of the float64 product of the decoded weight, within a few times numpy's own f32 error on it."""
    m, k, n = mkn
    rng = np.random.default_rng(m * 31 + k)
    program, inputs, weights, dense64, dense32 = _case(rng, fmt, m, k, n, **kw)
    exact, numpy_error = _reference(inputs, weights, dense64, dense32)
    calls = []
    _on_tiles(monkeypatch, calls)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(program, inputs, weights)["y"])
    assert calls, "the DequantMatMul did not take the AMX path"
    scale = np.abs(exact).max()
    np.testing.assert_allclose(results[0], exact, rtol=1e-5, atol=1e-5 * scale)
    assert np.abs(results[0] - exact).max() <= 4 * numpy_error + 1e-6 * scale
    assert np.array_equal(results[0], results[1])


@needs_amx
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_dequant_matmul_on_amx_in_several_blocks(fmt, numpy_runtime, monkeypatch):
    """k taken 64 at a time (the partial sums kept in the output, the column scale applied after the last) and
    the columns in blocks of 64 (a decoded block per 64 columns), x over several 32-row panels."""
    m, k, n = 75, 336, 150
    rng = np.random.default_rng(5)
    program, inputs, weights, dense64, dense32 = _case(rng, fmt, m, k, n, bias=True)
    exact, numpy_error = _reference(inputs, weights, dense64, dense32)
    calls = []
    _on_tiles(monkeypatch, calls)
    monkeypatch.setattr(amx_dequant, "KC_MOST", 64)
    monkeypatch.setattr(amx_dequant, "B_BLOCK_BYTES", 2 * 64 * 64)
    assert amx_dequant.plan(m, k, n, 1).kc == 64 and amx_dequant.plan(m, k, n, 1).nc == 64
    got = numpy_runtime.run(program, inputs, weights)["y"]
    assert calls
    scale = np.abs(exact).max()
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * scale)
    assert np.abs(got - exact).max() <= 4 * numpy_error + 1e-6 * scale


@needs_amx
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_dequant_matmul_on_amx_rounds_once_into_a_narrow_output(dtype, numpy_runtime, monkeypatch):
    """A bf16 / f16 output is the f32 result (with the bias) rounded once: as the band path's, within one
    rounding of the output dtype."""
    rng = np.random.default_rng(8)
    program, inputs, weights, dense64, _ = _case(rng, "nvfp4", 40, 96, 70, bias=True, dtype=dtype)
    calls = []
    _on_tiles(monkeypatch, calls)
    got = numpy_runtime.run(program, inputs, weights)["y"]
    assert calls and got.dtype == (ml_dtypes.bfloat16 if dtype == "bf16" else np.float16)
    exact = inputs["x"].astype(np.float64) @ dense64.T + weights["b"]
    want = exact.astype(np.float32).astype(got.dtype).astype(np.float64)
    ulp = 2.0**-7 if dtype == "bf16" else 2.0**-10  # one step of the output dtype, relative
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=ulp, atol=ulp * np.abs(exact).max() * 1e-3)


def _band_path(numpy_runtime, monkeypatch, program, inputs, weights):
    with monkeypatch.context() as patch:
        patch.setattr(amx_dequant, "worth_it", lambda *args: False)
        return numpy_runtime.run(program, inputs, weights)["y"]


@needs_amx
def test_dequant_matmul_on_amx_leaves_non_finite_x_to_blas(numpy_runtime, monkeypatch):
    """An x with an inf or a NaN (in bf16 parts inf minus inf, or inf times a zero part, is NaN) and an fp8 e5m2
    weight with an infinity: the band path's values, non-finite exactly where numpy's are."""
    calls = []
    _on_tiles(monkeypatch, calls)
    rng = np.random.default_rng(9)
    program, inputs, weights, _, _ = _case(rng, "nvfp4", 40, 64, 50)
    inputs["x"][3, 5], inputs["x"][7, 9] = np.inf, np.nan
    with np.errstate(invalid="ignore"):
        got = numpy_runtime.run(program, inputs, weights)["y"]
        want = _band_path(numpy_runtime, monkeypatch, program, inputs, weights)
    assert calls
    assert np.array_equal(got, want, equal_nan=True) and np.isinf(got).any() and np.isnan(got).any()
    program, inputs, weights, _, _ = _case(rng, "fp8", 40, 64, 50, fp8=ml_dtypes.float8_e5m2)
    weights["w"].view(np.uint8)[4, 6] = 0x7C  # +inf
    with np.errstate(invalid="ignore"):
        got = numpy_runtime.run(program, inputs, weights)["y"]
        want = _band_path(numpy_runtime, monkeypatch, program, inputs, weights)
    assert np.array_equal(got, want, equal_nan=True) and np.isinf(got[:, 4]).all()


@pytest.mark.parametrize("off", ["worth_it", "numba"])
def test_dequant_matmul_without_amx_keeps_the_band_path(off, numpy_runtime, monkeypatch):
    """With AMX refused (or numba missing) the kernel binds no tile product and gives the band path's bits."""
    calls = []
    _on_tiles(monkeypatch, calls)
    rng = np.random.default_rng(10)
    program, inputs, weights, _, _ = _case(rng, "fp8", 40, 64, 50)
    want = _band_path(numpy_runtime, monkeypatch, program, inputs, weights)
    if off == "numba":
        monkeypatch.setattr(jit, "AVAILABLE", False)
    else:
        monkeypatch.setattr(amx_dequant, "worth_it", lambda *args: False)
    got = numpy_runtime.run(program, inputs, weights)["y"]
    assert not calls
    if off == "worth_it":
        assert np.array_equal(got, want)
    else:  # numpy's decoding passes give the compiled passes' bits (test_numpy_fast_paths); BLAS the rest
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@needs_amx
def test_e4m3_decoded_in_registers_is_the_table_decoding():
    """fp8 e4m3fn decoded arithmetically (16 columns x 16 k pairs in registers: normals, subnormals, zeros of
    both signs, NaN) gives the words of the table decoding (ml_dtypes' values as bf16), every byte value."""
    from luminal_recipes.runtimes.cpu.amx.dequant_gemm import decode_block

    n, k = 40, 72  # a group of 16 columns and of 16 pairs, and the scalar path around it
    codes = (np.arange(n * k) * 7 % 256).astype(np.uint8).reshape(n, k)
    table = amx_dequant.fp8_table(np.dtype(ml_dtypes.float8_e4m3fn))
    words = []
    for fmt in (amx_dequant.FP8, amx_dequant.FP8_E4M3):
        out = np.full((2, 48, 32), 0xDEAD, np.uint32)
        decode_block(fmt, table, codes.ctypes.data, k, 0, 0, 0, n, k, 0, k, 0, n, out)
        words.append(out)
    assert np.array_equal(words[0], words[1])
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    bf16 = (words[0][0, :36, :].T.copy().view(np.uint16).reshape(32, 72).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(bf16, values[:32])
