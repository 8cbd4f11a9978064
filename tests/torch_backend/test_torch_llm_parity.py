"""transformers' LlamaForCausalLM and Qwen3ForCausalLM (tiny random configs) through torch.compile(backend=
"luminal"): the logits of a forward against the float64 model (tests/TOLERANCES.md), and greedy ``generate`` with
the compiled forward (prefill, then decode steps over transformers' own KV cache, each new cache length a
symbolic dim re-bound within its bucket) giving eager generate's ids."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


def tiny(name: str):
    torch.manual_seed(len(name))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, rope_theta=500000.0)).eval()
    if name == "mistral":  # a sliding window: its cache keeps ``keys[:, :, -window + 1:]`` of a shorter axis
        return transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=4096)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True)
                                         ).eval()


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_logits_and_generate_match_eager(name, assert_close):
    """One compiled forward serves a batch of 2 x 7 tokens, then generate's prefill and every decode step (Dynamo
    retraces once with the lengths symbolic; later lengths re-bind). Mistral's sliding-window cache slices its
    keys from a negative start on the symbolic length (clamped at 0 by torch: its returned keys were zeros once)."""
    model = tiny(name)
    twin = float64_twin(model)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    prompt = ids[:1, :5]
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)  # the whole forward is translated
        want_ids = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="luminal")
        got = model(ids).logits
        assert got.dtype == torch.float32
        assert_close("model", got, twin(ids).logits)
        assert model.generate(prompt, **kwargs).tolist() == want_ids.tolist()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_static_cache_generate_matches_eager_with_nothing_falling_back(name, monkeypatch):
    """transformers' recommended compiled generation: a StaticCache (``cache_implementation="static"``), one
    fixed-shape decode step updating the cache in place (``index_copy_`` into each layer's keys and values, the
    length's 0-dim tensor ``add_``). Two prompt lengths: the second makes Dynamo retrace the prefill with its
    length symbolic, and the cache length plus that symbol is an ``add`` with a ``SymInt`` operand. Strict: no
    part falls back to eager."""
    monkeypatch.setenv("LUMINAL_TORCH_STRICT", "1")
    model = tiny(name)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, SIZES["vocab_size"], (1, n), generator=g) for n in (5, 7)]
    kwargs = dict(do_sample=False, max_new_tokens=9, cache_implementation="static")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        want = [model.generate(p, attention_mask=torch.ones_like(p), **kwargs).tolist() for p in prompts]
        model.forward = torch.compile(model.forward, backend="luminal")
        got = [model.generate(p, attention_mask=torch.ones_like(p), **kwargs).tolist() for p in prompts]
    assert got == want
