"""recipes/llama.yaml generating text, against transformers on a tiny checkpoint it saved with a real tokenizer:
greedy replies token for token as ``generate(do_sample=False)``, the last prompt position's logits within the
tolerance policy, prompts encoded as transformers encodes them, streamed text equal to ``decode``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

PROMPTS = ["The capital of France is", "Ça marche très bien! 🦊"]


def reference_ids(tokenizer, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    if not chat:
        return tokenizer(prompt)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def hf_tokenizer(llama):
    return transformers.AutoTokenizer.from_pretrained(llama[0])


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompts_are_encoded_as_transformers_encodes_them(llama_lm, hf_tokenizer, prompt, chat):
    assert llama_lm.encode(prompt, chat=chat) == reference_ids(hf_tokenizer, prompt, chat)


def test_system_message_goes_through_the_template(llama_lm, hf_tokenizer):
    got = llama_lm.encode("Hi", chat=True, system="You are terse.")
    assert got == reference_ids(hf_tokenizer, "Hi", True, system="You are terse.")


@pytest.mark.parametrize("chat", [True, False])
def test_greedy_reply_is_transformers_generate_token_for_token(llama, llama_lm, hf_tokenizer, chat):
    folder, reference = llama
    for prompt in PROMPTS:
        ids = reference_ids(hf_tokenizer, prompt, chat)
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        streamed = []
        got = llama_lm.generate(prompt, max_new_tokens=32, chat=chat, on_text=streamed.append)
        assert got.prompt_ids == ids
        assert got.ids == want, (prompt, chat)
        assert got.finish_reason == ("eos" if want[-1] in llama_lm.eos_ids else "length")
        assert "".join(streamed) == got.text == hf_tokenizer.decode(got.ids, skip_special_tokens=True)


def test_last_prompt_logits_within_tolerance(llama, llama_lm, assert_close):
    folder, reference = llama
    ids = llama_lm.encode(PROMPTS[0], chat=True)
    f64 = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        want = f64(torch.tensor([ids])).logits[0].numpy()
    full = llama_lm.logits(ids)  # every position, one forward (transformers' model(ids).logits)
    assert full.shape == want.shape
    assert_close("model", full[-1], want[-1])
    assert_close("model", full, want)
    session = llama_lm._ensure(len(ids) + 1, len(ids))  # the prefill program generate() runs
    llama_lm._reset(session)
    last = llama_lm._step(session.prefill, np.asarray([ids], np.int32), np.arange(len(ids), dtype=np.int32),
                          llama_lm._dims(len(ids), len(ids), session.cache))
    assert_close("model", last, want[-1])
