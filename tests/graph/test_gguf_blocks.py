"""GGUF block decoding (``graph.gguf_blocks``, the ``Dequant`` primitive's definition, and the compiled
``runtimes.cpu.jit.gguf_kernels``) bit for bit against llama.cpp's gguf-py (``gguf.quants.dequantize``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes.errors import DTypeError, ShapeError
from luminal_recipes.graph import Graph, dequant, gguf_blocks, run_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_data import elements, packed  # noqa: E402

gguf = pytest.importorskip("gguf")
QTYPES = list(gguf_blocks.QTYPES)


def _want(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.dtype == np.float32 and np.array_equal(got.view(np.uint32),
                                                                                  want.view(np.uint32))


def _cases(qtype: str):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    yield "finite scales", packed(rng, qtype, 6, 3)
    yield "edge scales", packed(rng, qtype, 6, 3, edge=True)
    _, bs, ts = gguf_blocks.QTYPES[qtype]
    # every byte random: scales that are inf or NaN too (decoded as gguf-py decodes them)
    yield "random bytes", rng.integers(0, 256, (5, 4 * ts), dtype=np.uint8)


@pytest.mark.parametrize("qtype", QTYPES)
def test_numpy_decoding_is_gguf_py_bit_for_bit(qtype):
    for what, raw in _cases(qtype):
        assert _same_bits(gguf_blocks.dequantize(raw, qtype), _want(raw, qtype)), (qtype, what)


@pytest.mark.parametrize("qtype", QTYPES)
def test_compiled_decoding_is_gguf_py_bit_for_bit(qtype):
    pytest.importorskip("numba")
    from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gguf_jit
    from luminal_recipes.runtimes.cpu.kernels import gguf as numpy_gguf

    table = gguf_jit.f16_table()
    for what, raw in _cases(qtype):
        k = raw.shape[1] // gguf_blocks.type_size(qtype) * gguf_blocks.block_size(qtype)
        out = np.full((raw.shape[0], k), np.nan, np.float32)
        kind, bs, ts, sl, nsub, has_c = numpy_gguf.layout(qtype, k)
        gguf_jit.dequant_any(raw, out, kind, bs, ts, sl, nsub, has_c, table)
        assert _same_bits(out, _want(raw, qtype)), (qtype, what)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"])
def test_values_quantized_by_gguf_py_decode_close_to_them(qtype):
    """Blocks made by gguf-py's quantizer from known values decode to those values within the type's step."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((4, 128)).astype(np.float32)
    raw = np.asarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])).view(np.uint8)
    raw = raw.reshape(4, -1)
    got = gguf_blocks.dequantize(raw, qtype)
    assert _same_bits(got, _want(raw, qtype))
    step = {"Q4_0": 0.6, "Q4_1": 0.4, "Q5_0": 0.3, "Q5_1": 0.2, "Q8_0": 0.03, "BF16": 0.02, "F16": 0.002}[qtype]
    assert np.abs(got - values).max() < step


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "F16"])
def test_the_primitive_decodes_in_the_reference_interpreter(qtype):
    rng = np.random.default_rng(3)
    raw = packed(rng, qtype, 5, 2)
    g = Graph()
    w = g.weight("w", raw.shape, "u8")
    g.mark_output("dense", dequant(w, qtype))
    g.mark_output("half", dequant(w, qtype, "f16"))
    got = run_reference(g, weights={"w": raw})
    assert got["dense"].shape == (5, elements(qtype, 2))
    assert _same_bits(got["dense"], _want(raw, qtype))
    assert np.array_equal(got["half"], _want(raw, qtype).astype(np.float16))


def test_the_primitive_refuses_what_is_not_packed_blocks():
    g = Graph()
    with pytest.raises(DTypeError, match="unknown GGUF quantization type 'IQ2_XS'"):
        dequant(g.weight("a", (2, 66), "u8"), "IQ2_XS")
    with pytest.raises(DTypeError, match="must be u8 bytes, got f32"):
        dequant(g.weight("b", (2, 36), "f32"), "Q4_0")
    with pytest.raises(ShapeError, match="not whole Q4_K blocks of 144 bytes"):
        dequant(g.weight("c", (2, 100), "u8"), "Q4_K")
