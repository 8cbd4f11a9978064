"""IQ4_NL and IQ4_XS files quantized by llama.cpp (its non-linear 4-bit types: codes index a 16-value table; IQ4_XS
adds 6-bit sub-block scales) run packed, against transformers' GGUF loader (gguf-py's dequantization) in float64.
No integer product for them: a prompt's products are exact decoding into bands + BLAS, a decoding step's
``gguf_more.matmul_iq4`` (f32), so only the order of the f32 sums differs from the reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf_quant"
PROMPT = [1, 17, 250, 33, 901, 5, 77, 412, 9, 640, 18, 3]


def _reference(path: Path) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).double().eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_packed_iq4_logits_match_the_exact_reference(qtype):
    from luminal_recipes.tasks.generation.model import LanguageModel

    path = FIXTURES / f"tiny-llama-{qtype.lower()}.gguf"
    kinds = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    assert kinds[qtype] == 15, kinds  # every matrix but the output (Q6_K), the embedding table too
    reference = _reference(path)
    lm = LanguageModel(ROOT / "recipes" / "llama.yaml", weights=path)
    ours = np.asarray(lm.logits(PROMPT), np.float64)
    assert ours.shape == reference.shape
    # f32 vs float64 through two layers of random weights (logits of std ~3): measured 4.0e-5 for both files (the
    # Q5_0 requantization, also on the f32 loops, 4.2e-5); the same model's Q8_0 file is 6.5e-1 away from these
    # references, so a decoding wrong by a fraction of a quantization step would show
    rel = float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))
    assert rel < 2e-4, rel
    assert np.array_equal(ours.argmax(-1), reference.argmax(-1))
