"""A second adversarial pass over hostile numerics (issue 21, classes 4, 6 and 9): config values of the wrong type,
Python API arguments of the wrong type, flags a language model would ignore, and prompt text far beyond the
context. Each is refused with one located paragraph (a LuminalError; exit 2 on the CLI), never a traceback, a bare
ValueError/TypeError, a silently truncated token id, or a config string such as "no" counted as true.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_checks import cli, new_workdir, refused  # tests/cli_checks.py

from luminal_recipes.errors import InputError, LuminalError
from luminal_recipes.recipe.builder import BuiltModel

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "recipes" / "llama.yaml"
TINY_LLAMA = ROOT / "tests" / "golden" / "checkpoints" / "llama-tiny"
FAST = ["--no-compile", "--max-new-tokens", "2", "--no-chat", "--quiet"]


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    return new_workdir(tmp_path, monkeypatch)


@pytest.fixture
def no_weights(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a weight was read before the config was checked")

    monkeypatch.setattr(BuiltModel, "load_weight", never)


def checkpoint(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "llama-tiny"
    shutil.copytree(TINY_LLAMA, folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


# ---- config values of the wrong type: the libraries declare the switches bool, the factors float -----------------
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("config,words", [
    # "no" was truthy: `when: not tie_embeddings` dropped lm_head and the run failed far from the cause
    ({"tie_word_embeddings": "no"}, ("parameter 'tie_embeddings'", "expected bool, got 'no'", "causal_lm.yaml:")),
    ({"attention_bias": "false"}, ("parameter 'attention_bias'", "expected bool", "causal_lm.yaml:")),
    ({"mlp_bias": 1}, ("parameter 'mlp_bias'", "expected bool, got 1",)),
    # a string reached the graph: "cannot combine a tensor with str"
    ({"rope_parameters": {**LLAMA3_ROPE, "factor": "NaN"}}, ("parameter 'rope_factor'", "expected float",)),
    ({"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": [1.0]}}, ("parameter 'rope_low_freq_factor'",
                                                                        "expected float")),
    ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 8.5}},
     ("parameter 'rope_original_positions'", "expected int")),
    ({"max_position_embeddings": 0}, ("parameter 'max_positions' is out of range", "below its minimum 1")),
    ({"max_position_embeddings": "4096"}, ("parameter 'max_positions'", "expected int")),
])
def test_config_values_of_the_wrong_type_are_refused_at_the_recipe_line(tmp_path, no_weights, config, words):
    folder = checkpoint(tmp_path, config)
    refused(cli("run", LLAMA, "--weights", folder, "-p", "hello", *FAST), *words, "llama.yaml:",
            str(folder / "config.json"))


# ---- flags a language model would ignore ---------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [("--compute-dtype", "f16"), ("--max-host-memory", "1GiB")])
def test_pipeline_only_flags_are_refused_for_a_language_model(flag, value):
    refused(cli("run", LLAMA, "--weights", TINY_LLAMA, "-p", "hello", *FAST, flag, value), flag,
            "not an option for a language model")


# ---- the Python API: wrong-typed arguments are InputErrors, never ValueError/TypeError or a silent cast --------
@pytest.fixture(scope="module")
def lm():
    from luminal_recipes import load_recipe

    model = load_recipe(LLAMA, weights=TINY_LLAMA, compile=False)
    yield model
    model.release()


@pytest.mark.parametrize("prompt,kwargs,words", [
    ([1.5], {}, "item 0 is 1.5 (float)"),  # was truncated to token 1
    ([True, 5], {}, "item 0 is True (bool)"),
    (["a"], {}, "the prompt is a list of 1 text: LanguageModel.generate replies to one prompt"),
    (["a", "b"], {}, "list of 2 texts: LanguageModel.generate replies to one prompt"),  # was a bare ValueError
    (None, {}, "got None"),
    (5, {}, "got 5 (int)"),
    (b"hello", {}, "the prompt is bytes"),  # was read as the token ids 104, 101, ...
    (np.array([[5, 6]]), {}, "2-D int64 array"),
    ("hi", {"temperature": "hot"}, "--temperature hot"),
    ("hi", {"temperature": None}, "--temperature None"),
    ("hi", {"top_k": 2.7, "temperature": 1.0}, "--top-k 2.7"),  # was truncated to 2
    ("hi", {"top_p": [1]}, "--top-p [1]"),
    ("hi", {"seed": 1.5, "temperature": 1.0}, "--seed 1.5"),
    ("hi", {"stop": [1]}, "--stop [1]"),
    ("hi", {"chat": "no"}, "generate(chat=...)"),
    ("hi", {"system": 5}, "generate(system=...)"),
    ("hi", {"chat_vars": [1]}, "generate(chat_vars=...)"),
    ("hi", {"on_text": 5}, "generate(on_text=...)"),
])
def test_generate_refuses_wrong_typed_arguments(lm, prompt, kwargs, words):
    with pytest.raises(InputError, match=None) as caught:
        lm.generate(prompt, max_new_tokens=2, **kwargs)
    assert words in str(caught.value), str(caught.value)


def test_generate_accepts_numpy_numbers_and_one_stop_string(lm):
    plain = lm.generate([5, 6, 7], max_new_tokens=2).ids
    assert lm.generate(np.array([5, 6, 7], np.int32), max_new_tokens=np.int64(2), temperature=np.float32(0),
                       seed=np.int64(0)).ids == plain
    # a str is one stop string, not one per character (stop="e" ended the reply at every "e" before)
    from luminal_recipes.tasks.generation.detokenize import StopStrings

    assert StopStrings("abc").stops == ["abc"] and StopStrings(None).stops == []


@pytest.mark.parametrize("options,words", [
    ({"set": {"eps": 1.0}}, "unknown option (did you mean 'sets'?)"),
    ({"compile": "no"}, "compile='no': expected True or False"),
    ({"allow_nonfinite": "yes"}, "allow_nonfinite='yes'"),
    ({"max_memory": "abc"}, "max_memory 'abc'"),
    ({"max_memory": -5}, "max_memory -5"),
])
def test_load_recipe_refuses_wrong_options(no_weights, options, words):
    from luminal_recipes import load_recipe

    with pytest.raises(LuminalError) as caught:
        load_recipe(LLAMA, weights=TINY_LLAMA, **options)
    assert words in str(caught.value), str(caught.value)


# ---- prompt text far beyond the context: refused before the tokenizer (whose regex engine panics) ---------------
def test_a_prompt_far_longer_than_the_context_is_refused_before_encoding(lm, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the tokenizer saw the text")

    monkeypatch.setattr(lm.tokenizer, "encode", never)
    monkeypatch.setattr(lm.tokenizer, "prompt_ids", never)
    with pytest.raises(InputError, match=r"the prompt is 4,194,304 characters long: more than llama's context of "
                                         r"256 tokens could hold"):
        lm.generate("a" * (4 << 20), max_new_tokens=2, chat=False)


def test_stdio_serves_on_after_a_huge_line(tmp_path):
    from luminal_recipes.tasks.generation.cli import TextRequest, serve_stdio

    out, err = io.BytesIO(), io.StringIO()
    req = TextRequest(LLAMA, weights=str(TINY_LLAMA), compile=False, max_new_tokens=2, chat=False)
    assert serve_stdio(req, stdin=io.BytesIO(b"a" * (3 << 20) + b"\nhello\n"), out=out, err=err) == 2
    lines = out.getvalue().split(b"\n")
    assert lines[0] == b"READY" and lines[1].startswith(b"EOQ\t0\t"), lines[:3]
    assert b"TOK" in out.getvalue() and "characters long" in err.getvalue(), err.getvalue()


def test_a_tokenizer_panic_is_an_input_error(lm, monkeypatch):
    PanicException = type("PanicException", (BaseException,), {})  # pyo3's, which derives from BaseException

    class Backend:
        def __getattr__(self, name):
            return getattr(lm.tokenizer.backend, name)

        def encode(self, *args, **kwargs):
            raise PanicException("Onig: Regex search error: fail to memory allocation")

    monkeypatch.setattr(lm.tokenizer, "backend", Backend())
    with pytest.raises(InputError, match=r"tokenizer.json: the tokenizer failed on a text of 5 characters \(Onig"):
        lm.tokenizer.encode("hello")


def test_equal_llama3_frequency_factors_run_as_transformers_does(tmp_path):
    # low_freq_factor == high_freq_factor leaves no medium band; the recipe divided by their difference and the run
    # stopped ("cannot compute tensor / 0.0") where transformers computes the logits (checked: within 3e-6)
    folder = checkpoint(tmp_path, {"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 4.0}})
    result = cli("run", LLAMA, "--weights", folder, "-p", "hello", *FAST)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kwargs,words", [({"prompt_tokens": "a"}, "prepare(prompt_tokens='a')"),
                                          ({"prompt_tokens": -1}, "prepare(prompt_tokens=-1)"),
                                          ({"max_new_tokens": 2.5}, "prepare(max_new_tokens=2.5)")])
def test_prepare_refuses_wrong_sizes(lm, kwargs, words):
    with pytest.raises(InputError) as caught:
        lm.prepare(**kwargs)
    assert words in str(caught.value), str(caught.value)


@pytest.mark.parametrize("recipe,config,words", [
    ("gemma3", {"sliding_window": "512"}, "parameter 'sliding_window'"),  # reached attention(window='512')
    ("gpt2", {"scale_attn_weights": "no"}, "parameter 'scale_attn_weights'"),  # "no" scaled the scores
    ("qwen3-moe", {"norm_topk_prob": "false"}, "parameter 'norm_topk_prob'"),  # "false" normalised them
])
def test_other_families_declare_their_switch_and_window_types(tmp_path, no_weights, recipe, config, words):
    folder = tmp_path / recipe
    shutil.copytree(ROOT / "tests" / "golden" / "checkpoints" / f"{recipe}-tiny", folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    (folder / "config.json").write_text(json.dumps(data))
    refused(cli("run", ROOT / "recipes" / f"{recipe}.yaml", "--weights", folder, "-p", "hello", *FAST), words,
            "expected", f"{recipe}.yaml:", str(folder / "config.json"))
