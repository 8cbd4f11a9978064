"""Hostile inputs found by an adversarial pass over the issue-21 fixes (each class fixed at its shared mechanism):

- scans of untrusted text that were quadratic: the JSON reader's depth pre-scan (``files.parse_json``) on text full
  of escaped quotes, and printf-width sizing (``text/printf.py``, shared by chat templates and recipe expressions)
  on ``'%(' * n``; nested ``%(a(b)c)`` keys, which the old pattern misread, are sized as Python reads them;
- chat-template values whose text is far larger than their length (``[x, x]`` nested 40 deep, ``[s] * 100000``):
  Python compares, hashes, sorts and lower-cases them in one call no step count interrupts, so they are sized
  when built; ``striptags`` (quadratic in markupsafe) is bounded like ``urlize``;
- recipe expressions: list literals over parameters are sized (a chain of ``[a, a]`` parameters doubled);
- a lone UTF-16 surrogate escape in a checkpoint's JSON (a traceback in the tokenizer) is refused located;
- LoRA pattern dicts bounded in all (thousands of large keys took minutes to build);
- names the file system cannot hold (``--output``, golden files) refused before any work; a golden PNG that is
  not an image is a located error.

Cases that could hang or exhaust memory without their fix run in a child process under ``timeout`` and
``RLIMIT_AS``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from cli_checks import cli, forbid_work, new_workdir, refused  # tests/cli_checks.py
from safetensors.numpy import save_file

from luminal_recipes.errors import LoraError, LuminalError
from luminal_recipes.files import name_problem, parse_json
from luminal_recipes.recipe.safe_eval import ExprError, evaluate, parse, unwrap
from luminal_recipes.text.printf import printf_numbers
from luminal_recipes.weights.lora import read_lora
from luminal_recipes.weights.lora_patterns import MAX_KEYS, PeftPattern
from luminal_recipes.weights.safetensors_io import Checkpoint

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
LLAMA_TINY = ROOT / "tests" / "golden" / "checkpoints" / "llama-tiny"
MEMORY_LIMIT = 2 << 30
SECONDS = 30  # a child's wall limit; each case takes well under a second (several, for the whole group) when fixed


def bounded_python(code: str, seconds: int = SECONDS) -> tuple[int, str, float]:
    """``code`` in a fresh interpreter under ``timeout`` and an address-space limit: (exit code, output, s)."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
    started = time.perf_counter()
    run = subprocess.run(["timeout", "-s", "KILL", str(seconds), sys.executable, "-c", prelude + code],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return run.returncode, run.stdout + run.stderr, time.perf_counter() - started


def results(code: str) -> list:
    """The JSON list a bounded child prints last."""
    rc, output, seconds = bounded_python(code)
    assert rc == 0, f"exit {rc} after {seconds:.1f} s (killed: a hang or memory blow-up): {output[-2000:]}"
    return json.loads(output.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    return new_workdir(tmp_path, monkeypatch)


@pytest.fixture
def no_work(monkeypatch):
    forbid_work(monkeypatch)


# ---- linear scans of untrusted text -----------------------------------------------------------------------------
def test_json_full_of_escaped_quotes_is_scanned_in_linear_time():
    """Every quote of '"' + '\\"' * n started a failing scan to the end of the text: 20,000 took 5 s, a 16 MiB
    config would never finish. Now a string pattern never fails once started."""
    out = results(textwrap.dedent("""
        import json, time
        from luminal_recipes.errors import LuminalError
        from luminal_recipes.files import parse_json
        times = []
        for text in ['"' + '\\\\"' * 1_000_000, '"' + '\\\\"' * 1_000_000 + '\\\\', '[' + '"\\\\"[",' * 200_000 + '1]']:
            start = time.perf_counter()
            try:
                parse_json(text, "f.json")
                times.append(["parsed", time.perf_counter() - start])
            except LuminalError as exc:
                times.append([str(exc)[:80], time.perf_counter() - start])
        print(json.dumps(times))
    """))
    assert [o[0].split(" (")[0] for o in out] == ["f.json:1:1: not valid JSON", "f.json:1:1: not valid JSON", "parsed"]
    assert all(seconds < 5 for _, seconds in out), out


def test_brackets_inside_strings_still_do_not_count_as_nesting():
    assert parse_json('{"a": "' + "[" * 10_000 + '\\"' + "{" * 10_000 + '"}', "f.json")["a"].startswith("[[")
    with pytest.raises(LuminalError, match="more than 128 deep"):
        parse_json('["\\"", ' + "[" * 200 + "]" * 200 + "]", "f.json")


@pytest.mark.parametrize(("template", "numbers"), [
    ("%(k)-*.5f %10s", ["*", "5", "10"]),
    ("%%5d %5%", ["5"]),
    ("%(a(b)c)999999999s", ["999999999"]),  # the key is 'a(b)c', as Python reads it
    ("%.*f|%-0 +#12.7hd", ["*", "12", "7"]),
    ("%(" * 5, []),
    ("a%", []),
])
def test_printf_fields_are_read_as_python_reads_them(template, numbers):
    assert list(printf_numbers(template)) == numbers


def test_printf_sizing_is_linear_and_reads_nested_keys():
    """'%(' * n rescanned the rest of the text from every '%(' (49,999 in a recipe expression: 11 s; a template's
    500,000: minutes); '%(a(b)c)999999999s' was not sized (a 1 GB string)."""
    out = results(textwrap.dedent("""
        import json, time
        from luminal_recipes.errors import LuminalError
        from luminal_recipes.recipe.safe_eval import ExprError, evaluate, parse, unwrap
        from luminal_recipes.text.chat_template import render_chat
        out = []
        for template in ["{{ ('%(' * 500000) % {} }}", "{{ '%(a(b)c)999999999s' % {'a(b)c': 1} }}",
                         "{{ '%(a(b)c)999999999s'|format(**{'a(b)c': 1}) }}", "{{ '%(x)5s|' % {'x': 'a'} }}"]:
            start = time.perf_counter()
            try:
                out.append(["rendered " + render_chat(template, [], {}, "t.jinja"), time.perf_counter() - start])
            except LuminalError as exc:
                out.append([str(exc), time.perf_counter() - start])
        start = time.perf_counter()
        try:
            evaluate(parse(unwrap("${('%(' * 49999) % ()}")), lambda name, node: None)
        except ExprError as exc:
            out.append([exc.message, time.perf_counter() - start])
        print(json.dumps(out))
    """))
    assert "incomplete format key" in out[0][0]
    assert "would make at least 1000000" in out[1][0] and "would make at least 1000000" in out[2][0]
    assert out[3][0] == "rendered     a|"
    assert "format requires a mapping" in out[4][0]
    assert all(seconds < 5 for _, seconds in out), out


# ---- chat templates: values whose text is far larger than their length ------------------------------------------
DAG = "{% set ns = namespace(a=[0], b=[0]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}" \
      "{% set ns.b = [ns.b, ns.b] %}{% endfor %}"
LARGE_VALUE_TEMPLATES = [
    DAG + "{{ ns.a == ns.b }}",  # 2**40 leaves compared
    "{% set ns = namespace(a=(0,)) %}{% for i in range(60) %}{% set ns.a = (ns.a, ns.a) %}{% endfor %}"
    "{{ {ns.a: 1}|length }}",  # hashed
    "{% set ns = namespace(a=(0,)) %}{% for i in range(60) %}{% set ns.a = (ns.a,) + (ns.a,) %}{% endfor %}"
    "{{ [ns.a]|unique|list|length }}",
    "{% set s = 'a' * 1000000 %}{{ ([s] * 100000)|unique|list|length }}",  # 100 GB lower-cased
    "{% set s = 'a' * 1000000 %}{{ ([s] * 100000)|max|length }}",
    "{% set s = 'a' * 1000000 %}{% set t = 'a' * 999999 ~ 'b' %}{{ ([s, t] * 50000)|sort(case_sensitive=true) }}",
    "{% set s = 'a' * 1000000 %}{{ dict(a=[s] * 100000)|length }}",
    "{{ ('<a>' * 300000)|striptags|length }}",  # quadratic in markupsafe
    "{{ (('<a>' * 300000)|safe).striptags()|length }}",
]


def test_values_larger_than_their_length_are_refused_when_built():
    out = results(textwrap.dedent(f"""
        import json, time
        from luminal_recipes.errors import LuminalError
        from luminal_recipes.text.chat_template import render_chat
        out = []
        for template in {LARGE_VALUE_TEMPLATES!r}:
            start = time.perf_counter()
            try:
                out.append(["rendered " + render_chat(template, [], {{}}, "t.jinja"), time.perf_counter() - start])
            except LuminalError as exc:
                out.append([str(exc), time.perf_counter() - start])
        print(json.dumps(out))
    """))
    for (message, seconds), template in zip(out, LARGE_VALUE_TEMPLATES, strict=True):
        assert message.startswith("t.jinja"), (template, message)
        assert "went beyond the renderer's limits" in message, (template, message)
        assert re.search(r"items held more than once|striptags of", message), (template, message)
        assert seconds < 3, (template, seconds)


@pytest.mark.parametrize(("template", "expected"), [
    ("{% set ns = namespace(l=[]) %}{% for i in range(3000) %}{% set ns.l = ns.l + [i] %}{% endfor %}"
     "{{ ns.l|length }}", "3000"),
    ("{% set s = 'a' * 100000 %}{{ ([s] * 100)|unique|list|length }}", "1"),
    ("{{ (range(1000)|map('string')|list * 100)|sort|first }}", "0"),
    ("{% set d = {'a': [1, 2], 'b': (3, 4)} %}{{ d['a'] + [d['b'][0]] }}", "[1, 2, 3]"),
    ("{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %}", "37"),  # tuples assigned to still unpack
    ("{{ ('<b>x</b> &amp; y')|striptags }}", "x & y"),
])
def test_ordinary_values_are_still_built(template, expected):
    from luminal_recipes.text.chat_template import render_chat

    assert render_chat(template, [], {}, "t.jinja") == expected


# ---- recipe expressions -------------------------------------------------------------------------------------------
def test_a_list_of_parameters_is_sized():
    """A chain of parameters each ``${[previous, previous]}`` doubled its items per parameter, unsized: 24 of them
    hung ``inspect`` (type inference walks every item)."""
    half = [0] * 60_000
    with pytest.raises(ExprError, match=r"at least 1\d{5} items"):
        evaluate(parse(unwrap("${[a, a]}")), lambda name, node: half)
    with pytest.raises(ExprError, match=r"at least 1\d{5} items"):
        evaluate(parse(unwrap("${(a, a)}")), lambda name, node: half)
    assert evaluate(parse(unwrap("${[a, [1, 2]]}")), lambda name, node: 3) == [3, [1, 2]]


def test_a_parameter_chain_fails_inspect_at_its_line(tmp_path):
    folder = tmp_path / "recipes"
    shutil.copytree(RECIPES, folder, ignore=shutil.ignore_patterns(
        "flux2-tiny", "flux2-dev-configs", "flux2-klein-4b-configs", "flux2-klein-9b-configs", "*.md", "*.py"))
    lines = ["kind: pipeline", "extends: flux2-klein-tiny.yaml", "name: chain", "params:",
             '  a0: {default: "${[0] * 50000}"}']
    lines += [f'  a{i}: {{default: "${{[a{i - 1}, a{i - 1}]}}"}}' for i in range(1, 25)]
    (folder / "chain.yaml").write_text("\n".join(lines) + "\n")
    refused(cli("inspect", folder / "chain.yaml"), "chain.yaml:6:", "parameter 'a1'",
            "items (nested lists' items included)")


# ---- JSON: lone surrogates ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "where"), [
    ('{"bos_token": "\\ud800"}', "f.json:1:16: "),
    ('["ok", "x\\uDC00y"]', "f.json:1:10: "),
    ('{"k\\udfff": 1}', "f.json:1:4: "),
])
def test_a_lone_surrogate_escape_is_refused_located(text, where):
    with pytest.raises(LuminalError, match=re.escape(where) + ".*half of a UTF-16 surrogate pair"):
        parse_json(text, "f.json")


