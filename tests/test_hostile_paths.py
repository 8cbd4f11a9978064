"""Hostile paths (issue 21, classes 1, 2, 7 and the template files of 9): every file read from a checkpoint the
recipe names stays inside the folders its author controls (links out refused before any work, and again when a
file is opened); golden files stay inside their manifest's folder; every prompt and the output path are checked
before any work; what stands where a tokenizer file is expected and is not a file is refused, never skipped.

Each hostile fixture is built here in ``tmp_path``: copies of the shipped tiny FLUX.2 [klein] recipe and
checkpoint, and of the tiny Llama checkpoint, with one file replaced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import cli_checks  # tests/cli_checks.py
import pytest
from cli_checks import cli, empty_workdir, forbid_work  # tests/cli_checks.py

from luminal_recipes import files
from luminal_recipes.errors import CheckpointError
from luminal_recipes.recipe.paths import guard_checkpoint
from luminal_recipes.tasks.flux2.tokenize import Flux2Tokenizer
from luminal_recipes.text.tokenizer import eos_token_ids

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
LLAMA_TINY = ROOT / "tests" / "golden" / "checkpoints" / "llama-tiny"
SECRET = "TOP-SECRET-7f3a"  # in every file outside the tree: it must never reach the output
SMALL = ["--no-compile", "--steps", "1", "--width", "32", "--height", "32", "--quiet"]


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    yield from empty_workdir(tmp_path, monkeypatch)


@pytest.fixture(autouse=True)
def no_fences_left():
    """Each test's fences are its own (they live as long as the process)."""
    yield
    files._FENCES.clear()


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any work starts (cli_checks.forbid_work)."""
    forbid_work(monkeypatch)


def refused(result, *fragments: str) -> str:
    """A clean refusal (cli_checks.refused) that never shows the secret."""
    return cli_checks.refused(result, *fragments, secret=SECRET)


def klein(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the recipes with the tiny FLUX.2 [klein] checkpoint its recipe names (``weights:``); (recipe,
    checkpoint)."""
    folder = tmp_path / "recipes"
    shutil.copytree(RECIPES, folder, ignore=shutil.ignore_patterns(
        "flux2-tiny", "flux2-dev-configs", "flux2-klein-4b-configs", "flux2-klein-9b-configs", "*.md", "*.py"))
    return folder / "flux2-klein-tiny.yaml", folder / "flux2-klein-tiny" / "checkpoint"


def weights_line(recipe: Path, key: str = "weights") -> str:
    """``name.yaml:LINE:`` of the line that names the recipe's checkpoint (``weights:``, ``source:``)."""
    line = next(i for i, text in enumerate(recipe.read_text().splitlines(), 1) if re.match(rf"\s*{key}: \S", text))
    return f"{recipe.name}:{line}:"


def link_out(checkpoint: Path, relative: str, outside: Path) -> Path:
    """Move ``checkpoint/relative`` (a file or folder) out of the tree, with the secret added where a reader
    would show it, and leave a link to it in its place; the target."""
    inside = checkpoint / relative
    target = outside / relative.replace("/", "_")
    outside.mkdir(exist_ok=True)
    shutil.move(inside, target)
    for file in [target] if target.is_file() else sorted(target.iterdir()):
        if file.name == "chat_template.jinja":
            file.write_text(SECRET + "\n" + file.read_text())
        elif file.suffix == ".json":
            data = json.loads(file.read_text())
            if isinstance(data, dict):
                data["secret"] = SECRET
            file.write_text(json.dumps(data))
    inside.symlink_to(target)
    return target


# ---- class 1: a recipe-named checkpoint's links stay inside ------------------------------------------------------
KLEIN_FILES = ["tokenizer/chat_template.jinja", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
               "tokenizer", "model_index.json", "text_encoder/generation_config.json", "text_encoder/config.json",
               "transformer/config.json", "scheduler/scheduler_config.json", "vae/config.json",
               "vae/diffusion_pytorch_model.safetensors", "transformer"]


