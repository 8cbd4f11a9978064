"""``generate([...])`` of the Python API decodes a list of prompts together through the batched decoder
(tasks/generation/batched.py: ``BatchedDecoder`` + ``Slots``, the server's continuous batching) and gives, prompt
for prompt, the reply ``generate`` gives that prompt alone - ids, text, finish reason and seed, greedy and sampled,
with stop strings - for lists longer than the slots, prompts of different lengths and replies of different
lengths (capped by the context); errors name the prompt; the decoder is built once per pipeline (a second call
builds, compiles and loads nothing); a prompt and reply longer than a slot runs in turn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from luminal_recipes import Pipeline, instrument
from luminal_recipes.errors import InputError, NonFiniteError
from luminal_recipes.tasks.generation import batched
from luminal_recipes.tasks.generation.length import ContextLengthWarning

ROOT = Path(__file__).resolve().parents[3]
CHECKPOINTS = ROOT / "tests" / "golden" / "checkpoints"
# ten prompts (more than the 8 slots) of 20 to 58 tokens with the chat template: with context=72 and
# max_new_tokens=24 the long ones' replies are capped by the context (min(24, 72 - n) tokens), so they end at
# different lengths
PROMPTS = ["hi", "The capital of France is", "def main():\n    return 0\n", "a",
           "Ça marche très bien! 🦊", "a b c d e f g h i j k l m n o p q r s t", "Once upon a time", "x = 1 + 2",
           "Why is the sky blue? Explain in one sentence, please.", "ok"]
CONTEXT = 72


def pipeline(family: str, compile: bool):
    return Pipeline.from_recipe(ROOT / "recipes" / f"{family}.yaml", weights=CHECKPOINTS / f"{family}-tiny",
                                context=CONTEXT, compile=compile)


def alone(pipe, prompts, max_new_tokens, **options):
    """The in-turn replies: ``LanguageModel.generate`` one prompt at a time."""
    return [pipe.model.generate(p, max_new_tokens, **options) for p in prompts]


def same(got, want, seed=None):
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.ids, g.text, g.finish_reason) == (w.ids, w.text, w.finish_reason), (k, PROMPTS[k])
        assert g.prompt_ids == w.prompt_ids and g.seed == seed


@pytest.fixture(scope="module", params=[("llama", False), ("qwen3", False)], ids=["llama", "qwen3"])
def pipe(request):
    family, compile = request.param
    p = pipeline(family, compile)
    yield p
    p.release()


def spy(pipe, monkeypatch):
    """The tokens of every decode step (keep > 1) of the pipeline's batched decoder."""
    decoder = pipe._slots().decoder
    steps: list[int] = []
    step = decoder.step

    def counted(tokens, positions, slots, keep):
        if keep > 1:
            steps.append(keep)
        return step(tokens, positions, slots, keep)

    monkeypatch.setattr(decoder, "step", counted)
    return steps


def test_greedy_list_is_decoded_together_and_equals_in_turn(pipe, monkeypatch):
    steps = spy(pipe, monkeypatch)
    with pytest.warns(ContextLengthWarning, match="so the reply stops at 14 tokens at most") as record:
        got = pipe.generate(PROMPTS, max_new_tokens=24, seed=0)
    assert record[0].filename == __file__  # pointed at the caller's line
    want = alone(pipe, PROMPTS, 24)
    assert len({len(w.prompt_ids) for w in want}) > 5 and len({len(w.ids) for w in want}) > 1
    same(got, want, seed=0)
    assert max(steps) == batched.DEFAULT_SLOTS and len(set(steps)) > 1  # 8 together; slots freed and refilled
    before = instrument.snapshot()
    again = pipe.generate(PROMPTS, max_new_tokens=24, seed=0)
    counted = instrument.snapshot()
    counted.subtract(before)
    for event in (instrument.GRAPH_BUILD, instrument.SEARCH, instrument.PLAN_CACHE_HIT, instrument.LOAD):
        assert counted[event] == 0, (event, dict(counted))
    same(again, want, seed=0)


def test_sampled_list_with_stop_strings_equals_in_turn(pipe):
    sampling = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.1}
    want = alone(pipe, PROMPTS, 24, seed=7, **sampling)
    assert len({tuple(w.ids) for w in want}) > 1
    stop = [w.text[4:6] for w in want if len(w.text) > 8][:3]  # pieces the sampled replies do hold
    want = alone(pipe, PROMPTS, 24, seed=7, stop=stop, **sampling)
    assert "stop" in {w.finish_reason for w in want}
    same(pipe.generate(PROMPTS, max_new_tokens=24, seed=7, stop=stop, **sampling), want, seed=7)
    drawn = pipe.generate(PROMPTS[:3], max_new_tokens=6, seed="random", **sampling)
    assert len({r.seed for r in drawn}) == 1  # one seed for the call, as in turn: each reply as alone with it
    same(drawn, alone(pipe, PROMPTS[:3], 6, seed=drawn[0].seed, **sampling), seed=drawn[0].seed)


def test_errors_name_the_prompt_and_free_the_slots(pipe, monkeypatch):
    with pytest.raises(InputError, match=r"prompt 3 of 3: the prompt is \d+ tokens long"):
        pipe.generate(["a", "b", "word " * 80], max_new_tokens=4)
    held = pipe._slots()
    decoder, target = held.decoder, pipe.model.encode(PROMPTS[1])
    step, calls = decoder.step, []

    def poisoned(tokens, positions, slots, keep):  # the third decode step's row of prompt 2 is NaN
        rows = step(tokens, positions, slots, keep)
        calls.append(keep)
        if keep > 1 and sum(c > 1 for c in calls) == 3:
            rows = rows.copy()
            rows[list(slots).index(next(s for s, r in held.active.items() if r.ids == target))] = np.nan
        return rows

    monkeypatch.setattr(decoder, "step", poisoned)
    with pytest.raises(NonFiniteError, match=r"^prompt 2 of 10: .*decode step"):
        pipe.generate(PROMPTS, max_new_tokens=24)
    monkeypatch.setattr(decoder, "step", step)
    assert sorted(pipe._slots().free) == list(range(batched.DEFAULT_SLOTS))
    same(pipe.generate(PROMPTS[:2], max_new_tokens=8), alone(pipe, PROMPTS[:2], 8), seed=0)


def test_a_prompt_longer_than_a_slot_runs_in_turn(monkeypatch):
    monkeypatch.setattr(batched, "DEFAULT_SLOT_TOKENS", 32)  # slots of 32 tokens (the decoder is made with it)
    p = Pipeline.from_recipe(ROOT / "recipes" / "gpt2.yaml", weights=CHECKPOINTS / "gpt2-tiny", compile=False)
    try:
        got = p.generate(PROMPTS[:4], max_new_tokens=8, seed=0)
        assert p._slots().decoder.slot_len == 32
        want = alone(p, PROMPTS[:4], 8)
        assert any(len(w.prompt_ids) + 8 > 32 for w in want) and any(len(w.prompt_ids) + 8 <= 32 for w in want)
        same(got, want, seed=0)
    finally:
        p.release()
