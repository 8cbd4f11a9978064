"""Every shipped LLM recipe whose architecture GGUF has, run from a GGUF file written by llama.cpp's own
converter (tests/fixtures/gguf/make_fixtures.py: tiny random checkpoints saved by transformers): the prompt's ids
(on texts with unicode, whitespace runs, digits and special tokens) and the greedy reply are token for token
those of transformers' GGUF path (``AutoTokenizer`` and
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from luminal_recipes.tasks.generation import LanguageModel  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PROMPT = "Hello world, 12 naïve cafés 🦙"

# fixture -> (recipe, config values the file states but transformers' GGUF mapping leaves at the config class's
# default, passed to from_pretrained so that the reference builds the model the file holds)
CASES = {
    "tiny-llama": ("llama.yaml", {}),
    "tiny-llama-tied": ("llama.yaml", {}),
    "tiny-llama-q4_k": ("llama.yaml", {}),  # Q4_K and Q6_K tensors by llama.cpp's quantizer
    "tiny-qwen3": ("qwen3.yaml", {"head_dim": 16}),
    "tiny-qwen3moe": ("qwen3-moe.yaml", {"moe_intermediate_size": 32}),
    "tiny-gemma3": ("gemma3.yaml", {}),
    "tiny-llama-spm": ("llama.yaml", {}),  # SentencePiece (tokenizer.ggml.model llama)
    "tiny-gemma3-spm": ("gemma3.yaml", {}),  # Gemma's SentencePiece variant
    "tiny-gpt2": ("gpt2.yaml", {"n_positions": 256}),
}


def reference(path: Path, overrides: dict):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                              **overrides).eval()
    return tokenizer, model


TEXTS = ["Hello world", " Hello  world\n\n\tTabs\t\t and   spaces   ", "12345 6789 3.14159 1,000,000",
         "naïve café — 日本語のテキスト 🦙🚀 Ελληνικά", "<|im_start|>user\nHi<|im_end|>\n",
         "<|endoftext|>x<s></s><unk>",
         "I've been 'told he's there, 'RE you sure?", "   leading and trailing   ", "", "a\r\nb\rc",
         "<mask><pad><bos>", "ÿþ\x00\x01 control", "def main():\n    return [x ** 2 for x in range(10)]"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_tokenizer_ids_equal_transformers(name):
    from luminal_recipes.text.gguf_tokenizer import load_gguf_tokenizer

    path = FIXTURES / f"{name}.gguf"
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_gguf_tokenizer(path)
    for text in TEXTS:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special)["input_ids"]
            assert ours.backend.encode(text, add_special_tokens=special).ids == ids, (text, special)
            for skip in (True, False):
                assert ours.backend.decode(ids, skip_special_tokens=skip) == \
                    reference.decode(ids, skip_special_tokens=skip), (text, skip)
    assert ours.eos_ids == [reference.eos_token_id]


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_ids_equal_transformers_gguf_path(name):
    recipe, overrides = CASES[name]
    path = FIXTURES / f"{name}.gguf"
    tokenizer, model = reference(path, overrides)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    lm = LanguageModel(RECIPES / recipe, weights=path, compile=False)
    try:
        assert lm.encode(PROMPT, chat=False) == ids
        got = lm.generate(PROMPT, max_new_tokens=8, chat=False)
        assert got.ids == want and len(want) >= 4, (got.ids, want)
        text = tokenizer.decode(got.ids, skip_special_tokens=True)
        if "\ufffd" not in text:  # random weights may reply with bytes that are no UTF-8 (streamed differently)
            assert got.text == text
    finally:
        lm.release()


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_is_what_transformers_builds_from_the_metadata(name):
    """The recipe's `config.*` from the GGUF metadata: transformers' GGUF config (load_gguf_checkpoint) on every
    field both state, plus the values transformers leaves at the class default that the file does state."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from luminal_recipes.weights.gguf_io import GgufCheckpoint

    path = FIXTURES / f"{name}.gguf"
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    ours = GgufCheckpoint.open(path).config
    extra = set(CASES[name][1])
    shared = (set(theirs) & set(ours)) - extra
    assert {"model_type", "tie_word_embeddings", "vocab_size"} <= shared
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    for key, value in CASES[name][1].items():  # what the test passes to from_pretrained is what the file says
        assert ours[key] == value, key