def test_surrogate_pairs_and_escaped_backslashes_are_read():
    assert parse_json('{"e": "\\ud83d\\ude00", "b": "\\\\ud800"}', "f.json") == {"e": "\U0001F600", "b": "\\ud800"}


def test_a_tokenizer_config_with_a_lone_surrogate_fails_the_run_located(tmp_path):
    checkpoint = tmp_path / "llama"
    shutil.copytree(LLAMA_TINY, checkpoint)
    config = checkpoint / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"<|begin_of_text|>"', '"\\ud800"', 1))
    assert "\\ud800" in config.read_text()
    refused(cli("run", RECIPES / "llama.yaml", "--weights", checkpoint, "-p", "hi", "--no-compile",
                "--max-new-tokens", "1"), "tokenizer_config.json:", "half of a UTF-16 surrogate pair")


# ---- LoRA pattern dicts -------------------------------------------------------------------------------------------
def _lora(path: Path, alpha_pattern: dict) -> Path:
    state = {"transformer.x_embedder.lora_A.weight": np.ones((4, 8), np.float32),
             "transformer.x_embedder.lora_B.weight": np.ones((8, 4), np.float32)}
    config = {"r": 4, "lora_alpha": 4, "alpha_pattern": alpha_pattern}
    save_file(state, path, metadata={"lora_adapter_metadata": json.dumps(config)})
    return path


