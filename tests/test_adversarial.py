"""Adversarial input: every bad input an adversarial pass found is refused with exit code 2, a message that
says where (file:line, flag or tensor name), no traceback, and nothing written (neither ``outputs/`` nor the
``-o`` path). Cases that could hang (FIFOs) run in a subprocess with a timeout; the plan cache's cases are in
``tests/compiler/test_cache.py``.

Each test writes its bad input first; the recipes are copies of the shipped ones with one line changed, and
the checkpoint is the shipped tiny FLUX.2 one (``--weights`` on the command line may point anywhere).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import cli_checks  # tests/cli_checks.py
import numpy as np
import pytest
from cli_checks import cli, empty_workdir, forbid_work  # tests/cli_checks.py
from PIL import Image

from luminal_recipes.weights import quantize as quantize_module

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TINY = RECIPES / "flux2-tiny.yaml"
FLUX2 = RECIPES / "flux2.yaml"  # flux2-tiny.yaml extends it: most of the tiny pipeline is written there
CHECKPOINT = RECIPES / "flux2-tiny" / "checkpoint"
SMALL = ["--no-compile", "--steps", "2", "--width", "32", "--height", "32", "--set", "max_sequence_length=64",
         "--quiet"]
LOCATED = re.compile(r"\.yaml:\d+:\d+: ")


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    yield from empty_workdir(tmp_path, monkeypatch)


def refused(result, *fragments: str, out: Path | None = None) -> str:
    """A clean refusal (cli_checks.refused) that prints no warning either."""
    return cli_checks.refused(result, *fragments, out=out, warnings=False)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any work starts (cli_checks.forbid_work)."""
    forbid_work(monkeypatch)


def small(*drop: str) -> list[str]:
    """SMALL without the flags named in ``drop`` (and their values)."""
    out, skip = [], False
    for item in SMALL:
        if skip:
            skip = False
            continue
        if item in drop:
            skip = item != "--quiet" and item != "--no-compile"
            continue
        out.append(item)
    return out


def recipes_copy(tmp_path: Path, edit: tuple[str, str] | None = None, name: str = "flux2-tiny.yaml") -> Path:
    """The shipped recipes (and their module libraries) copied into ``tmp_path/recipes``, ``name`` with one
    text replacement."""
    folder = tmp_path / "recipes"
    if not folder.exists():
        shutil.copytree(RECIPES, folder, ignore=shutil.ignore_patterns("flux2-tiny", "flux2-dev-configs", "*.md"))
    if edit is not None:
        path = folder / name
        text = path.read_text()
        assert edit[0] in text, edit[0]
        path.write_text(text.replace(edit[0], edit[1]))
    return folder / name


def checkpoint_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    if not folder.exists():
        shutil.copytree(CHECKPOINT, folder)
    return folder


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


MODEL = """kind: model
name: tiny
params:
  n: 4
{params}dims: [batch]
inputs:
  x: {{shape: [batch, n]}}
modules:
  m:
    inputs: [x]
{submodules}    forward: |
{forward}
"""


def model_recipe(tmp_path: Path, params: str = "", forward: str = "return x * 2.0", submodules: str = "") -> Path:
    """A one-module model recipe (no weights) that ``inspect --config`` builds, so every expression runs."""
    body = "\n".join("      " + line for line in forward.splitlines())
    path = tmp_path / "model.yaml"
    path.write_text(MODEL.format(params=params, forward=body, submodules=submodules))
    (tmp_path / "config.json").write_text("{}")
    return path


def inspect_model(path: Path):
    return cli("inspect", path, "--config", path.parent / "config.json")