@pytest.mark.parametrize("relative", KLEIN_FILES)
def test_a_link_out_of_a_recipe_checkpoint_is_refused_before_any_work(tmp_path, no_work, relative):
    recipe, checkpoint = klein(tmp_path)
    target = link_out(checkpoint, relative, tmp_path / "outside")
    out = tmp_path / "never.png"
    message = refused(cli("run", recipe, *SMALL, "-p", "fox", "-o", out), "through a symbolic link",
                      f"resolves to {target}", weights_line(recipe))
    assert relative.split("/")[0] in message
    assert not out.exists()
    # `validate` and `inspect` read the same checkpoint: refused the same way
    refused(cli("validate", recipe), f"resolves to {target}", weights_line(recipe))


def test_a_link_out_of_a_recipe_s_configs_folder_is_refused(tmp_path, no_work):
    """A pipeline on the Hub plans from the `configs:` folder in its tree: the same fence."""
    folder = tmp_path / "recipes"
    shutil.copytree(RECIPES, folder, ignore=shutil.ignore_patterns("flux2-tiny", "flux2-klein-tiny", "*.md", "*.py"))
    target = link_out(folder / "flux2-dev-configs", "transformer/config.json", tmp_path / "outside")
    refused(cli("inspect", folder / "flux2.yaml"), f"resolves to {target}", "through a symbolic link",
            f"flux2.yaml:{weights_line(folder / 'flux2.yaml', 'configs').split(':')[1]}:")


def test_the_user_s_own_weights_may_link_anywhere(tmp_path):
    """--weights names the user's own folder: the same links are followed (the fence is the recipe's only)."""
    recipe, checkpoint = klein(tmp_path)
    link_out(checkpoint, "scheduler/scheduler_config.json", tmp_path / "outside")
    with pytest.raises(CheckpointError, match="through a symbolic link"):
        guard_checkpoint(None, checkpoint, False, recipe.parent, "flux2-klein-tiny/checkpoint")
    guard_checkpoint(None, checkpoint, True, recipe.parent, str(checkpoint))  # --weights: the fence lifted
    assert SECRET in files.read_regular_text(checkpoint / "scheduler" / "scheduler_config.json", "a config")


def test_a_link_made_after_the_check_is_refused_when_the_file_is_opened(tmp_path):
    """The walk happens once, when the checkpoint is resolved; every open under the folder is checked again,
    so a link swapped in later (or one the walk did not reach) is refused as the file is opened."""
    tree = tmp_path / "tree"
    folder = tree / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"secret": SECRET}))
    files.fence(folder, [tree], "recipe.yaml:3:10: the checkpoint the recipe names", "the recipe's folder tree")
    assert files.read_regular_text(folder / "config.json", "a config") == "{}"
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(secret)
    (folder / "sub").symlink_to(tmp_path, target_is_directory=True)
    for path in (folder / "config.json", folder / "sub" / "secret.json"):
        with pytest.raises(CheckpointError, match=r"^recipe\.yaml:3:10: .*resolves to .*secret\.json through a "
                                                  r"symbolic link, outside the recipe's folder tree"):
            files.read_regular(path, "a config")
        with pytest.raises(CheckpointError):
            files.check_fence(path)  # what a library opening the path itself (safetensors) is checked with


def test_a_hub_snapshot_may_link_into_its_blobs_only(tmp_path):
    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    (snapshot / "config.json").symlink_to(repo / "blobs" / "f00d")
    guard_checkpoint(None, snapshot, False, None, "hf://org/name")
    assert files.read_regular_text(snapshot / "config.json", "a config") == "{}"
    files._FENCES.clear()
    (tmp_path / "secret").write_text(SECRET)
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(CheckpointError, match="outside the repository's folder in the hub cache"):
        guard_checkpoint(None, snapshot, False, None, "hf://org/name")