def test_many_large_pattern_keys_are_refused_quickly(tmp_path):
    """Each key within its bounds, but 400 keys '[a-z]{4990}N' (a 10 KB header) took 21 s to build."""
    path = _lora(tmp_path / "x.safetensors", {f"[a-z]{{4990}}{i}": 8 for i in range(400)})
    out = results(textwrap.dedent(f"""
        import json, time
        from luminal_recipes.errors import LoraError
        from luminal_recipes.weights.lora import read_lora
        start = time.perf_counter()
        try:
            read_lora({str(path)!r}, "x")
            print(json.dumps(["read", time.perf_counter() - start]))
        except LoraError as exc:
            print(json.dumps([str(exc), time.perf_counter() - start]))
    """))
    assert "the keys together expand to more than" in out[0], out
    assert out[1] < 5, out
    with pytest.raises(LoraError, match=f"more than the {MAX_KEYS}"):
        read_lora(_lora(tmp_path / "y.safetensors", {f"k{i}": 8 for i in range(MAX_KEYS + 1)}), "x")


def test_module_name_keys_match_as_peft_does(tmp_path):
    names = ["x_embedder", "blocks.0.attn", "blocks.10.attn", "a.blocks.0.attn", "blocksX0.attn", "xblocks.0.attn",
             "single.blocks.1.proj", "BLOCKS.0.ATTN"]
    for key in ["blocks.0.attn", "x_embedder", "blocks.1.", "[bB]locks.0.attn", "(?i:blocks).0.attn", "attn$",
                "^blocks.0.attn", "blocks\\.0\\.attn", "blocks.(0|10).attn", "b.*s.0.attn"]:
        pattern = PeftPattern(key)
        for name in names:
            assert pattern.matches(name) == bool(re.match(rf"(.*\.)?({key})$", name)), (key, name)
    assert PeftPattern("blocks.0.attn").fast is not None and PeftPattern("blocks.(0|10).attn").fast is None
    assert read_lora(_lora(tmp_path / "x.safetensors", {f"blocks.{i}.attn": 1 for i in range(4000)} |
                           {"x_embedder": 2}), "x").layers[0].scale == 0.5