def refused_in_subprocess(*args: object, words: tuple[str, ...], timeout: float = 60) -> str:
    """The CLI in a child process (an input that blocks would hang the test process if a check regressed):
    exit 2 within ``timeout``, a message holding ``words``, no traceback."""
    result = subprocess.run([sys.executable, "-m", "luminal_recipes", *map(str, args)], capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("error: "), result.stderr
    for word in words:
        assert word in result.stderr, f"{word!r} not in {result.stderr!r}"
    return result.stderr


# ---- reads outside the recipe's tree ---------------------------------------------------------------------------
@pytest.mark.parametrize(("edit", "words"), [
    (("config: scheduler/scheduler_config.json", "config: /etc/passwd"), "'/etc/passwd' is an absolute path"),
    (("tokenizer: {path: tokenizer}", "tokenizer: {path: /etc}"), "'/etc' is an absolute path"),
    (("config: scheduler/scheduler_config.json", "config: ../../../../etc/passwd"), "climbs out of the checkpoint"),
    (("weights: vae}", "weights: ../../vae}"), "climbs out of the checkpoint"),
], ids=["scheduler-absolute", "tokenizer-absolute", "scheduler-dotdot", "model-folder-dotdot"])
def test_pipeline_paths_stay_in_the_checkpoint(tmp_path, no_work, edit, words):
    base = recipes_copy(tmp_path, edit, "flux2.yaml")  # written in the base: the error points there
    recipe = base.parent / "flux2-tiny.yaml"
    line = line_of(base, edit[1])
    for command in (["validate", recipe], ["run", recipe, "--weights", CHECKPOINT, *SMALL, "-p", "fox"]):
        refused(cli(*command), words, f"/flux2.yaml:{line}:")


def test_pipeline_weights_folder_stays_in_the_recipe_tree(tmp_path, no_work):
    recipe = recipes_copy(tmp_path, ("weights: flux2-tiny/checkpoint", "weights: ../../../../etc"))
    line = line_of(recipe, "../../../../etc")
    refused(cli("validate", recipe), f"flux2-tiny.yaml:{line}:", "climbs out of this recipe's folder")
    refused(cli("run", recipe, *SMALL, "-p", "fox"), f"flux2-tiny.yaml:{line}:")


@pytest.mark.parametrize(("edit", "words"), [
    (("  source: hf://meta-llama/Llama-3.2-1B", "  source: /etc"), "'/etc' is an absolute path"),
    (("  dtype: {storage: keep, compute: f32}", "  config: ../../etc/passwd\n  dtype: {storage: keep, compute: f32}"),
     "climbs out of the checkpoint folder"),
], ids=["source-absolute", "config-dotdot"])
def test_model_paths_stay_in_their_folders(tmp_path, edit, words):
    recipe = recipes_copy(tmp_path, edit, "llama.yaml")
    refused(cli("validate", recipe), words, f"llama.yaml:{line_of(recipe, edit[1].splitlines()[0])}:")


def test_symlink_out_of_a_recipe_checkpoint_is_refused_before_any_work(tmp_path, no_work):
    recipe = recipes_copy(tmp_path)  # names its own checkpoint: weights: flux2-tiny/checkpoint
    checkpoint = recipe.parent / "flux2-tiny" / "checkpoint"
    shutil.copytree(CHECKPOINT, checkpoint)
    link = checkpoint / "scheduler" / "scheduler_config.json"
    link.unlink()
    link.symlink_to("/etc/passwd")
    out = tmp_path / "never.png"
    message = refused(cli("run", recipe, *SMALL, "-p", "fox", "-o", out),
                      "resolves to /etc/passwd through a symbolic link", out=out)
    # located at the line naming the checkpoint (a link anywhere under it is refused when it is resolved)
    assert f"/flux2-tiny.yaml:{line_of(recipe, 'weights:')}:" in message
    link.unlink()
    shutil.copy(CHECKPOINT / "scheduler" / "scheduler_config.json", link)
    config = checkpoint / "vae" / "config.json"
    config.unlink()
    config.symlink_to(CHECKPOINT / "vae" / "config.json")  # a file outside the recipe's tree
    refused(cli("validate", recipe), f"flux2-tiny.yaml:{line_of(recipe, 'weights:')}:",
            "vae/config.json resolves to", "symbolic link")
    # a checkpoint the user names with --weights is the user's own, links and all (tests/pipeline/
    # test_flux2_quantized.py assembles one from symlinks): only the recipe's paths as written are checked there


# ---- resource exhaustion ---------------------------------------------------------------------------------------
def alias_bomb(levels: int) -> str:
    lines = ["kind: model", "name: bomb", "params:", "  a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\nmodules: {}\n"


@pytest.mark.parametrize(("text", "words"), [
    (alias_bomb(9), "expands to more than 100000 values once its aliases"),
    ("kind: model\nname: a\nparams:\n  p: &p [1, *p]\n", "refers to a node that contains it"),
    ("kind: model\nname: a\ndoc: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 100 levels deep"),
    ("kind: model\nname: a\nparams:\n" + "".join(f"  p{i}: *x\n" for i in range(1002)).replace(
        "  p0: *x", "  p0: &x 1"), "more than 1000 aliases"),
], ids=["alias-bomb", "recursive-alias", "deep-nesting", "alias-count"])
def test_yaml_bombs_fail_fast_and_located(tmp_path, text, words):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    started = time.perf_counter()
    message = refused(cli("validate", path), words)
    assert time.perf_counter() - started < 10
    assert LOCATED.search(message)


def test_a_50_mb_yaml_fails_fast(tmp_path):
    path = tmp_path / "huge.yaml"
    with path.open("w") as f:
        f.write("kind: model\nname: a\ndoc: |\n")
        line = "  " + "x" * 998 + "\n"
        f.writelines(line for _ in range(50_000))
    started = time.perf_counter()
    refused(cli("validate", path), "huge.yaml", "more than the 1.0 MiB")
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(("forward", "words"), [
    ("y = 2 ** 10 ** 10", "has more than 64 bits"),
    ("y = pow(10, 10 ** 8)", "has more than 64 bits"),
    ("y = 'a' * 10 ** 10", "make more than 100000"),
    ("y = 0\nfor i in range(10 ** 9):\n    y = i", "this loop runs 1000000000 times"),
    ("y = 10.0 ** 400", "out of range for a float"),
    ("y = exp(1000.0)", "out of range for a float"),
    ("y = int('9' * 5000)", "integers have at most 64 bits"),
    ("y = " + "+".join(["1"] * 200_000), "nested more than 100 levels deep"),
    ("y = " + "-" * 5000 + "1", "nested more than 100 levels deep"),
], ids=["pow-tower", "pow-call", "repeat-string", "range", "float-pow", "exp", "int-digits", "long-sum", "unary"])
def test_forward_expressions_are_bounded(tmp_path, forward, words):
    path = model_recipe(tmp_path, forward=forward + "\nreturn x * 2.0")
    started = time.perf_counter()
    message = refused(inspect_model(path), words, "model.yaml:1")  # the forward is on lines 12-14
    assert LOCATED.search(message) and time.perf_counter() - started < 10
    assert len(message) < 700, "the message echoes too much of the input"


@pytest.mark.parametrize(("value", "words"), [
    ("${2 ** 10 ** 10}", "has more than 64 bits"),
    ("${'a' * 10 ** 10}", "make more than 100000"),
    ("${[0] * 10 ** 9}", "make more than 100000"),
    ("${10.0 ** 400}", "out of range for a float"),
    ("${int('9' * 5000)}", "integers have at most 64 bits"),
    ("${99999999999999999999999}", "the integer has 77 bits"),
    ("${" + "+".join(["1"] * 200_000) + "}", "nested more than 100 levels deep"),
    ("${" + "(" * 300 + "1" + ")" * 300 + "}", "too many nested parentheses"),
], ids=["pow-tower", "repeat-string", "repeat-list", "float-pow", "int-digits", "big-literal", "long-sum", "parens"])
def test_value_expressions_are_bounded(tmp_path, value, words):
    path = model_recipe(tmp_path, params=f"  bomb: \"{value}\"\n")
    message = refused(inspect_model(path), words, "model.yaml:5:")
    assert len(message) < 700


def test_repeat_counts_are_bounded(tmp_path):
    sub = "    submodules:\n      layers: {module: m, repeat: 10 ** 9}\n"
    path = model_recipe(tmp_path, submodules=sub)
    text = path.read_text().replace("modules:\n  m:", "modules:\n  leaf:\n    inputs: [x]\n    forward: return x\n"
                                    "  m:").replace("{module: m,", "{module: leaf,")
    path.write_text(text)
    refused(inspect_model(path), "more than 100000 module instances", f"model.yaml:{line_of(path, 'repeat')}:")


# ---- budgets checked before allocating ---------------------------------------------------------------------------
def test_huge_image_is_refused_before_planning(no_work):
    out = Path("big.png")
    message = refused(cli("run", TINY, *small("--width", "--height"), "--width", "100000", "--height", "100000",
                          "-p", "fox", "-o", out),
                      "dim img", "--width 100000", out=out)
    assert f"recipes/flux2.yaml:{line_of(FLUX2, 'img: (height // 16)')}:" in message


def test_inputs_and_outputs_over_the_budget_fail_before_compiling(no_work):
    refused(cli("run", TINY, "--steps", "2", "--width", "16384", "--height", "16384", "--max-memory", "1GiB",
                "-p", "fox", "-q"), "stage 'transformer'", "for its inputs and outputs alone", "--max-memory")


@pytest.mark.parametrize("args", [["--steps", "1000000000"], ["--set", "steps=1000000000"]],
                         ids=["flag", "set"])
def test_absurd_step_counts_are_refused_before_the_scheduler_allocates(no_work, args):
    refused(cli("run", TINY, *small("--steps"), *args, "-p", "fox"), "steps", "positive integer of at most 10000")


def npy_with_header(path: Path, shape: tuple, data_bytes: int = 0, dtype: str = "<f4") -> Path:
    header = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * data_bytes)
    return path


def test_init_latents_header_is_checked_before_loading(tmp_path, monkeypatch, no_work):
    def never(*args, **kwargs):
        raise AssertionError("the array was loaded before its header was checked")

    monkeypatch.setattr(np, "load", never)
    monkeypatch.setattr(np.lib.format, "read_array", never)
    claims_tebibytes = npy_with_header(tmp_path / "huge.npy", (1, 128, 100000, 100000), 64)
    refused(cli("run", TINY, *SMALL, "-p", "fox", "--init-latents", claims_tebibytes),
            "--init-latents", "(1, 128, 100000, 100000)", "truncated")
    sparse = npy_with_header(tmp_path / "sparse.npy", (1, 128, 4096, 4096))
    os.truncate(sparse, sparse.stat().st_size + 128 * 4096 * 4096 * 4)  # 8 GiB that take no disk
    refused(cli("run", TINY, *SMALL, "-p", "fox", "--init-latents", sparse),
            "--init-latents", "shape (1, 128, 4096, 4096)", "(1, 128, 2, 2)")


# ---- garbage with exit 0 -----------------------------------------------------------------------------------------
def test_nonfinite_weights_stop_at_the_stage_that_produced_them(tmp_path):
    from safetensors.numpy import load_file, save_file

    checkpoint = checkpoint_copy(tmp_path)
    file = checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    tensors["norm_out.linear.weight"] = tensors["norm_out.linear.weight"].copy()
    tensors["norm_out.linear.weight"][0, 0] = np.nan
    save_file(tensors, file)
    out = tmp_path / "garbage.png"
    refused(cli("run", TINY, "--weights", checkpoint, *SMALL, "-p", "fox", "-o", out),
            "stage 'transformer'", "output 'velocity'", "NaN", "--allow-nonfinite", out=out)
    result = cli("run", TINY, "--weights", checkpoint, *SMALL, "-p", "fox", "-o", out, "--allow-nonfinite")
    assert result.exit_code == 0, result.output
    assert "Warning" not in result.output and out.is_file()


@pytest.mark.parametrize("args", [["--guidance", "nan"], ["--guidance", "inf"], ["--set", "guidance=-inf"]],
                         ids=["nan", "inf", "set-inf"])
def test_nonfinite_numbers_on_the_command_line_are_refused(no_work, args):
    refused(cli("run", TINY, *SMALL, *args, "-p", "fox"), "guidance", "finite")


def test_tensor_relabelled_as_integers_is_refused(tmp_path):
    checkpoint = checkpoint_copy(tmp_path)
    file = checkpoint / "vae" / "diffusion_pytorch_model.safetensors"
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header["decoder.conv_norm_out.weight"]["dtype"] = "I32"  # same bytes, read as integers
    text = json.dumps(header, separators=(",", ":")).encode()
    file.write_bytes(raw[:8] + text + b" " * (size - len(text)) + raw[8 + size :])
    for command in (["validate", TINY], ["run", TINY, *SMALL, "-p", "fox"]):
        refused(cli(*command, "--weights", checkpoint), "decoder.conv_norm_out.weight", "is I32 in the checkpoint",
                "weights.dtype.accept", "flux2-vae-decoder.yaml:")


# ---- other tracebacks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-5"])
def test_nonpositive_sequence_length_is_refused_at_the_stage_dims(no_work, value):
    # the tokenize stage's check refuses it first (every prompt is checked by its steps before any planning),
    # located at the stage and naming the --set it came from
    message = refused(cli("run", TINY, *small("--set"), "--set", f"max_sequence_length={value}", "-p", "fox"),
                      f"--set max_sequence_length={value}", "stage 'tokenize'", "max_sequence_length must be positive")
    assert LOCATED.search(message)


def test_nul_byte_in_yaml(tmp_path):
    path = tmp_path / "nul.yaml"
    path.write_text("kind: model\nname: ti\x00ny\n")
    refused(cli("validate", path), "nul.yaml:2:9:", "U+0000")


def test_non_utf8_prompts_file(tmp_path, no_work):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red fox\ncaf\xe9 au lait\n")
    refused(cli("run", TINY, *SMALL, "--prompts-file", prompts), "prompts.txt:2:", "not UTF-8")


def test_full_disk_during_quantize_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(quantize_module, "save_file", full_disk)
    dst = tmp_path / "out" / "transformer-fp8"
    refused(cli("quantize", CHECKPOINT / "transformer", dst, "--format", "fp8"), str(dst), "No space left",
            out=dst)
    assert list(dst.parent.iterdir()) == []  # no staging folder either


# ---- hangs -------------------------------------------------------------------------------------------------------
def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def test_fifos_are_refused_not_read(tmp_path):
    refused_in_subprocess("validate", fifo(tmp_path / "recipe.yaml"), words=("recipe.yaml", "is a FIFO (named pipe)"))

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.yaml").write_text("kind: model\nname: m\ninclude: [blocks.yaml]\nmodules:\n  m:\n"
                                       "    inputs: []\n    forward: return 1\n")
    fifo(folder / "blocks.yaml")
    message = refused_in_subprocess("validate", folder / "model.yaml", words=("model.yaml:3:", "is a FIFO"))
    assert "does not exist" not in message

    checkpoint = checkpoint_copy(tmp_path)
    fifo(checkpoint / "vae" / "config.json")
    refused_in_subprocess("validate", TINY, "--weights", checkpoint, words=("vae/config.json", "FIFO"))
    (checkpoint / "vae" / "config.json").unlink()
    shutil.copy(CHECKPOINT / "vae" / "config.json", checkpoint / "vae" / "config.json")
    fifo(checkpoint / "vae" / "diffusion_pytorch_model.safetensors")
    refused_in_subprocess("validate", TINY, "--weights", checkpoint,
                          words=("vae/diffusion_pytorch_model.safetensors", "FIFO"))

    for flag, name in (("--prompts-file", "prompts.txt"), ("--init-latents", "latents.npy")):
        refused_in_subprocess("run", TINY, *SMALL, "-p", "fox", flag, fifo(tmp_path / name), words=(flag, "FIFO"))


