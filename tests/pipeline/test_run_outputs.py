"""`luminal-recipe run` on pipelines that do not end in an image: each declared output is written by its type
(image -> PNG, array -> .npy, text -> stdout and .txt); the parameters the run reads (steps, seed, width...)
are only required when the pipeline declares them; a flag or input the pipeline lacks is refused before any
work; default names are numbered and never overwrite; an existing --output is refused without --overwrite; the
summary gives the whole command's time and its compile share.

Small pipelines are written in the tests (over the shipped tiny checkpoint, passed with --weights); model
stages run the naive program (--no-compile) to stay fast."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.graph.core import PRIMITIVE_OPS
from luminal_recipes.image_io import read_png
from luminal_recipes.pipeline import outputs as outputs_module
from luminal_recipes.pipeline.driver import Pipeline

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CHECKPOINT = RECIPES / "flux2-tiny" / "checkpoint"
PROMPT = "a red fox in the snow"

TOKENIZE = """\
  - {name: tokenize, run: tokenize, inputs: {text: prompt, max_length: max_sequence_length},
     outputs: {input_ids: input_ids, attention_mask: attention_mask}}
"""
EMBED = f"""\
kind: pipeline
name: embed
params:
  max_sequence_length: 64
  out_layers: {{type: "list[int]", default: [10, 20, 30]}}
models:
  text_encoder: {{recipe: mistral3-text-encoder.yaml, weights: text_encoder, set: {{out_layers: "${{out_layers}}"}}}}
tokenizer: {{path: tokenizer}}
inputs:
  prompt: {{type: str}}
stages:
{TOKENIZE}  - {{name: text_encoder, model: text_encoder, inputs: {{tokens: input_ids, attention_mask: attention_mask}},
     outputs: {{prompt_embeds: prompt_embeds}}, dims: {{batch: 1, seq: max_sequence_length}}}}
outputs: {{prompt_embeds: prompt_embeds}}
"""
TEXT = f"""\
kind: pipeline
name: show-tokens
params:
  max_sequence_length: 128
models: {{}}
tokenizer: {{path: tokenizer}}
inputs:
  prompt: {{type: str}}
stages:
{TOKENIZE}  - {{name: detokenize, run: detokenize, inputs: {{input_ids: input_ids, attention_mask: attention_mask}},
     outputs: {{text: text}}}}