# ---- names the file system cannot hold ------------------------------------------------------------------------------
def test_name_problem():
    assert name_problem("ok.png") is None and name_problem("missing/folder/ok.png") is None
    assert "300 bytes long" in name_problem("y" * 296 + ".png")
    assert "bytes long" in name_problem("missing/" + "z" * 300 + "/o.png")
    assert "null byte" in name_problem("a\0b.png")


@pytest.mark.parametrize("name", ["y" * 300 + ".png", "sub/" + "z" * 300 + "/o.png", ("d" * 200 + "/") * 25 + "o.png"])
def test_an_output_name_the_file_system_cannot_hold_is_refused_before_any_work(tmp_path, no_work, name):
    refused(cli("run", RECIPES / "flux2-klein-tiny.yaml", "--no-compile", "--steps", "1", "--width", "32",
                "--height", "32", "--quiet", "-p", "fox", "-o", tmp_path / name), "--output", "characters)",
            "choose another --output")


def test_a_golden_file_name_the_file_system_cannot_hold_is_refused_at_its_line(tmp_path, no_work):
    manifest = tmp_path / "goldens.yaml"
    manifest.write_text(f"recipe: {RECIPES / 'flux2-klein-tiny.yaml'}\nimages:\n"
                        f"  - {{prompt: fox, seed: 0, steps: 1, width: 32, height: 32,\n"
                        f"     file: {'x' * 300}.png}}\n")
    refused(cli("golden", "update", manifest), "goldens.yaml:4:", "more than the 255")
    texts = tmp_path / "texts.yaml"
    texts.write_text(f"texts:\n  - {{recipe: {RECIPES / 'llama.yaml'}, weights: {LLAMA_TINY}, ids: true,\n"
                     f"     prompt: hi, name: {'n' * 300}}}\n")
    refused(cli("golden", "update", texts), "texts.yaml:3:", "more than the 255")


