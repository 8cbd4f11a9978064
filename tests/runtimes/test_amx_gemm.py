"""The f32 product on AMX tiles (``runtimes/cpu/amx/gemm.py``, bf16x3): as accurate as an f32 GEMM against float64
(tests/TOLERANCES.md, matmul f32: rtol 1e-5, atol 1e-5) on odd shapes and every operand layout, and the numpy
runtime's MatMul kernel choosing it with the BLAS path's semantics. Skipped, with the reason, where the CPU (or
the process) cannot run AMX."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.graph import Graph, View, run_reference
from luminal_recipes.runtimes.cpu import amx
from luminal_recipes.runtimes.cpu import threads as cpu_threads

needs_amx = pytest.mark.skipif(not amx.available(), reason=f"no AMX here: {amx.reason_unavailable()}")


def _operand(rng, shape, layout):
    """An f32 matrix of ``shape`` laid out contiguous ("C"), transposed ("T", as a weight [N, K] used as w.T)
    or strided in both axes ("S")."""
    rows, cols = shape
    if layout == "C":
        return rng.standard_normal(shape).astype(np.float32)
    if layout == "T":
        return rng.standard_normal((cols, rows)).astype(np.float32).T
    return rng.standard_normal((rows * 2, cols * 3)).astype(np.float32)[::2, 1::3]


def _product(a, b, threads):
    m, k = a.shape
    plan = amx.plan(m, k, b.shape[1], threads)
    scratch = [[amx.aligned_empty(s, d) for s, d in plan.scratch_shapes] for _ in plan.parts]
    out = np.full((m, b.shape[1]), np.nan, np.float32)
    amx.product(plan, a, b, out, scratch)()
    return out


@needs_amx
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (33, 70, 45), (100, 257, 31), (40, 96, 48), (65, 33, 97),
                                           (300, 2000, 64), (40, 96, 300)])
@pytest.mark.parametrize("layouts", ["CC", "CT", "TC", "SS", "TT"])
def test_amx_product_is_as_accurate_as_f32(m, k, n, layouts, monkeypatch):
    """Edges in M and N (not multiples of 32), K not a multiple of 32 (and taken in several blocks at
    K = 2000), transposed and strided operands, one and two parts (fixed rows or columns, or column chunks
    taken in turn: (40, 96, 300)): within the f32 matmul tolerance of the float64 product (unit-variance
    results, as a layer's), and within a few times numpy's own f32 error."""
    monkeypatch.setattr(amx, "MACS_PER_PART", 1)
    rng = np.random.default_rng(m * 7 + k)
    a, b = _operand(rng, (m, k), layouts[0]), _operand(rng, (k, n), layouts[1]) / np.float32(np.sqrt(k))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    numpy_error = np.abs(a @ b - exact).max()
    for threads in (1, 2):
        got = _product(a, b, threads)
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
        assert np.abs(got - exact).max() <= 4 * numpy_error + 1e-6


def _bf16_parts(x: np.ndarray) -> np.ndarray:
    """The three bf16 parts of f32 values (as uint16, stacked first), cut by truncation: x == hi + mid + lo."""
    parts, rest = [], x.astype(np.float32)
    for _ in range(3):
        bits = rest.view(np.uint32)
        parts.append((bits >> 16).astype(np.uint16))
        rest = rest - (bits & np.uint32(0xFFFF0000)).view(np.float32)
    return np.stack(parts)


@needs_amx
@pytest.mark.parametrize(("k", "n"), [(256, 64), (70, 50), (33, 16), (96, 40)])
@pytest.mark.parametrize("layout", ["T", "C", "S"])
def test_packed_operands_hold_the_exact_bf16_parts(k, n, layout):
    """``pack_b`` (k-contiguous weights transposed in registers, n-contiguous rows interleaved in registers,
    strided element by element) writes each panel's VNNI words, and ``pack_a_tiles`` A's 32 x 32 tiles, with the
    three truncated bf16 parts of every element and zeros past the edges: against a numpy construction."""
    from luminal_recipes.runtimes.cpu.amx import gemm as amx_gemm

    rng = np.random.default_rng(k * n)
    b = _operand(rng, (k, n), layout) * np.float32(1e3)
    kp = -(-k // 32) * 32
    padded = np.zeros((kp, -(-n // 32) * 32), np.float32)
    padded[:k, :n] = b
    want = _bf16_parts(padded)  # [3, kp, np]
    for j in range(0, n, 32):
        panel = amx.aligned_empty((3, kp // 2, 32, 2), np.uint16)
        panel[:] = 7  # every word written
        assert amx_gemm.pack_b(b.ctypes.data, *b.strides, 0, k, j, min(n, j + 32), panel) == 0
        vnni = want[:, :, j:j + 32].reshape(3, kp // 2, 2, 32).transpose(0, 1, 3, 2)  # [part, k pair, column, k]
        assert np.array_equal(panel, vnni)
    a = _operand(rng, (n, k), layout)
    rows = -(-n // 32) * 32
    tiles = amx.aligned_empty((rows // 32, kp // 32, 3, 32, 32), np.uint16)
    tiles[:] = 7
    assert amx_gemm.pack_a_tiles(a.ctypes.data, *a.strides, 0, n, 0, k, tiles) == 0
    padded = np.zeros((rows, kp), np.float32)
    padded[:n, :k] = a
    want = _bf16_parts(padded).reshape(3, rows // 32, 32, kp // 32, 32).transpose(1, 3, 0, 2, 4)
    assert np.array_equal(tiles, want)


@needs_amx
def test_amx_product_keeps_infinities_and_nans():
    """Operands with an inf or a NaN are multiplied by BLAS (in bf16 parts inf times a zero part is NaN): the
    product is non-finite exactly where numpy's is."""
    rng = np.random.default_rng(3)
    a, b = _operand(rng, (40, 64), "C"), _operand(rng, (64, 50), "T")
    a[3, 5], a[7, 9], b[11, 20] = np.inf, np.nan, -np.inf
    with np.errstate(invalid="ignore"):
        want = a @ b
        got = _product(a, b, 1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize(("m", "k", "n"), [(300, 70, 45), (200, 700, 96), (97, 33, 40)])
def test_amx_row_chunks_give_the_fixed_parts_bits(m, k, n, monkeypatch):
    """Products with fewer columns than rows: on two parts each packs all of B once and the parts take chunks
    of rows in turn (``gemm_rows``; edge rows, K in one block). The same bits as fixed halves of the rows and as
    one part (every element summed in the same order), and an operand with an inf or NaN still goes to BLAS."""
    monkeypatch.setattr(amx, "MACS_PER_PART", 1)
    rng = np.random.default_rng(m + k + n)
    a, b = _operand(rng, (m, k), "C"), _operand(rng, (k, n), "T") / np.float32(np.sqrt(k))
    assert amx.plan(m, k, n, 2).row_chunks and len(amx.plan(m, k, n, 2).parts) == 2
    chunked = _product(a, b, 2)
    np.testing.assert_allclose(chunked, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
    assert np.array_equal(chunked, _product(a, b, 1))
    monkeypatch.setattr(amx, "B_WHOLE_BYTES", 0)  # B never packed whole: fixed halves of the rows
    assert not amx.plan(m, k, n, 2).row_chunks and len(amx.plan(m, k, n, 2).parts) == 2
    assert np.array_equal(chunked, _product(a, b, 2))
    monkeypatch.undo()
    monkeypatch.setattr(amx, "MACS_PER_PART", 1)
    a[m - 1, 2], b[5, n - 1] = np.inf, np.nan
    with np.errstate(invalid="ignore"):
        want, got = a @ b, _product(a, b, 2)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))


def test_amx_is_refused_with_a_reason_when_turned_off(monkeypatch):
    monkeypatch.setenv("LUMINAL_RECIPES_AMX", "0")
    amx.reason_unavailable.cache_clear()
    try:
        assert amx.reason_unavailable() == "LUMINAL_RECIPES_AMX=0"
    finally:
        monkeypatch.delenv("LUMINAL_RECIPES_AMX")
        amx.reason_unavailable.cache_clear()


@needs_amx
@pytest.mark.parametrize("case", ["linear_bias", "transposed_batched"])
def test_matmul_kernel_runs_on_amx_within_the_f32_tolerance(case, numpy_runtime, monkeypatch):
    """The numpy runtime's MatMul takes the AMX path for large f32 products (a linear layer with a bias over a
    batch: column chunks taken in turn; per-head products of transposed operands: row chunks taken in turn) and
    gives the reference's values; the same bits on 1, 2 and 3 parts; with AMX refused it takes BLAS and agrees
    within the tolerance."""
    rng = np.random.default_rng(11)
    g = Graph()
    f = Fused(g)
    if case == "linear_bias":
        x, w, bias = g.input("x", (2, 70, 96)), g.weight("w", (300, 96)), g.weight("bias", (300,))
        g.mark_output("y", ops.linear(x, w, bias))
        f = Fused(g)
        shape = (2, 70, 300)
        wv = w.T.unsqueeze(0).broadcast_to((2, 96, 300))
        y = f.add("MatMul", [x, wv, bias.broadcast_to(shape)], shape)
        inputs = {"x": rng.standard_normal((2, 70, 96)).astype(np.float32)}
        weights = {"w": rng.standard_normal((300, 96)).astype(np.float32),
                   "bias": rng.standard_normal(300).astype(np.float32)}
    else:
        a, b = g.input("a", (3, 67, 160)), g.input("b", (3, 100, 67))
        av, bv = a.transpose(1, 2), b.transpose(1, 2)  # [3, 160, 67] @ [3, 67, 100]
        g.mark_output("y", ops.matmul(av, bv))
        f = Fused(g)
        y = f.add("MatMul", [av, bv], (3, 160, 100))
        inputs = {"a": rng.standard_normal((3, 67, 160)).astype(np.float32),
                  "b": rng.standard_normal((3, 100, 67)).astype(np.float32)}
        weights = {}
    program = f.program(y=y)
    want = run_reference(g, {**inputs, **weights})["y"]
    calls = []
    product = amx.product
    monkeypatch.setattr(amx, "product", lambda *args: calls.append(1) or product(*args))
    monkeypatch.setattr(amx, "MIN_MACS", 1)
    monkeypatch.setattr(amx, "MACS_PER_PART", 1)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(program, inputs, weights)["y"])
    assert calls, "the MatMul did not take the AMX path"
    np.testing.assert_allclose(results[0], want, rtol=1e-5, atol=1e-5)
    for other in results[1:]:
        assert np.array_equal(other, results[0])
    calls.clear()
    monkeypatch.setattr(amx, "worth_it", lambda *args, **kwargs: False)
    blas = numpy_runtime.run(program, inputs, weights)["y"]
    assert not calls
    np.testing.assert_allclose(blas, results[0], rtol=1e-5, atol=1e-5)


