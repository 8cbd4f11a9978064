"""`luminal-recipe chat`: a multi-turn conversation through the checkpoint's chat template, on stdin. Each reply is
the one `generate` gives for the conversation so far as transformers' `apply_chat_template` renders it; the
history is kept within the context (oldest turns dropped, and said); /reset and /exit; `--threads`."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from generation_checkpoints import RECIPES
from typer.testing import CliRunner

from luminal_recipes.cli import app

LLAMA = RECIPES / "llama.yaml"
TOKENS = 6


def chat(folder, text: str, *args: str):
    return CliRunner().invoke(app, ["chat", str(LLAMA), "--weights", str(folder), "--max-new-tokens", str(TOKENS),
                                    *args], input=text)


def reference_ids(folder, messages: list[dict]) -> list[int]:
    """The conversation's ids as transformers renders and encodes it."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    return [int(i) for i in ids]


def expected_replies(folder, lm, turns: list[str | None], context: int | None = None) -> tuple[str, int]:
    """(stdout, turns dropped) of a session: ``None`` is /reset. The reference policy: drop the oldest user turn
    and its reply while the conversation and the longest reply exceed the context."""
    history: list[dict] = []
    out, dropped = "", 0
    for text in turns:
        if text is None:
            history = []
            continue
        messages = [*history, {"role": "user", "content": text}]
        ids = reference_ids(folder, messages)
        while context is not None and len(ids) + TOKENS > context and len(messages) > 1:
            messages = messages[2:]
            dropped += 1
            ids = reference_ids(folder, messages)
        reply = lm.generate(ids, max_new_tokens=min(TOKENS, (context or 10**9) - len(ids)))
        out += reply.text + "\n"
        history = [*messages, {"role": "assistant", "content": reply.text}]
    return out, dropped


def test_each_reply_is_generate_on_the_rendered_conversation(llama, llama_lm):
    turns = ["Hello there", "What is the capital of France?", None, "Tell me a story"]
    session = "\n".join("/reset" if t is None else t for t in turns) + "\n/exit\nnever read\n"
    result = chat(llama[0], session)
    assert result.exit_code == 0, result.output
    want, dropped = expected_replies(llama[0], llama_lm, turns)
    assert dropped == 0
    assert result.stdout == want
    assert "(conversation reset)" in result.stderr and "never read" not in result.stdout
    assert result.stderr.count(f"[{TOKENS} tokens") + result.stderr.count(", eos,") >= 3


def test_old_turns_are_dropped_to_fit_the_context_and_the_user_is_told(llama, llama_lm):
    turns = ["Hello there, how are you today?", "What is the capital of France?", "And of Italy?", "Thanks"]
    context = 64
    result = chat(llama[0], "\n".join(turns) + "\n", "--context", str(context))
    assert result.exit_code == 0, result.output
    want, dropped = expected_replies(llama[0], llama_lm, turns, context)
    assert dropped >= 1  # the test means something: this conversation does not fit 64 tokens
    assert result.stdout == want
    assert "oldest turn" in result.stderr and f"context of {context} tokens" in result.stderr


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(llama, llama_lm):
    result = chat(llama[0], "word " * 200 + "\nHi\n", "--context", "32")
    assert result.exit_code == 0, result.output
    assert "error: this message is" in result.stderr and "Shorten it" in result.stderr
    want, _ = expected_replies(llama[0], llama_lm, ["Hi"], 32)
    assert result.stdout == want


def test_a_checkpoint_without_a_chat_template_is_refused(llama, tmp_path):
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(llama[0], folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = folder / "tokenizer_config.json"
    import json

    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    result = chat(folder, "Hi\n")
    assert result.exit_code == 2 and "no chat template" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("bad", ["0", "-2", "99999"])
def test_threads_out_of_range_is_refused(llama, bad):
    result = chat(llama[0], "Hi\n", "--threads", bad)
    assert result.exit_code == 2 and "--threads" in result.stderr, result.output


def test_threads_sets_every_pool():
    """One setting reaches our kernels' pool, BLAS (loaded already) and numba."""
    script = ("import numpy, numba\n"
              "from luminal_recipes.threads import set_threads, threads_in_use\n"
              "import importlib\n"
              "from luminal_recipes.threads import POOL_MODULES\n"
              "from luminal_recipes.runtimes.registry import get_runtime\n"
              "get_runtime('numpy')\n"  # the CPU runtime loaded, and its thread pool (wherever the layout keeps it)
              "for name in POOL_MODULES:\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "        break\n"
              "    except ImportError:\n"
              "        pass\n"
              "set_threads(1)\n"
              "print(threads_in_use())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    used = ast.literal_eval(out.stdout)
    assert used["ours"] == 1 and used["blas"] == 1 and used["numba"] == 1, used


def test_run_with_one_thread_gives_the_same_reply(llama, llama_lm):
    """In its own process: --threads changes the process's pools for good."""
    result = subprocess.run([sys.executable, "-m", "luminal_recipes", "run", str(LLAMA), "--weights", str(llama[0]),
                             "--prompt", "Hello", "--max-new-tokens", str(TOKENS), "--threads", "1"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout == llama_lm.generate("Hello", max_new_tokens=TOKENS).text + "\n"