def test_a_golden_that_is_not_an_image_is_a_located_error(tmp_path, monkeypatch):
    from luminal_recipes.pipeline import golden

    manifest = tmp_path / "goldens.yaml"
    manifest.write_text(f"recipe: {RECIPES / 'flux2-klein-tiny.yaml'}\nimages:\n"
                        f"  - {{prompt: fox, seed: 0, steps: 1, width: 32, height: 32, file: a.png}}\n")
    (tmp_path / "a.png").write_bytes(b"not a png")
    monkeypatch.setattr(golden, "render", lambda *args, **kwargs: np.random.default_rng(0).integers(
        0, 256, (32, 32, 3), dtype=np.uint8))
    refused(cli("golden", "check", manifest), "a.png: not an image Pillow can read")


# ---- the checkpoint fence: the folder above a tokenizer --------------------------------------------------------------
def test_a_tokenizer_at_a_fenced_checkpoint_s_root_does_not_read_the_folder_above(tmp_path):
    """Whether a tokenizer folder is a processor is read from the pipeline's model_index.json beside it; for a
    tokenizer at the root of a fenced checkpoint that file would lie outside the checkpoint, so it is not read."""
    from luminal_recipes import files
    from luminal_recipes.text.tokenizer import _loaded_as_processor

    tree = tmp_path / "tree"
    checkpoint = tree / "checkpoint"
    (checkpoint / "tokenizer").mkdir(parents=True)
    (tree / "model_index.json").write_text(json.dumps({"checkpoint": ["transformers", "PixtralProcessor"]}))
    (checkpoint / "model_index.json").write_text(json.dumps({"tokenizer": ["transformers", "PixtralProcessor"]}))
    try:
        files.fence(checkpoint, [tree], "r.yaml:1:1: the checkpoint the recipe names", "the recipe's folder tree")
        assert not _loaded_as_processor(checkpoint)
        assert _loaded_as_processor(checkpoint / "tokenizer")  # inside: the pipeline's own model_index.json
    finally:
        files._FENCES.clear()
    assert _loaded_as_processor(checkpoint)  # a folder the user named: read as before


# ---- tokenizer files read whole: bounded --------------------------------------------------------------------------
def _tokenizer_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "tokenizer"
    shutil.copytree(RECIPES / "flux2-klein-tiny" / "checkpoint" / "tokenizer", folder)
    return folder


def _refused_in_child(folder: Path, words: str) -> None:
    out = results(textwrap.dedent(f"""
        import json, resource
        from luminal_recipes.errors import CheckpointError
        from luminal_recipes.tasks.flux2.tokenize import Flux2Tokenizer
        try:
            Flux2Tokenizer.from_pretrained({str(folder)!r}, processor=False)
            print(json.dumps(["read", 0]))
        except CheckpointError as exc:
            print(json.dumps([str(exc), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))
    """))
    assert words in out[0], out
    assert out[1] < 1 << 20, out  # KiB: well under a GiB was ever resident


