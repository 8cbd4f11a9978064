"""The Python API over a language model (``Pipeline.from_pretrained`` / ``from_recipe`` on an LLM recipe,
docs/python-api.md) against transformers on the tiny Llama it saved: a list of prompts gives one reply each,
token for token transformers' greedy ``generate``; ``stream=True`` yields the pieces of that reply; the recipe is
chosen from the checkpoint's config.json; bad prompts are located errors (never a bare ValueError); the sampling
seed is drawn when omitted and reported."""

from __future__ import annotations

import pytest
import torch
import transformers
from generation_checkpoints import RECIPES

from luminal_recipes import LanguageModelPipeline, Pipeline, instrument
from luminal_recipes.errors import InputError

PROMPTS = ["The capital of France is", "Ça marche très bien! 🦊"]


@pytest.fixture(scope="module")
def lm(llama):
    model = Pipeline.from_pretrained(llama[0])
    yield model
    model.release()


def greedy(reference, tokenizer, prompt: str, n: int) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    with torch.no_grad():
        got = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return got[0, len(ids):].tolist()


def test_from_pretrained_chooses_the_llama_recipe(lm):
    assert isinstance(lm, LanguageModelPipeline)
    assert lm.model.model.recipe.path.resolve() == (RECIPES / "llama.yaml").resolve()


def test_a_list_of_prompts_gives_one_greedy_reply_each(llama, lm):
    folder, reference = llama
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    replies = lm.generate(PROMPTS, max_new_tokens=12)
    assert isinstance(replies, list) and len(replies) == 2
    for prompt, reply in zip(PROMPTS, replies):
        assert reply.ids == greedy(reference, tokenizer, prompt, 12), prompt
        assert reply.text == tokenizer.decode(reply.ids, skip_special_tokens=True)
    before = instrument.snapshot()  # decoded together by the batched program, compiled once for the pipeline
    again = lm.generate(PROMPTS, max_new_tokens=12)
    counted = instrument.snapshot()
    counted.subtract(before)
    for event in (instrument.GRAPH_BUILD, instrument.SEARCH, instrument.PLAN_CACHE_HIT, instrument.LOAD):
        assert counted[event] == 0, (event, dict(counted))
    assert [r.ids for r in again] == [r.ids for r in replies] and lm.batch_refused is None
    single = lm.generate(PROMPTS[1], max_new_tokens=12)
    assert single.ids == replies[1].ids


def test_stream_yields_the_pieces_of_the_reply(lm):
    whole = lm.generate(PROMPTS[0], max_new_tokens=12)
    pieces = list(lm.generate(PROMPTS[0], max_new_tokens=12, stream=True))
    assert len(pieces) >= 2 and "".join(pieces) == whole.text
    early = lm.generate(PROMPTS[0], max_new_tokens=12, stream=True)
    next(early)
    early.close()  # the worker stops at its next token
    assert lm.generate(PROMPTS[0], max_new_tokens=12).ids == whole.ids  # and the model is fine afterwards


def test_sampling_seed_is_drawn_reported_and_repeatable(lm, monkeypatch):
    monkeypatch.delenv("LUMINAL_RECIPES_SEED", raising=False)
    a = lm.generate(PROMPTS[0], max_new_tokens=8, temperature=1.0)
    assert isinstance(a.seed, int)
    again = lm.generate(PROMPTS[0], max_new_tokens=8, temperature=1.0, seed=a.seed)
    assert again.ids == a.ids and again.seed == a.seed
    pinned = lm.generate(PROMPTS[0], max_new_tokens=8, temperature=1.0, seed="random")
    assert isinstance(pinned.seed, int)


@pytest.mark.parametrize(("prompt", "kwargs", "fragment"), [
    (["a", 3], {}, "item 1 is 3"),
    (["a", "b"], {"stream": True}, "streams one prompt"),
    (["a", ""], {}, "prompt 2 of 2: the prompt is empty"),
    ("a", {"seed": "x"}, "seed 'x'"),
    ("a", {"on_text": print}, "stream=True"),
])
def test_bad_prompts_are_located_errors(lm, prompt, kwargs, fragment):
    with pytest.raises(InputError) as info:
        lm.generate(prompt, max_new_tokens=4, **kwargs)
    assert fragment in str(info.value)


def test_embed_and_pipeline_options_are_refused(lm, llama):
    with pytest.raises(InputError, match="is a language model"):
        lm.embed(["a"])
    with pytest.raises(InputError, match="compute_dtype=...\\): not an option for a language model"):
        Pipeline.from_recipe(RECIPES / "llama.yaml", weights=llama[0], compute_dtype="bf16")
    with pytest.raises(InputError, match="unknown option"):
        Pipeline.from_recipe(RECIPES / "llama.yaml", weights=llama[0], contxt=64)


def test_cli_sampling_seed_is_drawn_printed_and_repeatable(llama, monkeypatch):
    import json
    import re

    from typer.testing import CliRunner

    from luminal_recipes.cli import app

    monkeypatch.delenv("LUMINAL_RECIPES_SEED", raising=False)
    args = ["run", str(RECIPES / "llama.yaml"), "--weights", str(llama[0]), "-p", PROMPTS[0], "--max-new-tokens", "6",
            "--temperature", "1.0"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    seed = int(re.search(r"sampling seed (\d+) \(pass --seed \1 to repeat this reply\)", first.stderr)[1])
    again = CliRunner().invoke(app, [*args, "--seed", str(seed), "--json"])
    assert again.exit_code == 0, again.output
    row = json.loads(again.stdout)
    assert row["seed"] == seed and row["text"] + "\n" == first.stdout