def llama(tmp_path: Path) -> tuple[Path, Path]:
    """recipes/llama.yaml naming a local copy of the tiny Llama checkpoint (weights.source); (recipe, ckpt)."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    shutil.copytree(RECIPES / "lib", folder / "lib")
    text = (RECIPES / "llama.yaml").read_text()
    assert "source: hf://meta-llama/Llama-3.2-1B" in text
    (folder / "llama.yaml").write_text(text.replace("source: hf://meta-llama/Llama-3.2-1B", "source: llama-tiny"))
    shutil.copytree(LLAMA_TINY, folder / "llama-tiny")
    return folder / "llama.yaml", folder / "llama-tiny"


@pytest.mark.parametrize("relative", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                      "generation_config.json", "config.json", "model.safetensors"])
def test_a_link_out_of_a_language_model_checkpoint_is_refused(tmp_path, no_work, relative):
    recipe, checkpoint = llama(tmp_path)
    target = link_out(checkpoint, relative, tmp_path / "outside")
    refused(cli("run", recipe, "-p", "hi", "--no-compile", "--max-new-tokens", "2"),
            f"resolves to {target}", "through a symbolic link", weights_line(recipe, "source"))


# ---- class 9: what is not a file where a tokenizer file is expected ----------------------------------------------
def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.mkdir()


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _broken(path: Path) -> None:
    path.symlink_to(path.parent / "nothing-here")


KINDS = {"fifo": (_fifo, "FIFO"), "folder": (_folder, "a folder"), "dev-zero": (_dev_zero, "character device"),
         "broken-link": (_broken, "which does not exist")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json",
                                  "tokenizer.json"])
def test_a_tokenizer_file_that_is_not_a_file_is_refused_not_skipped(tmp_path, kind, name):
    folder = tmp_path / "tokenizer"
    shutil.copytree(RECIPES / "flux2-klein-tiny" / "checkpoint" / "tokenizer", folder)
    make, words = KINDS[kind]
    if (folder / name).exists():
        (folder / name).unlink()
    make(folder / name)
    with pytest.raises(CheckpointError, match=re.escape(str(folder / name))) as caught:
        Flux2Tokenizer.from_pretrained(folder, processor=False)
    assert words in str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_config_that_is_not_a_file_is_refused(tmp_path, kind):
    make, words = KINDS[kind]
    make(tmp_path / "generation_config.json")
    with pytest.raises(CheckpointError, match=words):
        eos_token_ids(tmp_path)


def test_a_fifo_chat_template_in_a_recipe_checkpoint_fails_the_run_located(tmp_path, no_work):
    recipe, checkpoint = klein(tmp_path)
    (checkpoint / "tokenizer" / "chat_template.jinja").unlink()
    os.mkfifo(checkpoint / "tokenizer" / "chat_template.jinja")
    refused(cli("run", recipe, *SMALL, "-p", "fox"), "chat_template.jinja: a chat template must be a regular file",
            "FIFO")


# ---- class 2: golden files stay inside their manifest's folder ---------------------------------------------------
def golden_manifest(tmp_path: Path, file: str) -> Path:
    folder = tmp_path / "goldens" / "set"
    folder.mkdir(parents=True)
    manifest = folder / "goldens.yaml"
    manifest.write_text(f"recipe: {RECIPES / 'flux2-klein-tiny.yaml'}\nimages:\n"
                        f"  - {{prompt: fox, seed: 0, steps: 1, width: 32, height: 32,\n"
                        f"     file: {file}}}\n")
    return manifest


@pytest.mark.parametrize("command", ["update", "check"])
def test_a_golden_file_outside_the_manifest_folder_is_refused_at_its_line(tmp_path, no_work, command):
    victim = tmp_path / "outside" / "victim.png"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    manifest = golden_manifest(tmp_path, "../../outside/victim.png")
    refused(cli("golden", command, manifest), "goldens.yaml:4:", "climbs out of the manifest's folder")
    assert victim.read_bytes() == b"precious"
    assert not (victim.parent / "victim.diff.png").exists()


@pytest.mark.parametrize("linked", ["sub", "sub/a.png", "sub/a.diff.png"])
def test_a_golden_file_linked_out_of_the_manifest_folder_is_refused(tmp_path, no_work, linked):
    outside = tmp_path / "outside"
    outside.mkdir()
    manifest = golden_manifest(tmp_path, "sub/a.png")
    folder = manifest.parent
    if linked == "sub":
        (folder / "sub").symlink_to(outside, target_is_directory=True)
    else:
        (folder / "sub").mkdir()
        (folder / linked).symlink_to(outside / "victim.png")
    refused(cli("golden", "update", manifest), "goldens.yaml:4:", "through a symbolic link")
    assert list(outside.iterdir()) == []


def test_a_text_golden_record_outside_the_manifest_folder_is_refused(tmp_path, no_work):
    folder = tmp_path / "goldens"
    folder.mkdir()
    manifest = folder / "texts.yaml"
    manifest.write_text(f"texts:\n  - {{recipe: {RECIPES / 'llama.yaml'}, weights: {LLAMA_TINY}, ids: true,\n"
                        f"     prompt: hi, name: ../../victim}}\n")
    refused(cli("golden", "update", manifest), "texts.yaml:3:", "climbs out of the manifest's folder")
    assert not (tmp_path / "victim.json").exists()


# ---- class 7: every prompt and the output path are checked before any work ---------------------------------------
def test_a_bad_second_prompt_is_refused_before_the_first_is_run(tmp_path, no_work, workdir):
    recipe, _ = klein(tmp_path)
    template = "{% if 'BAD' in messages[-1]['content'] %}{{ raise_exception('no BAD prompts') }}{% endif %}" \
               "{{ messages[-1]['content'] }}"
    text = recipe.read_text()
    recipe.write_text(text + f"tokenizer:\n  chat_template: {json.dumps(template)}\n")
    refused(cli("run", recipe, *SMALL, "-p", "a fine fox", "-p", "a BAD fox"), "prompt 2 of 2",
            "stage 'tokenize'", "no BAD prompts")
    assert not (workdir / "outputs").exists()


@pytest.mark.parametrize("case", ["dangling-link", "proc", "fifo", "under-a-file", "dev-null-link"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, no_work, case):
    recipe, _ = klein(tmp_path)
    if case == "dangling-link":
        out = tmp_path / "out.png"
        out.symlink_to(tmp_path / "missing" / "target.png")
        words = "which does not exist"
    elif case == "proc":
        out, words = Path("/proc/x.png"), "not a writable folder"
    elif case == "fifo":
        out = tmp_path / "out.png"
        os.mkfifo(out)
        words = "FIFO"
    elif case == "under-a-file":
        (tmp_path / "file.txt").write_text("x")
        out, words = tmp_path / "file.txt" / "out.png", "not a writable folder"
    else:
        out = tmp_path / "out.png"
        out.symlink_to("/dev/null")
        words = "character device"
    refused(cli("run", recipe, *SMALL, "-p", "fox", "-o", out, "--overwrite"), f"--output {out}", words)
    assert not (tmp_path / "missing").exists()


CHECKPOINT_READERS = ["luminal_recipes/text", "luminal_recipes/tasks", "luminal_recipes/weights/safetensors_io.py",
                      "luminal_recipes/weights/sources.py", "luminal_recipes/weights/check.py",
                      "luminal_recipes/pipeline/driver.py", "luminal_recipes/recipe/builder.py"]


def test_checkpoint_readers_open_files_only_through_files_open_regular():
    """The modules that read checkpoint files never open one around ``files.open_regular`` (where the fence and
    the regular-file check are): no ``open(``, ``read_text(``, ``read_bytes(`` or path-opening memmap."""
    offenders = []
    for base in CHECKPOINT_READERS:
        base = ROOT / base
        for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
            text = path.read_text()
            for pattern in (r"\.read_text\(", r"\.read_bytes\(", r"(?<![\w.])(?<!def )open\(", r"memmap\((?!handle)"):
                for match in re.finditer(pattern, text):
                    offenders.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}")
    assert not offenders, offenders