def test_a_huge_tokenizer_json_is_refused_before_it_is_read(tmp_path):
    """A 3 GiB (sparse) tokenizer.json was read whole and parsed: 12 GB resident, 47 s."""
    folder = _tokenizer_copy(tmp_path)
    os.truncate(folder / "tokenizer.json", 3 << 30)
    _refused_in_child(folder, "tokenizer.json: the tokenizer is 3.0 GiB, more than the 256.0 MiB this tool reads")


def test_named_chat_templates_are_bounded_in_size_and_number(tmp_path):
    """Every additional_chat_templates/*.jinja is read whole: 16 MiB each (and any number of them) reached GBs."""
    folder = _tokenizer_copy(tmp_path)
    extra = folder / "additional_chat_templates"
    extra.mkdir()
    for i in range(3):
        with open(extra / f"t{i}.jinja", "wb") as handle:
            handle.truncate(15 << 20)
    _refused_in_child(folder, "t0.jinja: a chat template is 15.0 MiB, more than the 256.0 KiB this tool reads")
    shutil.rmtree(extra)
    extra.mkdir()
    for i in range(300):
        (extra / f"t{i}.jinja").write_text("{{ messages[0]['content'] }}")
    _refused_in_child(folder, "more than 256 named chat templates")


def test_a_safetensors_header_of_too_many_tensors_is_refused_before_parsing(tmp_path):
    """1,000,000 one-number tensors in a 70 MB header (within the format's 100 MiB) took 2.2 GB and 46 s."""
    import struct

    from luminal_recipes.errors import CheckpointError
    from luminal_recipes.weights.safetensors_io import MAX_TENSORS_PER_FILE

    n = MAX_TENSORS_PER_FILE + 1
    entries = ",".join(f'"t{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}' for i in range(n))
    raw = ("{" + entries + "}").encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "many.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * n))
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"more than the {MAX_TENSORS_PER_FILE} tensors"):
        Checkpoint.open(path)
    assert time.perf_counter() - started < 2


# ---- a recipe's own regexes ---------------------------------------------------------------------------------------
def test_a_backtracking_recipe_regex_stops_at_its_budget(monkeypatch):
    """weights.rename/split/ignore regexes need capture groups, so they run on the regex engine with a time budget
    per pattern: '(a|aa)+$' against 45 a's and a 'b' backtracks for minutes in Python's re."""
    from luminal_recipes.recipe import regexes
    from luminal_recipes.recipe.mapping import rename
    from luminal_recipes.recipe.schema import WeightsSection

    monkeypatch.setattr(regexes, "BUDGET_S", 0.3)
    section = WeightsSection.model_validate({"rename": [{"regex": r"(a|aa)+$", "to": "x"}]})
    started = time.perf_counter()
    with pytest.raises(LuminalError, match=r"regex '\(a\|aa\)\+\$' took more than 0.3 s .*aaab"):
        rename("a" * 45 + "b", section)
    assert time.perf_counter() - started < 5
    # the budget is the pattern's in all: later names are refused at once
    with pytest.raises(LuminalError, match="took more than"):
        rename("a" * 45 + "c", section)


def test_recipe_regexes_keep_re_semantics():
    from luminal_recipes.recipe.mapping import rename
    from luminal_recipes.recipe.schema import WeightsSection

    section = WeightsSection.model_validate({"rename": [
        {"regex": r"^model\.layers\.(\d+)\.(?P<rest>.*)$", "to": r"blocks.\1.\g<rest>"},
        {"prefix": "blocks.", "to": "layers."}]})
    assert rename("model.layers.12.mlp.up_proj.weight", section) == "layers.12.mlp.up_proj.weight"
    with pytest.raises(LuminalError, match="does not fit the regex"):
        rename("model.layers.1.x", WeightsSection.model_validate({"rename": [{"regex": r"model", "to": r"\3"}]}))
