"""GGUF block kernels on every runtime: the ``Dequant`` primitive and ``GatherDequant`` bit for bit against
llama.cpp's gguf-py for every type (edge scales included), ``DequantMatMulGGUF`` on both of numpy's paths (the
fused pass for few rows of x, decoded bands + BLAS for many) with and without numba."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.compiler.search import SearchOptions, search_segment
from luminal_recipes.compiler.segments import assemble, split
from luminal_recipes.graph import Graph, dequant, gguf_blocks, run_reference
from luminal_recipes.runtimes.program import Program

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_data import packed  # noqa: E402

gguf = pytest.importorskip("gguf")
QTYPES = list(gguf_blocks.QTYPES)
Q8_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # gguf_q8.KINDS


def _want(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def _compiled(g: Graph, runtime) -> Program:
    segments = split(g)
    found = {s.key: search_segment(s, runtime.capabilities().__contains__, {}, SearchOptions(time_top=0))[0]
             for s in segments}
    return assemble(g, segments, [found[s.key][0] for s in segments])


@pytest.mark.parametrize("qtype", QTYPES)
def test_decoding_and_lookup_are_gguf_py_bit_for_bit(qtype, runtime):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    raw = packed(rng, qtype, 9, 2, edge=True)
    g = Graph()
    w = g.weight("w", raw.shape, "u8")
    g.mark_output("dense", dequant(w, qtype))
    index = np.array([[8, 0, 3], [3, 8, 5]], np.int32)
    want = _want(raw, qtype)
    got = runtime.run(Program.from_graph(g), {}, {"w": raw})["dense"]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    g2 = Graph()
    w2 = g2.weight("w", raw.shape, "u8")
    g2.mark_output("rows", ops.embedding(g2.input("ids", (2, 3), "i32"), dequant(w2, qtype)))
    program = _compiled(g2, runtime)
    assert program.kernel_counts().get("GatherDequant") == 1, program.kernel_counts()
    rows = runtime.run(program, {"ids": index}, {"w": raw})["rows"]
    assert np.array_equal(rows.view(np.uint32), want[index].view(np.uint32))


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 40])
def test_products_of_every_type_match_the_reference(rows, jit, numpy_runtime, assert_close, monkeypatch):
    from luminal_recipes.runtimes.cpu import jit as jit_module

    if not jit:
        monkeypatch.setattr(jit_module, "AVAILABLE", False)
    rng = np.random.default_rng(rows)
    k = 512
    for qtype in QTYPES:
        blocks = k // (32 if gguf_blocks.block_size(qtype) == 1 else gguf_blocks.block_size(qtype))
        raw = packed(rng, qtype, 37, blocks)
        g = Graph()
        x = g.input("x", (rows, k))
        g.mark_output("y", ops.linear(x, dequant(g.weight("w", raw.shape, "u8"), qtype)))
        program = _compiled(g, numpy_runtime)
        assert program.kernel_counts().get("DequantMatMulGGUF") == 1, (qtype, program.kernel_counts())
        xv = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
        want = run_reference(g, {"x": xv}, {"w": raw}, mode="f64")["y"]
        xv = (xv / max(1.0, float(np.sqrt(np.mean(want ** 2))))).astype(np.float32)  # outputs of O(1), as the
        # policy assumes (the random K-quant scales give rms 4-16 at this x)
        got = numpy_runtime.run(program, {"x": xv}, {"w": raw})["y"]
        want = run_reference(g, {"x": xv}, {"w": raw}, mode="f64")["y"]
        # up to 64 rows the products of these types round x per block of 32 (runtimes/cpu/jit/gguf_q8.py)
        family = "xint15" if jit and rows <= 64 and qtype in Q8_TYPES else "runtime"
        assert_close(family, got, want.astype(np.float32), "f32")


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_integer_products_are_the_dequantized_weight_times_the_rounded_x(qtype, rows):
    """The fused integer pass (llama.cpp's scheme) is exact up to f32 scales and sums: the f64 product of gguf-py's
    dequantized weight with x rounded per block of 32 to integers |v| <= 16256 (steps max|x_block| / 16256), for
    one row of x (decoding), a tile of 4 and 4 + 2 (a small batch)."""
    jit_module = pytest.importorskip("luminal_recipes.runtimes.cpu.jit")
    if not jit_module.AVAILABLE:
        pytest.skip("numba is not installed")
    from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk
    from luminal_recipes.runtimes.cpu.jit import gguf_q8

    rng = np.random.default_rng(sum(map(ord, qtype)) + rows)
    k, n = 512, 37
    raw = packed(rng, qtype, n, k // gguf_blocks.block_size(qtype))
    x = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: step 0, codes 0
    xq = np.zeros((rows, 2 * k), np.int8)
    xd, xs = np.zeros((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32)
    gguf_q8.quantize(x, xq, xd, xs)
    v = gguf_q8.codes(xq)
    step = np.repeat(xd, 32, axis=1)
    assert np.all(np.abs(v * step - x) <= step * 0.51)  # x / d is rounded in f32 first
    peak = np.abs(v).reshape(rows, -1, 32).max(axis=2)
    assert np.array_equal(peak[:, 1:], np.full((rows, k // 32 - 1), 16256)) and peak[0, 0] == 0
    np.testing.assert_allclose(xs, xd * v.reshape(rows, -1, 32).sum(axis=2), rtol=1e-6)
    out = np.zeros((rows, n), np.float32)
    gguf_q8.matmul_q8(raw, xq, xd, xs, out, 0, n, gk.KINDS[qtype], gk.f16_table())
    want = (v * step) @ _want(raw, qtype).astype(np.float64).T
    assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max()
    part = np.zeros((rows, n), np.float32)  # a row range (the threads' parts) gives the same values
    gguf_q8.matmul_q8(raw, xq, xd, xs, part, 5, 22, gk.KINDS[qtype], gk.f16_table())
    assert np.array_equal(part[:, 5:22], out[:, 5:22]) and not part[:, :5].any() and not part[:, 22:].any()


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_products_over_batch_rows_and_odd_row_ranges(qtype):
    """The K-quant integer products (two x-blocks per 64 code bytes, vector-unpacked scales, offsets through the
    sums of x per sub-block) against gguf-py's dequantized weight times the rounded x, for every count of rows of x
    from 1 to 64 (each remainder of the 4-row tile) and odd ranges of weight rows, with random scale and code bytes
    and the f16 d / dmin at their edges (gguf_data.EDGE_SCALES): a wrongly unpacked scale or high bit fails."""
    jit_module = pytest.importorskip("luminal_recipes.runtimes.cpu.jit")
    if not jit_module.AVAILABLE:
        pytest.skip("numba is not installed")
    from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk
    from luminal_recipes.runtimes.cpu.jit import gguf_q8

    rng = np.random.default_rng(sum(map(ord, qtype)) + 64)
    k, n = 768, 13
    raw = packed(rng, qtype, n, k // 256, edge=True)
    w = _want(raw, qtype).astype(np.float64)
    f16 = gk.f16_table()
    x_all = (rng.standard_normal((64, k)) * 0.05).astype(np.float32)
    for rows in list(range(1, 10)) + [15, 31, 33, 64]:
        x = x_all[:rows]
        xq = np.zeros((rows, 2 * k), np.int8)
        xd, xs = np.zeros((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32)
        gguf_q8.quantize(x, xq, xd, xs)
        want = (gguf_q8.codes(xq) * np.repeat(xd, 32, axis=1)) @ w.T
        out = np.zeros((rows, n), np.float32)
        lo, hi = (0, n) if rows % 2 else (3, n - 1)  # odd weight-row ranges as the threads split them
        gguf_q8.matmul_q8(raw, xq, xd, xs, out, lo, hi, gk.KINDS[qtype], f16)
        assert not out[:, :lo].any() and not out[:, hi:].any()
        err = np.abs(out[:, lo:hi] - want[:, lo:hi]).max()
        assert err <= 1e-6 * np.abs(want[:, lo:hi]).max(), (qtype, rows, err)
