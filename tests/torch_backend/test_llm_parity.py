"""transformers' LlamaForCausalLM and Qwen3ForCausalLM (tiny random configs) through torch.compile(backend=
"luminal"): the logits of a forward against the float64 model (tests/TOLERANCES.md), and greedy ``generate`` with
the compiled forward (prefill, then decode steps over transformers' own KV cache, each new cache length a
symbolic dim re-bound within its bucket) giving eager generate's ids."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402
from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


def tiny(name: str):
    torch.manual_seed(len(name))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, rope_theta=500000.0)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True)
                                         ).eval()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_logits_match_the_float64_model(name, assert_close):
    model = tiny(name)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="luminal")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)  # the whole forward is translated
        got = compiled(ids).logits
        want = float64_twin(model)(ids).logits
    assert got.dtype == torch.float32
    assert_close("model", got, want)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_generate_with_the_compiled_forward_gives_eager_ids(name):
    model = tiny(name)
    prompt = torch.randint(0, SIZES["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="luminal")
        got = model.generate(prompt, **kwargs)
    assert got.tolist() == want.tolist()
