"""The K-quant products with x rounded to 8 bits (``LUMINAL_RECIPES_GGUF_X_BITS=8``, ``gguf_q8.quant_product_x8``):
exactly gguf-py's dequantized weight times x rounded per block of 32 to |v| <= 127 (steps max|x_block| / 127), for
every remainder of the 4-row tile of x and odd weight-row ranges; the option read from the environment (a bad value
a located error); the default stays 15 bits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_data import packed  # noqa: E402

gguf = pytest.importorskip("gguf")
jit_module = pytest.importorskip("luminal_recipes.runtimes.cpu.jit")
if not jit_module.AVAILABLE:
    pytest.skip("numba is not installed", allow_module_level=True)

from luminal_recipes.errors import QuantizationError  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_q8  # noqa: E402


def _rounded8(x: np.ndarray) -> np.ndarray:
    """x rounded as the 8-bit option does (f32 steps and reciprocals), as f64 values v d."""
    b = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(b).max(axis=2, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = np.clip(np.rint((b * inv).astype(np.float32)), -127, 127)
    return (v * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_products_on_8_bit_x(qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)) + 8)
    k, n = 512, 13
    raw = packed(rng, qtype, n, k // 256, edge=True)
    with np.errstate(all="ignore"):
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    f16 = gk.f16_table()
    x_all = (rng.standard_normal((9, k)) * 0.05).astype(np.float32)
    x_all[0, :32] = 0.0
    for rows in range(1, 10):
        x = x_all[:rows]
        want = _rounded8(x) @ w.T
        lo, hi = (0, n) if rows % 2 else (3, n - 1)
        out = np.zeros((rows, n), np.float32)
        xq = np.zeros((rows, 2 * k), np.int8)
        xd, xs = np.zeros((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32)
        gguf_q8.quant_product_x8(x, xq, xd, xs, np.zeros((rows, k // 16), np.float32), raw, out, lo, hi,
                                 gk.KINDS[qtype], f16)
        assert not out[:, :lo].any() and not out[:, hi:].any()
        err = np.abs(out[:, lo:hi] - want[:, lo:hi]).max()
        assert err <= 1e-6 * np.abs(want[:, lo:hi]).max(), (qtype, rows, err)
        # and it is not the 15-bit product: the rounding differs measurably
        exact = x.astype(np.float64) @ w.T
        assert np.abs(out - exact)[:, lo:hi].max() > 1e-4 * np.abs(exact).max()


def test_x_bits_from_the_environment(monkeypatch):
    monkeypatch.delenv(gguf_q8.X_BITS_ENV, raising=False)
    assert gguf_q8.x_bits() == 15
    monkeypatch.setenv(gguf_q8.X_BITS_ENV, "8")
    assert gguf_q8.x_bits() == 8
    monkeypatch.setenv(gguf_q8.X_BITS_ENV, "7")
    with pytest.raises(QuantizationError, match="LUMINAL_RECIPES_GGUF_X_BITS='7'.*15.*8"):
        gguf_q8.x_bits()


def test_8_bit_x_on_a_real_quantizer_file_is_documented_accuracy(monkeypatch):
    """The trade the option makes, on llama.cpp's tiny Q4_K_M file against transformers' GGUF loader in float64:
    measured normwise logits error 4.5e-2 with 8-bit x (llama.cpp 7.1e-2), 3.1e-4 with the default 15 bits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from luminal_recipes.tasks.generation.model import LanguageModel

    root = Path(__file__).resolve().parents[2]
    file = root / "tests" / "fixtures" / "gguf_quant" / "tiny-llama-q4_k_m.gguf"
    prompt = [1, 17, 250, 33, 901, 5, 77, 412, 9, 640, 18, 3]
    model = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                              dtype=torch.float32).double().eval()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    rel = {}
    for bits, fn in ((15, gguf_q8.quant_product15), (8, gguf_q8.quant_product_x8)):
        monkeypatch.setattr(gguf_q8, "quant_product", fn)  # what x_bits() picks at import; the runtime binds it
        got = np.asarray(LanguageModel(root / "recipes" / "llama.yaml", weights=file).logits(prompt), np.float64)
        rel[bits] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert rel[8] < 0.1 and rel[15] < 2e-3, rel
    assert rel[8] > 20 * rel[15], rel  # the option does round x more coarsely in the model's products
