"""recipes/mistral.yaml against transformers' MistralForCausalLM on a tiny checkpoint with Mistral's real Tekken
tokenizer and an 8-position sliding window (so a 32-token reply attends to a window, not to everything): greedy
replies token for token as ``generate(do_sample=False)``, logits within the tolerance policy."""

from __future__ import annotations

import pytest
import torch
import transformers
from generation_checkpoints import RECIPES

from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe import load_recipe
from luminal_recipes.recipe.builder import build_model
from luminal_recipes.tasks.generation import LanguageModel

PROMPTS = ["Write a haiku about the sea.", "Ça marche très bien! 🦊 日本語"]


@pytest.fixture(scope="module")
def mistral_lm(mistral):
    model = LanguageModel(RECIPES / "mistral.yaml", weights=mistral[0])
    yield model
    model.release()


@pytest.fixture(scope="module")
def hf_tokenizer(mistral):
    return transformers.AutoTokenizer.from_pretrained(mistral[0])


@pytest.mark.parametrize("chat", [True, False])
def test_greedy_reply_is_transformers_generate(mistral, mistral_lm, hf_tokenizer, chat):
    folder, reference = mistral
    tokenizer = hf_tokenizer
    for prompt in PROMPTS if chat else PROMPTS[1:]:
        if chat:
            out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        else:
            ids = tokenizer(prompt)["input_ids"]
        assert mistral_lm.encode(prompt, chat=chat) == ids
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        got = mistral_lm.generate(prompt, max_new_tokens=32, chat=chat)
        assert got.ids == want, (prompt, chat)
        assert len(ids) + len(got.ids) > 3 * reference.config.sliding_window  # the window really limits attention
        assert got.text == tokenizer.decode(got.ids, skip_special_tokens=True)


def test_logits_within_tolerance(mistral, mistral_lm, assert_close):
    folder, _ = mistral
    f64 = transformers.MistralForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = mistral_lm.encode(PROMPTS[1], chat=True)
    with torch.no_grad():
        want = f64(torch.tensor([ids])).logits[0].numpy()
    got = mistral_lm.logits(ids)
    assert_close("model", got[-1], want[-1])
    assert_close("model", got, want)


def test_unimplemented_rope_is_refused_at_its_line(mistral):
    config = dict(mistral[1].config.to_dict(), rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                 "factor": 2.0})
    with pytest.raises(RecipeError, match=r"mistral\.yaml:\d+:\d+: .*rope_parameters\.rope_type.*yarn"):
        build_model(load_recipe(RECIPES / "mistral.yaml"), config=config)
