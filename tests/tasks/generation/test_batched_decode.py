"""Continuous batching (tasks/generation/batched.py): replies decoded together by one batched program - prompts
run into free KV-cache slots between decode steps, finished replies leaving - are the replies
``LanguageModel.generate`` makes one at a time (greedy: the same token ids), for every family of the shipped
tiny checkpoints; more sequences than slots wait for a slot."""

from __future__ import annotations

from pathlib import Path

import pytest

from luminal_recipes.tasks.generation.batched import BatchedDecoder, Reply, Slots
from luminal_recipes.tasks.generation.model import LanguageModel
from luminal_recipes.tasks.generation.sampling import SamplingSettings

ROOT = Path(__file__).resolve().parents[3]
CHECKPOINTS = ROOT / "tests" / "golden" / "checkpoints"
PROMPTS = ["The capital of France is", "def main():", "Ça marche très bien! 🦊", "hi", "a b c d e f g h i j k"]


def batched_replies(lm, decoder, prompts, max_tokens, settings):
    """Admit prompts into free slots between decode steps (each prompt's prefill is one step), decode every
    running reply in one step, a slot freed when its reply ends: ``Slots``, the loop the server and
    ``generate([...])`` run."""
    slots = Slots(decoder)
    pending = list(enumerate(prompts))
    index, done, steps = {}, {}, []
    while pending or slots.active:
        while pending and slots.free:
            k, prompt = pending.pop(0)
            reply = Reply(lm.encode(prompt), max_tokens, settings[k], (), set(lm.eos_ids), lm.tokenizer.decode,
                          lambda t: None)
            index[id(reply)] = k
            if slots.admit(reply):
                done[k] = reply
        if slots.active:
            steps.append(len(slots.active))
            for reply in slots.decode():
                done[index[id(reply)]] = reply
    return done, steps


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt2", "mistral"])
def test_batched_replies_are_the_single_replies(family):
    recipe, weights = ROOT / "recipes" / f"{family}.yaml", CHECKPOINTS / f"{family}-tiny"
    lm = LanguageModel(recipe, weights=weights, compile=False)
    settings = [SamplingSettings() for _ in PROMPTS]
    settings[1] = SamplingSettings(temperature=0.8, top_k=40, top_p=0.9, seed=3)  # sampled: the same draws too
    alone = [lm.generate(p, 24, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
             for p, s in zip(PROMPTS, settings)]
    decoder = BatchedDecoder(lm, recipe, weights, [], slots=3, slot_len=128)
    decoder.prepare(longest_prompt=32)
    try:
        done, steps = batched_replies(lm, decoder, PROMPTS, 24, settings)
    finally:
        decoder.close()
    for k, single in enumerate(alone):
        assert done[k].out == single.ids, (family, PROMPTS[k])
        assert done[k].text == single.text and done[k].finish == single.finish_reason
    assert max(steps) == 3 and len(set(steps)) > 1  # three decoded together; slots freed and refilled