# ---- silent acceptance -------------------------------------------------------------------------------------------
def test_duplicate_yaml_keys_name_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("kind: model\nname: a\nparams:\n  n: 1\n  n: 2\n")
    refused(cli("validate", path), "dup.yaml:5:3:", "key 'n' is given twice (first at line 4")


@pytest.mark.parametrize(("args", "words"), [
    (["--set", "steps=abc", "--steps", "2"], "--steps 2 and --set steps=abc both set 'steps'"),
    (["--set", "steps=abc"], "--set steps=abc: parameter 'steps' is int"),
    (["--set", "seed=1", "--set", "seed=2"], "--set seed is given twice"),
    (["--set", "nosuch=1"], "--set nosuch=...: unknown parameter"),
    (["--set", "text_encoder_out_layers=" + "[" * 5000], "parameter 'text_encoder_out_layers' is list[int]"),
    (["--set", "guidance=nan"], "--set guidance=nan: parameter 'guidance' is float (nan is not a finite number)"),
], ids=["flag-and-set", "bad-type", "twice", "unknown", "deep", "nan"])
def test_every_set_is_validated(no_work, args, words):
    message = refused(cli("run", TINY, *small("--steps"), *args, "-p", "fox"), words)
    assert len(message) < 700


def test_prompt_with_nul_bytes_gives_a_valid_png(tmp_path):
    out = tmp_path / "nul.png"
    result = cli("run", TINY, *SMALL, "-p", "a fox\x00 in\x01 snow", "-o", out)
    assert result.exit_code == 0, result.output
    raw = out.read_bytes()
    offset, texts = 8, []
    while offset < len(raw):
        length, kind = struct.unpack(">I4s", raw[offset : offset + 8])
        data = raw[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", raw[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + data) == crc, f"bad CRC in chunk {kind}"
        if kind == b"tEXt":  # keyword NUL text: a NUL inside the text would end it early
            texts.append(data)
            assert data.count(b"\0") == 1, f"NUL inside the text of {data!r}"
        offset += 12 + length
    assert any(t.startswith(b"prompt\0") for t in texts)
    with Image.open(out) as image:
        image.load()
        assert image.text["prompt"] == "a fox\\x00 in\\x01 snow"


# ---- late refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "words"), [
    (["-p", "fox2", "-p", ""], "prompt 3 of 3: the prompt is empty"),
    (["-p", "fox2", "-p", "[IMG]"], "prompt 3 of 3: the prompt is empty"),
    (["--seed", "-1"], "--seed -1"),
    (["--set", "seed=-1"], "--set seed=-1"),
], ids=["empty-prompt", "image-token-only", "seed", "set-seed"])
def test_arguments_are_refused_before_any_work(no_work, args, words):
    refused(cli("run", TINY, *SMALL, "-p", "fox", *args), words)


