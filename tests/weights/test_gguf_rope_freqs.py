"""Llama 3.1-style RoPE scaling in a GGUF file: llama.cpp's converter writes no metadata for rope_type llama3 but
the tensor ``rope_freqs.weight`` (the factor each frequency is divided by); ``recipes/llama.yaml`` divides by it
as llama.cpp's RoPE does. The fixture ``tiny-llama-rope3.gguf`` (tests/fixtures/gguf/make_fixtures.py) was
converted from a tiny LlamaForCausalLM saved by transformers with ``rope_scaling`` llama3 (``ROPE_LLAMA3``).

transformers' GGUF loader drops the tensor (its model then runs the default RoPE: a different model), so the
reference is transformers' GGUF path given the checkpoint's ``rope_scaling`` (``from_pretrained(...,
rope_scaling=...)``: ``_compute_llama3_parameters``), in float64; llama.cpp itself (llama-cpp-python, where
installed) is a second reference on the file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from luminal_recipes.tasks.generation import LanguageModel  # noqa: E402
from luminal_recipes.weights.gguf_io import GgufCheckpoint  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
FILE = FIXTURES / "tiny-llama-rope3.gguf"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama.yaml"
# long enough that the scaled frequencies turn by radians more than the default ones
PROMPT = "Hello world, 12 naïve cafés 🦙 " * 4


def _rope_llama3() -> dict:
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROPE_LLAMA3


def _transformers(**overrides):
    return transformers.AutoModelForCausalLM.from_pretrained(FILE.parent, gguf_file=FILE.name, dtype=torch.float32,
                                                             **overrides).eval()


@pytest.fixture(scope="module")
def lm():
    model = LanguageModel(RECIPE, weights=FILE, compile=False)
    yield model
    model.release()


def test_the_file_states_the_factors_and_the_reader_passes_them_on():
    ckpt = GgufCheckpoint.open(FILE)
    assert ckpt.config["rope_freq_factors"] is True
    factors = ckpt.load("model.rotary_emb.freq_factors")
    rope = _rope_llama3()
    reference = _transformers(rope_scaling=rope).model.rotary_emb.inv_freq.double().numpy()
    base = 1.0 / rope["rope_theta"] ** (np.arange(0, 8, 2) / 8)
    assert np.allclose(base / factors, reference, rtol=1e-6)
    assert len(set(np.round(factors, 3))) == 3  # kept, smoothed and divided frequencies all occur


def test_logits_and_greedy_ids_are_the_llama3_models(lm, assert_close):
    rope = _rope_llama3()
    tokenizer = transformers.AutoTokenizer.from_pretrained(FILE.parent, gguf_file=FILE.name)
    ids = tokenizer(PROMPT)["input_ids"]
    scaled = _transformers(rope_scaling=rope)
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = scaled.generate(prompt, do_sample=False, max_new_tokens=8,
                               attention_mask=torch.ones_like(prompt))[0, len(ids):].tolist()
        expected = scaled.double()(prompt).logits[0].numpy()
        default_rope = _transformers().double()(prompt).logits[0].numpy()  # what transformers' GGUF path runs
    got = lm.logits(ids)
    assert_close("model", got, expected)
    assert np.abs(got - default_rope).max() > 100 * np.abs(got - expected).max()  # the factors change the model
    assert lm.generate(ids, max_new_tokens=8).ids == want


def test_greedy_ids_equal_llama_cpp(lm):
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = lm.encode(PROMPT, chat=False)
    llm = llama_cpp.Llama(str(FILE), n_ctx=128, n_threads=1, n_batch=1, verbose=False)  # n_batch=1: bench/llm_gguf.py
    theirs = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        theirs.append(int(token))
        if len(theirs) == 8:
            break
    assert lm.generate(ids, max_new_tokens=8).ids == theirs
