"""`max_new_tokens` beyond what the context leaves after the prompt is said (the reply stops at the context): a
ContextLengthWarning from the Python API, one `warning:` line from the CLI before any work; nothing when it fits."""

from __future__ import annotations

import warnings

import pytest
from generation_checkpoints import RECIPES
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.tasks.generation.length import ContextLengthWarning, beyond_context


def test_the_message_names_the_room_left():
    assert beyond_context("m", 10, 5, 20, "generation.context") is None
    assert beyond_context("m", 15, 5, 20, "generation.context") is None
    message = beyond_context("m", 16, 5, 20, "generation.context")
    assert "max_new_tokens=16 exceeds" in message and "leaves 15 of m's 20 tokens (generation.context)" in message


def test_the_api_warns_when_the_reply_cannot_be_that_long(llama_lm):
    ids = llama_lm.encode("Hello", chat=False)
    with pytest.warns(ContextLengthWarning, match=rf"leaves {256 - len(ids)} of llama's 256 tokens") as record:
        llama_lm.generate(ids, max_new_tokens=10**6, stop=["e"])  # a stop text ends it early either way
    assert record[0].filename == __file__  # pointed at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llama_lm.generate(ids, max_new_tokens=4)


def test_the_cli_says_it_once_before_any_work(llama):
    result = CliRunner().invoke(app, ["run", str(RECIPES / "llama.yaml"), "--weights", str(llama[0]), "-p", "Hi",
                                      "-p", "Hello there", "--max-new-tokens", "100000", "--stop", "e"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("warning: --max-new-tokens 100000 exceeds what the context allows") == 1
    assert result.stderr.index("warning:") < result.stderr.index("compiling")
    quiet = CliRunner().invoke(app, ["run", str(RECIPES / "llama.yaml"), "--weights", str(llama[0]), "-p", "Hi",
                                     "--max-new-tokens", "3"])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