def test_output_that_is_a_folder_is_refused_before_any_work(tmp_path, no_work):
    folder = tmp_path / "dir.png"
    folder.mkdir()
    refused(cli("run", TINY, *SMALL, "-p", "fox", "-o", folder), f"--output {folder}", "is a folder")
    assert list(folder.iterdir()) == []


# ---- messages ----------------------------------------------------------------------------------------------------
def test_forward_error_is_reported_on_its_own_line(tmp_path):
    line = "      h = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, window=window)\n"
    library = recipes_copy(tmp_path, (line, line + "      y = 1 in (1, 2)\n"), "lib/causal_lm.yaml")
    refused(cli("validate", library.parents[1] / "llama.yaml"), f"causal_lm.yaml:{line_of(library, 'y = 1 in')}:11:",
            "'in' is not allowed")


def test_text_file_as_init_latents(tmp_path, no_work):
    text = tmp_path / "latents.npy"
    text.write_text("these are not latents\n")
    message = refused(cli("run", TINY, *SMALL, "-p", "fox", "--init-latents", text), "not a readable .npy array",
                      "does not start with numpy's")
    assert "pickled" not in message


def test_a_set_behind_a_recipe_error_is_named():
    message = refused(cli("run", TINY, *SMALL, "-p", "fox", "--set", "text_encoder_out_layers=[99]"),
                      "--set text_encoder_out_layers=[99]")
    assert LOCATED.search(message)


def test_a_set_behind_a_forward_error_is_named(tmp_path):
    path = model_recipe(tmp_path, params="  k: 1\n", forward="y = (1, 2)[k]\nreturn x * y")
    message = refused(cli("inspect", path, "--config", tmp_path / "config.json", "--set", "k=5"),
                      f"model.yaml:{line_of(path, 'y = (1, 2)[k]')}:", "index 5 is not valid for 2 items",
                      "This build overrides --set k=5")
    assert message.count("--set k=5") == 1
