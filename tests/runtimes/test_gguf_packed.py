"""GGUF files run packed end to end: tiny Llamas quantized by llama.cpp's own quantizer (Q4_1, Q8_0, Q4_K_M:
Q4_K and Q6_K blocks; IQ4_NL, IQ4_XS; ``tests/fixtures/gguf_quant/make_quant_fixtures.py``) keep their weights as
the file's bytes, decoded inside the products and the embedding lookup, and generate exactly the greedy ids of the
dequantize-at-load path (``LUMINAL_RECIPES_GGUF=dense``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from luminal_recipes.graph import gguf_blocks

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf_quant"
FILES = ["tiny-llama-q4_1.gguf", "tiny-llama-q8_0.gguf", "tiny-llama-q4_k_m.gguf", "tiny-llama-iq4_nl.gguf",
         "tiny-llama-iq4_xs.gguf"]
PROMPT = [1, 17, 250, 33, 901, 5, 77, 412, 9, 640, 18, 3]


def _records(name: str):
    from luminal_recipes.weights.gguf_io import GgufCheckpoint

    return GgufCheckpoint.open(FIXTURES / name).records.values()


def test_llama_cpp_quantized_blocks_decode_bit_for_bit():
    """Every block llama.cpp's quantizer wrote (Q4_1, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS) decodes to gguf-py's
    values, in numpy and in the compiled decoder."""
    from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gguf_jit
    from luminal_recipes.runtimes.cpu.kernels import gguf as numpy_gguf

    table = gguf_jit.f16_table()
    seen = set()
    for name in FILES:
        for record in _records(name):
            if not record.quantized:
                continue
            qtype = record.type_name
            seen.add(qtype)
            raw = np.asarray(record.raw).reshape(-1, gguf_blocks.row_bytes(qtype, record.stored_shape[-1]))
            want = gguf.quants.dequantize(raw, record.qtype)
            assert np.array_equal(gguf_blocks.dequantize(raw, qtype).view(np.uint32), want.view(np.uint32))
            out = np.empty(want.shape, np.float32)
            kind, bs, ts, sl, nsub, has_c = numpy_gguf.layout(qtype, want.shape[1])
            gguf_jit.dequant_any(raw, out, kind, bs, ts, sl, nsub, has_c, table)
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), (name, record.name)
    assert seen == {"Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS"}


def _generate(name: str):
    from luminal_recipes.tasks.generation.model import LanguageModel

    lm = LanguageModel(ROOT / "recipes" / "llama.yaml", weights=FIXTURES / name)
    reply = lm.generate(PROMPT, max_new_tokens=10)
    logits = lm.logits(PROMPT)
    return lm, reply.ids, logits


@pytest.mark.parametrize("name", FILES)
def test_packed_run_gives_the_dequantized_runs_greedy_ids(name, monkeypatch, assert_close):
    lm, ids, logits = _generate(name)
    graph = lm.model.graph
    packed = [n for n in graph.inputs("weight") if n.dtype.value == "u8"]
    assert len(packed) == 16  # q, k, v, o, gate, up, down x 2 layers, the embedding and the LM head
    # decoding, as the cost model plans it: every product reads its weight packed (never a dense copy of a weight;
    # the timed search may still prefer a dense tiny weight where it measured that faster on a loaded machine)
    from luminal_recipes.compiler.search import SearchOptions, compile_graph

    dims = {"batch": 1, "seq": 1, "ctx": 16, "cache": 16, "keep": 1}
    kernels = compile_graph(graph, lm.runtime, dims, options=SearchOptions(time_top=0, use_cache=False)
                            ).program.kernel_counts()
    assert kernels.get("DequantMatMulGGUF", 0) == 15 and kernels.get("GatherDequant", 0) == 1, kernels
    assert "Dequant" not in kernels
    monkeypatch.setenv("LUMINAL_RECIPES_GGUF", "dense")
    dense, dense_ids, dense_logits = _generate(name)
    assert not [n for n in dense.model.graph.inputs("weight") if n.dtype.value == "u8"]
    assert ids == dense_ids
    assert_close("xint15_run", logits, dense_logits, "f32")  # every product rounds x per block of 32 (gguf_q8)