outputs: {{text: {{value: text, type: text}}}}
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding the test's pipelines (and the model recipe they use); the working directory, so the
    default outputs/ folder lands in it."""
    (tmp_path / "mistral3-text-encoder.yaml").write_text((RECIPES / "mistral3-text-encoder.yaml").read_text())
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")  # the module library it includes
    (tmp_path / "embed.yaml").write_text(EMBED)
    (tmp_path / "show-tokens.yaml").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*args):
    return CliRunner().invoke(app, ["run", *map(str, args), "--weights", str(CHECKPOINT)])


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_an_array_output_is_written_as_npy(workdir):
    result = run("embed.yaml", "--prompt", PROMPT, "--no-compile", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    (item,) = summary["runs"]
    out = item["outputs"]["prompt_embeds"]
    # no seed parameter: no seed in the name; the counter starts at 1
    assert out["type"] == "array" and out["path"] == "outputs/embed-a-red-fox-in-the-snow_00001_.npy"
    embeds = np.load(workdir / out["path"], allow_pickle=False)
    hidden = 16  # the tiny text encoder's hidden size; three layers stacked
    assert embeds.shape == (1, 64, 3 * hidden) and embeds.dtype == np.float32 and np.isfinite(embeds).all()
    pipe = Pipeline(workdir / "embed.yaml", weights=CHECKPOINT, compile=False)
    direct = pipe.run({"prompt": PROMPT}).values["prompt_embeds"]
    np.testing.assert_array_equal(embeds, direct)
    # the whole command's time and the share spent compiling and planning
    timing = summary["timing"]
    assert 0 <= timing["compile_seconds"] <= timing["total_seconds"]
    assert item["seconds"] + timing["compile_seconds"] <= timing["total_seconds"] + 1e-3
    assert timing["compile_share"] == pytest.approx(timing["compile_seconds"] / timing["total_seconds"], abs=1e-3)


def test_profile_prints_kernel_time_per_model_and_kernel_class(workdir):
    result = run("embed.yaml", "--prompt", PROMPT, "--no-compile", "--json", "--profile")
    assert result.exit_code == 0, result.output
    profile = json.loads(result.stdout)["profile"]
    # the naive program: primitives only, each call timed under its kernel's name, for the one model run
    kernels = profile["mistral3-text-encoder"]
    assert set(kernels) <= set(PRIMITIVE_OPS) and {"Gather", "Mul", "SumReduce"} <= set(kernels)
    assert all(rec["seconds"] >= 0 and rec["calls"] >= 1 for rec in kernels.values())
    assert kernels["Gather"]["calls"] == 1  # the embedding lookup, once per run
    table = run("embed.yaml", "--prompt", PROMPT, "--no-compile", "--profile")
    assert table.exit_code == 0, table.output
    assert re.search(r"mistral3-text-encoder: [\d.]+ ms in kernels\n  \w+ +[\d.]+ ms +[\d.]+% +\d+ calls",
                     table.output), table.output


def test_profile_lists_the_costliest_kernel_instances_when_asked(workdir, monkeypatch):
    """LUMINAL_RECIPES_PROFILE_TOP=N: the N costliest kernel instances per model (kernel, output shape and dtype,
    the views read), identical instances added up, in the JSON summary and at the end of the table."""
    monkeypatch.setenv("LUMINAL_RECIPES_PROFILE_TOP", "3")
    result = run("embed.yaml", "--prompt", PROMPT, "--no-compile", "--json", "--profile")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    rows = summary["profile_instances"]["mistral3-text-encoder"]
    assert len(rows) == 3 and [r["seconds"] for r in rows] == sorted((r["seconds"] for r in rows), reverse=True)
    classes = summary["profile"]["mistral3-text-encoder"]
    for row in rows:
        kernel = row["kernel"].split()[0]
        assert kernel in classes and 1 <= row["calls"] <= classes[kernel]["calls"], row
        assert " f32 " in row["kernel"] and " <- " in row["kernel"], row  # dtype and the views it reads
    table = run("embed.yaml", "--prompt", PROMPT, "--no-compile", "--profile")
    assert table.exit_code == 0, table.output
    assert re.search(r"the 3 costliest kernel instances \(ms, share, calls\):\n +[\d.]+ +[\d.]+% +\d+  \w+ ",
                     table.output), table.output


def test_a_text_output_is_printed_and_written(workdir):
    result = run("show-tokens.yaml", "--prompt", PROMPT)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    expected = tokenizers.Tokenizer.from_file(str(CHECKPOINT / "tokenizer" / "tokenizer.json"))
    pipe = Pipeline(workdir / "show-tokens.yaml", weights=CHECKPOINT)
    ids = pipe.run({"prompt": PROMPT}).values["input_ids"][0]
    text = expected.decode([int(i) for i in ids if i != 11], skip_special_tokens=False)  # 11: <pad>
    assert PROMPT in text and text.startswith("<s>[SYSTEM_PROMPT]")
    assert lines[0] == text.splitlines()[0] and text in result.stdout
    path = workdir / "outputs" / "show-tokens-a-red-fox-in-the-snow_00001_.txt"
    assert path.read_text(encoding="utf-8") == text
    assert f"wrote outputs/{path.name}" in result.stdout
    m = re.search(r"done in ([\d.]+) s, of which compiling and planning ([\d.]+) s \((\d+)%\)", result.stdout)
    assert m and float(m.group(2)) <= float(m.group(1)), result.stdout
    quiet = run("show-tokens.yaml", "--prompt", PROMPT, "--quiet")
    assert quiet.exit_code == 0 and quiet.stdout == text + "\n"  # --quiet: the text alone


def test_flags_for_parameters_the_pipeline_lacks_are_refused_before_any_work(workdir, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the pipeline ran although a flag was invalid")

    monkeypatch.setattr(Pipeline, "prepare", no_work)
    for flag, value in (("--steps", "3"), ("--seed", "1"), ("--width", "64"), ("--guidance", "2")):
        result = run("show-tokens.yaml", "--prompt", PROMPT, flag, value)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert f"{flag}: pipeline 'show-tokens'" in result.stderr and f"has no parameter '{flag[2:]}'" in \
            result.stderr
    result = run("show-tokens.yaml", "--prompt", PROMPT, "--init-latents", "x.npy")
    assert result.exit_code == 2 and "takes no `init_latents` input" in result.stderr
    assert files(workdir / "outputs") == []


def test_a_required_input_run_cannot_give_is_a_located_error(workdir):
    text = TEXT.replace("  prompt: {type: str}\n", "  prompt: {type: str}\n  mask_ratio: {type: float}\n")
    (workdir / "needs.yaml").write_text(text)
    result = run("needs.yaml", "--prompt", PROMPT)
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = text.splitlines().index("  mask_ratio: {type: float}") + 1
    assert f"needs.yaml:{line}:3: pipeline input 'mask_ratio' (float) is required" in result.stderr
    assert "--prompt" in result.stderr and files(workdir / "outputs") == []


def test_a_pipeline_without_outputs_is_refused(workdir):
    (workdir / "none.yaml").write_text(TEXT.rsplit("\noutputs:", 1)[0] + "\n")
    result = run("none.yaml", "--prompt", PROMPT)
    assert result.exit_code == 2 and "declares no `outputs:`" in result.stderr


def test_an_output_of_the_wrong_type_names_the_output_and_writes_nothing(workdir):
    text = EMBED.rsplit("\noutputs:", 1)[0] + "\noutputs: {embeds: {value: prompt_embeds, type: image}}\n"
    (workdir / "wrong.yaml").write_text(text)
    result = run("wrong.yaml", "--prompt", PROMPT, "--no-compile")
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = len(text.splitlines())
    assert f"wrong.yaml:{line}:11: output 'embeds' is declared an image but has shape (1, 64, 48)" in result.stderr
    assert files(workdir / "outputs") == []


def test_default_names_are_numbered_and_never_overwrite(workdir):
    for _ in range(2):
        assert run("show-tokens.yaml", "--prompt", PROMPT).exit_code == 0
    (workdir / "outputs" / "show-tokens-a-red-fox-in-the-snow_00007_.txt").write_text("someone else's")
    assert run("show-tokens.yaml", "--prompt", PROMPT, "--prompt", "a cat").exit_code == 0
    assert files(workdir / "outputs") == [
        "show-tokens-a-cat_00001_.txt",
        "show-tokens-a-red-fox-in-the-snow_00001_.txt",
        "show-tokens-a-red-fox-in-the-snow_00002_.txt",
        "show-tokens-a-red-fox-in-the-snow_00007_.txt",
        "show-tokens-a-red-fox-in-the-snow_00008_.txt",
    ]
    assert (workdir / "outputs" / "show-tokens-a-red-fox-in-the-snow_00007_.txt").read_text() == "someone else's"


def test_a_name_taken_meanwhile_gets_the_next_number(tmp_path, monkeypatch):
    """Two runs racing for one number: the file is created, never replaced (os.link refuses an existing name)."""
    (tmp_path / "x_00001_.txt").write_text("first")
    monkeypatch.setattr(outputs_module, "next_counter", lambda folder, stems: 1)  # it looked before the other
    written = outputs_module.write_numbered(tmp_path, {"t": "x"}, {"t": ("text", "second")}, {})
    assert written["t"].name == "x_00002_.txt" and (tmp_path / "x_00001_.txt").read_text() == "first"


def test_an_existing_output_is_refused_before_any_work_unless_overwrite(workdir, monkeypatch):
    target = workdir / "tokens.txt"
    target.write_text("keep me")

    def no_work(*args, **kwargs):
        raise AssertionError("the pipeline ran although --output exists")

    with monkeypatch.context() as patch:
        patch.setattr(Pipeline, "prepare", no_work)
        result = run("show-tokens.yaml", "--prompt", PROMPT, "-o", target)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"--output {target}: the file exists; pass --overwrite" in result.stderr
    assert target.read_text() == "keep me"
    wrong = run("show-tokens.yaml", "--prompt", PROMPT, "-o", workdir / "tokens.png")
    assert wrong.exit_code == 2 and "is written as .txt" in wrong.stderr
    result = run("show-tokens.yaml", "--prompt", PROMPT, "-o", target, "--overwrite")
    assert result.exit_code == 0, result.output
    assert PROMPT in target.read_text() and files(workdir / "outputs") == []


def test_image_outputs_are_numbered_pngs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = ["--no-compile", "--steps", "1", "--width", "32", "--height", "32", "--set", "max_sequence_length=32",
             "--prompt", "a fox"]
    for _ in range(2):
        result = CliRunner().invoke(app, ["run", str(RECIPES / "flux2-tiny.yaml"), *small])
        assert result.exit_code == 0, result.output
    first, second = tmp_path / "outputs" / "flux2-tiny-0-a-fox_00001_.png", \
        tmp_path / "outputs" / "flux2-tiny-0-a-fox_00002_.png"
    assert files(tmp_path / "outputs") == [first.name, second.name]
    (a, meta), (b, _) = read_png(first), read_png(second)
    np.testing.assert_array_equal(a, b)  # same plan, same bytes
    assert meta["seed"] == "0" and meta["steps"] == "1" and meta["size"] == "32x32"