@needs_amx
def test_matmul_with_few_rows_stays_on_blas(numpy_runtime, monkeypatch):
    """A MatMul with fewer than ``amx.MIN_SIDE`` rows (a VAE's 1x1 convolution: few output channels, many
    pixels) is multiplied by BLAS, even when large: splitting its wide operand would cost more than its
    product."""
    rng = np.random.default_rng(5)
    g = Graph()
    w, x = g.weight("w", (16, 32)), g.input("x", (1, 32, 4096))
    g.mark_output("y", ops.matmul(w.unsqueeze(0).broadcast_to((1, 16, 32)), x))
    f = Fused(g)
    y = f.add("MatMul", [w.unsqueeze(0).broadcast_to((1, 16, 32)), x], (1, 16, 4096))
    inputs, weights = {"x": rng.standard_normal((1, 32, 4096)).astype(np.float32)}, {
        "w": rng.standard_normal((16, 32)).astype(np.float32)}
    calls = []
    product = amx.product
    monkeypatch.setattr(amx, "product", lambda *args: calls.append(1) or product(*args))
    monkeypatch.setattr(amx, "MIN_MACS", 1)
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    assert not calls
    np.testing.assert_allclose(got, run_reference(g, {**inputs, **weights})["y"], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(amx, "MIN_SIDE", 16)  # the same product allowed on AMX takes it
    numpy_runtime.run(f.program(y=y), inputs, weights)
    assert calls


@needs_amx
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_products_run_on_amx(with_bias, numpy_runtime, monkeypatch):
    """The Attention kernel's products per (head, query block) on AMX, each part with its own packing buffers:
    without a bias both (``amx_attention.task``: the softmax pass writes p's bf16 parts), with a mask bias
    q k^T only (p v on BLAS); grouped-query heads (k and v read through stride-0 views), query blocks not a
    multiple of 32 rows, on 1 and 2 parts; the reference's values and the same bits on both."""
    b, h, hkv, s, t, d = 1, 4, 2, 50, 70, 40
    g = Graph()
    q, k, v = g.input("q", (b, h, s, d)), g.input("k", (b, hkv, t, d)), g.input("v", (b, hkv, t, d))
    bias = g.input("bias", (b, 1, s, t)) if with_bias else None
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, mask=bias, scale=0.3))
    rep = h // hkv
    views = [q.split_dim(1, (hkv, rep)), k.unsqueeze(2).broadcast_to((b, hkv, rep, t, d)),
             v.unsqueeze(2).broadcast_to((b, hkv, rep, t, d))]
    rng = np.random.default_rng(4)
    inputs = {name: rng.standard_normal(x.shape).astype(np.float32) for name, x in (("q", q), ("k", k), ("v", v))}
    if with_bias:
        views.append(bias.unsqueeze(1).broadcast_to((b, hkv, rep, s, t)))
        mask = rng.random((b, 1, s, t)) < 0.3
        mask[..., 0] = False
        inputs["bias"] = np.where(mask, np.finfo(np.float32).min, 0.0).astype(np.float32)
    f = Fused(g)
    y = f.add("Attention", views, (b, hkv, rep, s, d), scale=0.3)
    program = f.program()
    program.outputs["y"] = (y, View.contiguous((b, hkv, rep, s, d)).reshape((b, h, s, d)))
    calls, fused = [], []
    multiply = amx.multiply
    monkeypatch.setattr(amx, "multiply", lambda *args: calls.append(1) or multiply(*args))
    from luminal_recipes.runtimes.cpu.amx import attention as amx_attention  # numba: only where AMX runs

    task = amx_attention.task
    monkeypatch.setattr(amx_attention, "task", lambda *args: fused.append(1) or task(*args))
    monkeypatch.setattr(amx, "MIN_MACS", 1)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
        results.append(numpy_runtime.run(program, inputs)["y"])
    took = (bool(calls), bool(fused))
    assert took == ((True, False) if with_bias else (False, True)), f"AMX paths taken (q k^T, fused): {took}"
    np.testing.assert_allclose(results[0], run_reference(g, inputs)["y"], rtol=1e-5, atol=1e-5)
    assert np.array_equal(results[1], results[0])
