"""The fused dequant products of ``runtimes/cpu/jit/gguf_more.py`` (Q5_0, Q5_1, Q2_K, Q3_K, F16, BF16, IQ4_NL,
IQ4_XS): against llama.cpp's gguf-py decoding (``gguf.quants.dequantize``) and an f64 product, called directly (every
row count of the fused path, rows split as the cores split them) and through a compiled ``DequantMatMulGGUF``;
F16/BF16 conversion bit for bit on every finite half."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.graph import Graph, dequant, gguf_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_data import packed  # noqa: E402

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")
from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_more  # noqa: E402
from luminal_recipes.runtimes.cpu.kernels.gguf import layout  # noqa: E402

MORE = [q for q, kind in gk.KINDS.items() if kind in gguf_more.SPECIALISED]


def _decoded(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)


def _product(raw: np.ndarray, x: np.ndarray, qtype: str, parts: int = 1) -> np.ndarray:
    kind, bs, ts, sl, nsub, has_c = layout(qtype, x.shape[1])
    xs = np.empty((x.shape[0], x.shape[1] // sl), np.float32)
    gk._sums(x, xs, sl)
    out = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    bounds = np.linspace(0, raw.shape[0], parts + 1).astype(int)
    for n0, n1 in zip(bounds[:-1], bounds[1:]):
        gk.SPECIALISED[kind](raw, x, xs, out, int(n0), int(n1), kind, gk.f16_table())
    return out


def test_every_type_without_its_own_loop_has_one_now():
    assert set(MORE) == {"Q5_0", "Q5_1", "Q2_K", "Q3_K", "F16", "BF16", "IQ4_NL", "IQ4_XS"}
    for qtype in MORE:
        assert gk.SPECIALISED[gk.KINDS[qtype]] is gguf_more.SPECIALISED[gk.KINDS[qtype]]


@pytest.mark.parametrize("qtype", MORE)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_fused_product_matches_gguf_py_decoding(qtype, rows, assert_close):
    rng = np.random.default_rng(rows * 100 + sum(map(ord, qtype)))
    k = 1024 if gguf_blocks.block_size(qtype) == 256 else 320
    blocks = k // (32 if gguf_blocks.block_size(qtype) == 1 else gguf_blocks.block_size(qtype))
    raw = packed(rng, qtype, 29, blocks)
    x = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    want = x.astype(np.float64) @ _decoded(raw, qtype).T
    got = _product(raw, x, qtype)
    assert_close("runtime", got, want, "f32")
    split = _product(raw, x, qtype, parts=3)  # the cores' row split computes each row the same way
    assert np.array_equal(split, got)


@pytest.mark.parametrize("qtype", [q for q in MORE if gguf_blocks.block_size(q) > 1])  # float rows: no scales
def test_edge_scales(qtype, assert_close):
    """Zero, subnormal and the largest finite f16 scales (the quantizer writes them for all-zero or tiny blocks)."""
    rng = np.random.default_rng(7)
    raw = packed(rng, qtype, 16, 4, edge=True)
    k = 4 * gguf_blocks.block_size(qtype)
    x = (rng.standard_normal((2, k)) * 0.05).astype(np.float32)
    assert_close("runtime", _product(raw, x, qtype), x.astype(np.float64) @ _decoded(raw, qtype).T, "f32")


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_f16_and_bf16_convert_every_finite_value_exactly(qtype):
    """x = the identity picks each weight: out[m, n] is W[n, m] itself, for every finite 16-bit pattern
    (subnormal halves included), compared bit for bit with gguf-py's decoding."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    exponent_mask = 0x7C00 if qtype == "F16" else 0x7F80
    finite = bits[(bits & exponent_mask) != exponent_mask]
    k = 64
    finite = finite[: len(finite) // k * k]
    raw = finite.view(np.uint8).reshape(-1, 2 * k)
    got = _product(raw, np.eye(k, dtype=np.float32), qtype).T
    want = _decoded(raw, qtype).astype(np.float32)
    assert np.array_equal(got, want)  # -0 sums to +0 (1 * -0 + 0 * ...), equal as values
    # Inf and NaN weights propagate as in the reference product
    special = np.array([0x7C00, 0xFC00, 0x7E00] if qtype == "F16" else [0x7F80, 0xFF80, 0x7FC0], np.uint16)
    row = np.zeros((3, k), np.uint16)
    row[np.arange(3), [5, 9, 63]] = special
    x = np.ones((1, k), np.float32)
    got = _product(row.view(np.uint8), x, qtype)
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float64) @ _decoded(row.view(np.uint8), qtype).T
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[np.isinf(want)],
                                                                          want[np.isinf(want)])


@pytest.mark.parametrize("qtype", MORE)
def test_compiled_product_takes_the_fused_loop(qtype, numpy_runtime, assert_close, monkeypatch):
    """A decoding step's ``DequantMatMulGGUF`` (one row of x) runs this module's loop (for Q2_K and Q3_K: with
    their integer products taken out) and matches the reference interpreter."""
    from luminal_recipes.compiler.search import SearchOptions, search_segment
    from luminal_recipes.compiler.segments import assemble, split
    from luminal_recipes.graph import run_reference

    used = []
    kind = gk.KINDS[qtype]
    loop = gguf_more.SPECIALISED[kind]
    monkeypatch.setitem(gk.SPECIALISED, kind, lambda *a: (used.append(kind), loop(*a)))
    from luminal_recipes.runtimes.cpu.jit import gguf_q8  # Q2_K, Q3_K: the integer products (gguf_q8) come first;
    monkeypatch.setattr(gguf_q8, "KINDS", tuple(c for c in gguf_q8.KINDS if c != kind))  # their f32 loops here
    rng = np.random.default_rng(3)
    k = 512
    blocks = k // (32 if gguf_blocks.block_size(qtype) == 1 else gguf_blocks.block_size(qtype))
    raw = packed(rng, qtype, 24, blocks)
    g = Graph()
    g.mark_output("y", ops.linear(g.input("x", (1, k)), dequant(g.weight("w", raw.shape, "u8"), qtype)))
    segments = split(g)
    found = {s.key: search_segment(s, numpy_runtime.capabilities().__contains__, {}, SearchOptions(time_top=0))[0]
             for s in segments}
    program = assemble(g, segments, [found[s.key][0] for s in segments])
    assert program.kernel_counts().get("DequantMatMulGGUF") == 1
    x = (rng.standard_normal((1, k)) * 0.05).astype(np.float32)
    got = numpy_runtime.run(program, {"x": x}, {"w": raw})["y"]
    assert used, "the fused loop of gguf_more did not run"
    assert_close("runtime", got, run_reference(g, {"x": x}, {"w": raw}, mode="f64")["y"].astype(np.float32), "f32")
