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
        xv = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)  # outputs of O(1), as the policy assumes
        got = numpy_runtime.run(program, {"x": xv}, {"w": raw})["y"]
        want = run_reference(g, {"x": xv}, {"w": raw}, mode="f64")["y"]
        assert_close("runtime", got, want.astype(np.float32), "f32")
