"""`luminal-recipe run` on a language-model recipe: streamed replies, one JSON object per prompt, the benchmark
harness's --stdio protocol byte for byte, and bad input refused with a located message, exit 2, no traceback."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from generation_checkpoints import RECIPES
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.tasks.generation.cli import TextRequest, escape, serve_stdio

LLAMA = RECIPES / "llama.yaml"


def run(*args: str, env: dict | None = None):
    return CliRunner(env=env).invoke(app, ["run", str(LLAMA), *args])


def test_reply_is_streamed_and_the_summary_goes_to_stderr(llama, llama_lm):
    result = run("--weights", str(llama[0]), "--prompt", "The capital of France is", "--max-new-tokens", "12")
    assert result.exit_code == 0, result.output
    want = llama_lm.generate("The capital of France is", max_new_tokens=12)
    assert result.stdout == want.text + "\n"
    assert "tokens" in result.stderr and "done in" in result.stderr


def test_json_prints_one_object_per_prompt(llama, llama_lm):
    result = run("--weights", str(llama[0]), "-p", "Hello", "-p", "Bonjour", "--no-chat", "--max-new-tokens", "5",
                 "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "Bonjour"]
    for row in rows:
        want = llama_lm.generate(row["prompt"], max_new_tokens=5, chat=False)
        assert row["prompt_token_ids"] == want.prompt_ids and row["generated_token_ids"] == want.ids
        assert row["text"] == want.text and row["finish_reason"] == want.finish_reason
        assert row["prompt_tokens"] == len(want.prompt_ids) and row["generated_tokens"] == len(want.ids)
        for key in ("load_s", "compile_s", "time_to_first_token_ms", "peak_memory_bytes"):
            assert row[key] is not None and row[key] >= 0, key
        assert row["memory_plan"]["kv_cache_bytes"] > 0


def test_gen_tokens_sets_the_default_length(llama):
    result = run("--weights", str(llama[0]), "-p", "Hello", "--no-chat", "--json", env={"GEN_TOKENS": "3"})
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["generated_tokens"] == 3 or row["finish_reason"] == "eos"


def test_stop_strings_end_the_reply(llama, llama_lm):
    full = llama_lm.generate("The capital of France is", max_new_tokens=24)
    cut = next(i for i in range(3, len(full.text)) if full.text[i - 2:i].strip())
    stop = full.text[cut - 2:cut]
    result = run("--weights", str(llama[0]), "-p", "The capital of France is", "--max-new-tokens", "24", "--stop",
                 stop, "--json")
    row = json.loads(result.stdout)
    assert row["finish_reason"] == "stop" and row["text"] == full.text[:full.text.index(stop)]


def test_stdio_protocol(llama, llama_lm):
    req = TextRequest(LLAMA, weights=str(llama[0]), max_new_tokens=6)
    stdin = io.BytesIO("The capital of France is\n\n\r\nÇa marche très bien! 🦊\r\n".encode())
    out, err = io.BytesIO(), io.StringIO()
    assert serve_stdio(req, stdin, out, err) == 2
    lines = out.getvalue().decode("utf-8").split("\n")
    assert lines[0] == "READY" and lines[-1] == ""
    queries, current = [], []
    for line in lines[1:-1]:
        if line.startswith("EOQ\t"):
            assert re.fullmatch(r"EOQ\t\d+\t\d+\.\d{3}", line), line
            queries.append((current, int(line.split("\t")[1])))
            current = []
        else:
            assert line.startswith("TOK\t") and "\t" not in line[4:], line
            current.append(line[4:])
    assert len(queries) == 2
    for (toks, n), prompt in zip(queries, ["The capital of France is", "Ça marche très bien! 🦊"]):
        want = llama_lm.generate(prompt, max_new_tokens=6)
        assert n == len(want.ids)  # an EOS counts, without a TOK line
        assert len(toks) == len([i for i in want.ids if i not in llama_lm.eos_ids])
        assert "".join(toks) == escape(want.text)
    assert "READY" not in err.getvalue()


def test_stdio_escapes():
    assert escape("a\\b\tc\nd\re") == "a\\\\b\\tc\\nd\\re"


def test_stdio_lines_end_at_newline_only(llama):
    """A lone CR inside a line is part of the prompt (not a line break, as text-mode stdin would make it)."""
    req = TextRequest(LLAMA, weights=str(llama[0]), max_new_tokens=2)
    out = io.BytesIO()
    assert serve_stdio(req, io.BytesIO(b"one\rtwo\n"), out, io.StringIO()) == 1
    assert out.getvalue().decode().count("EOQ\t") == 1


def test_stdio_subprocess_keeps_stdout_for_the_protocol(llama):
    env = dict(os.environ, GEN_TOKENS="4")
    proc = subprocess.run([sys.executable, "-m", "luminal_recipes", "run", str(LLAMA), "--weights", str(llama[0]),
                           "--stdio"], input="Hello\n", capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "READY" and lines[-1].startswith("EOQ\t")
    assert all(line.startswith("TOK\t") for line in lines[1:-1]) and len(lines) - 2 <= 4
    assert int(lines[-1].split("\t")[1]) <= 4 and proc.stderr


# ---- bad input: located, exit 2, no traceback ----------------------------------------------------------------
def refused(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


def test_top_p_zero(llama):
    refused(run("--weights", str(llama[0]), "-p", "hi", "--top-p", "0", "--temperature", "1"), "--top-p 0")


def test_prompt_longer_than_the_context(llama):
    refused(run("--weights", str(llama[0]), "-p", "word " * 300, "--no-chat"), "tokens long", "256")
    refused(run("--weights", str(llama[0]), "-p", "word " * 30, "--no-chat", "--context", "16"), "tokens long")


def test_checkpoint_without_a_tokenizer(llama, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(llama[0] / name, folder / name)
    refused(run("--weights", str(folder), "-p", "hi"), "tokenizer.json", "file not found")


def test_unknown_chat_template_variable(llama):
    refused(run("--weights", str(llama[0]), "-p", "hi", "--chat-var", "enable_thinking=false"),
            "--chat-var enable_thinking", "reads no variable")


def test_system_without_chat(llama):
    refused(run("--weights", str(llama[0]), "-p", "hi", "--no-chat", "--system", "be brief"), "--system")


def test_image_flags_are_refused_for_a_language_model(llama):
    refused(run("--weights", str(llama[0]), "-p", "hi", "--steps", "4"), "--steps", "language model")
    refused(run("--weights", str(llama[0]), "-p", "hi", "--image", "a.png", "--lora", "style.safetensors"),
            "--image, --lora: not an option for a language model")


def test_text_flags_are_refused_for_a_pipeline():
    result = CliRunner().invoke(app, ["run", str(RECIPES / "flux2-tiny.yaml"), "-p", "hi", "--temperature", "0.5"])
    refused(result, "--temperature", "not a language model")


def test_budget_below_the_weights_is_refused_before_loading(llama):
    refused(run("--weights", str(llama[0]), "-p", "hi", "--max-memory", "100KiB"), "KV cache", "--max-memory")


def recipe_copy(tmp_path: Path, text: str, name: str) -> Path:
    """``text`` as recipe ``name`` beside a copy of the shipped module libraries it includes."""
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")
    (tmp_path / name).write_text(text)
    return tmp_path / name


def test_a_model_recipe_without_generation(tmp_path, llama):
    text = LLAMA.read_text()
    start = text.index("generation:\n")
    plain = recipe_copy(tmp_path, text[:start] + text[text.index("\nweights:", start) + 1:], "plain.yaml")
    result = CliRunner().invoke(app, ["run", str(plain), "--weights", str(llama[0]), "-p", "hi"])
    refused(result, "plain.yaml:", "without a `generation:` section", "Language models")


def test_a_recipe_missing_generation_pieces_names_them(tmp_path, llama):
    text = LLAMA.read_text().replace("dims: [batch, seq, ctx, cache, keep]", "dims: [batch, seq, ctx, cache]")
    text = text.replace("  positions: {shape: [seq], dtype: i32, doc: absolute positions of the new tokens "
                        "(past .. past + seq - 1)}\n", "")
    broken = recipe_copy(tmp_path, text, "broken.yaml")
    result = CliRunner().invoke(app, ["run", str(broken), "--weights", str(llama[0]), "-p", "hi"])
    refused(result, "broken.yaml", "dims lack keep", "no input 'positions'")


def test_python_api_load_recipe(llama, llama_lm):
    from luminal_recipes import load_recipe

    lm = load_recipe(LLAMA, weights=llama[0])
    reply = lm.generate("Hello", max_new_tokens=4, chat=False)
    assert reply.ids == llama_lm.generate("Hello", max_new_tokens=4, chat=False).ids
    assert lm.logits("Hello").shape == (len(reply.prompt_ids), 384)
    assert Path(lm.checkpoint) == Path(llama[0])
