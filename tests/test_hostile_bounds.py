"""Hostile text that could hang or exhaust memory before any check (issue 21, class 3), chat-template failures and
prompts that are not UTF-8 (class 6): each is refused with one located message, in seconds, within a memory
limit. Cases that could hang or allocate gigabytes run in a subprocess under ``timeout`` and ``RLIMIT_AS``.

- chat templates: the one bounded renderer (``luminal_recipes/text/bounded_jinja.py``), and real-world templates
  still render exactly as transformers' ``apply_chat_template`` renders them;
- recipe expressions (``recipe/safe_eval.py``): sizes bounded before computing;
- ``--chat-var`` values and golden manifests: the recipe loader's bounded YAML reader;
- prompts (and --system, --chat-var) that are not UTF-8: refused naming the byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_checks import empty_workdir  # tests/cli_checks.py
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import CheckpointError
from luminal_recipes.text.chat_template import render_chat

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
MEMORY_LIMIT = 2 << 30  # bytes of address space for a probe's process
SECONDS = 20  # a probe's wall limit (they take well under a second on a quiet machine)


def bounded_python(code: str, *args: str, memory: int = MEMORY_LIMIT, seconds: int = SECONDS) -> tuple[int, str,
                                                                                                     float]:
    """Run ``code`` in a fresh interpreter under ``timeout`` and an address-space limit; (exit code, output,
    seconds)."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
    started = time.perf_counter()
    run = subprocess.run(["timeout", "-s", "KILL", str(seconds), sys.executable, "-c", prelude + code, *args],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return run.returncode, run.stdout + run.stderr, time.perf_counter() - started


def assert_refused(code: str, *args: str, words: tuple[str, ...] = ()) -> str:
    rc, output, seconds = bounded_python(code, *args)
    assert rc == 2, f"exit {rc} after {seconds:.1f} s: {output[-2000:]}"
    assert "Traceback" not in output, output
    for word in words:
        assert word in output, f"{word!r} not in {output!r}"
    assert seconds < SECONDS
    return output


# ---- chat templates -------------------------------------------------------------------------------------------
RENDER = textwrap.dedent("""
    import sys
    from luminal_recipes.errors import LuminalError
    from luminal_recipes.text.chat_template import render_chat
    try:
        template = open(sys.argv[1], encoding="utf-8").read()
        text = render_chat(template, [{"role": "user", "content": "hi"}], {"bos_token": "<s>"},
                           "probe/chat_template.jinja", add_generation_prompt=True)
    except LuminalError as exc:
        print("error:", exc)
        sys.exit(2)
    print("rendered", len(text), "characters")
""")

TEMPLATE_PROBES = [
    ("{{ 10 ** (10 ** 10) }}", "bits"),
    ("{% if false %}{{ 10 ** (10 ** 10) }}{% endif %}{{ 10 ** (10 ** 10) }}", "bits"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}", "limits"),
    ("{{ 'a' * 10**9 }}", "repetitions"),
    ("{{ 'a'|center(10**9) }}", "center"),
    ("{{ 'a'|center(1000000000) }}", "center"),
    ("{{ 'a'.center(10**9) }}", "center"),
    ("{{ 'a'.ljust(10**9) ~ 'a'.zfill(10**9) }}", "ljust"),
    ("{{ '%*d' % (10**9, 1) }}", "%"),
    ("{{ '%0999999999d' % 0 }}", "%"),
    ("{{ '%s'|format('x') ~ '%0999999999d'|format(0) }}", "format"),
    ("{{ '{:>1000000000}'.format(1) }}", "str.format"),
    ("{{ messages|tojson(indent=10**9) }}", "tojson"),
    ("{{ range(10**9) }}", "range()"),
    ("{{ range(10**9)|list|length }}", "range()"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "too deeply"),
    ("{{ " + "(" * 20_000 + "1" + ")" * 20_000 + " }}", "nested too deeply"),
    ("{{ " + "9" * 5_000 + " }}", "probe/chat_template.jinja:1:"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "~"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "sum"),
    ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "bits"),
    ("{{ ['x' * 1000000] * 100 }}", "items held more than once"),
    ("{{ (['x' * 1000000] * 100)|string }}", "items held more than once"),
    ("{{ (['ab'] * 100000)|join('x' * 1000) }}", "join"),
    ("{{ ([[0] * 99999] * 99999)|sum(start=[])|length }}", "items held more than once"),
    ("{{ [1]|batch(10**9, 0)|list }}", "batch"),
    ("{{ ('x\n' * 1000)|indent(100000) }}", "indent"),
    ("{{ ('x ' * 100000)|wordwrap(1, wrapstring='y' * 1000) }}", "wordwrap"),
    ("{{ 'aaaa'.replace('', 'x' * 10**6) }}", "replace"),
    ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", "replace"),
    ("{{ (1).to_bytes(10**9, 'big') }}", "to_bytes"),
    ("{{ lipsum(10**6) }}", "lipsum"),
    ("{% for x in [1, 2] recursive %}{% if loop.depth < 60 %}{{ loop([1, 2]) }}{% endif %}{% endfor %}", "limits"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [i] %}{% endfor %}", "in all"),
    ("{{ 'x' * 300000 }}" * 20, "rendered text"),
    ("{{ raise_exception('no system messages') }}", "refused the conversation"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 10.0 ** 400 }}", "OverflowError"),
    ("{% for m in messages %}", "not valid Jinja"),
    ("x" * 70_000, "characters long"),
]


@pytest.mark.parametrize(("template", "words"), TEMPLATE_PROBES, ids=[f"t{i}" for i in range(len(TEMPLATE_PROBES))])
def test_hostile_templates_are_refused_quickly_and_located(tmp_path, template, words):
    path = tmp_path / "chat_template.jinja"
    path.write_text(template, encoding="utf-8")
    output = assert_refused(RENDER, str(path), words=("error: probe/chat_template.jinja", words))
    assert len(output) < 1000, "the message echoes too much of the template"


def test_template_errors_name_the_line():
    template = "line one\n{% if true %}\n{{ 'a' * 10**9 }}\n{% endif %}"
    with pytest.raises(CheckpointError, match=r"t\.jinja:3: .*repetitions"):
        render_chat(template, [{"role": "user", "content": "hi"}], {}, "t.jinja")


def test_bounded_operations_still_compute():
    """What the bounds leave alone renders as Jinja renders it."""
    template = ("{{ 'ab' * 3 }}|{{ '%05d' % 42 }}|{{ '%-6s|' % 'x' }}{{ 2 ** 10 }}|{{ 'a'|center(5) }}|"
                "{{ [[1], [2]]|sum(start=[]) }}|{{ [1, 2]|join(', ') }}|{{ '{:>4}'.format(7) }}|"
                "{{ 'a-b'.replace('-', '+') }}|{{ 'x\ny'|indent(2) }}|{{ [1, 2, 3]|batch(2, 0)|list }}|"
                "{{ {'a': [1]}|tojson(indent=2) }}|{% for i in range(3) %}{{ i }}{% endfor %}|{{ 'a' ~ 1 ~ none }}")
    expected = ("ababab|00042|x     |1024|  a  |[1, 2]|1, 2|   7|a+b|x\n  y|[[1, 2], [3, 0]]|"
                "{\n  \"a\": [\n    1\n  ]\n}|012|a1None")
    assert render_chat(template, [], {}, "t.jinja") == expected


# real-world templates, rendered by transformers and by us
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _real_templates() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "tests" / "tasks" / "generation"))
    from generation_checkpoints import LLAMA3_TEMPLATE

    return {
        "llama3": LLAMA3_TEMPLATE,
        "qwen3": (RECIPES / "flux2-klein-tiny" / "checkpoint" / "tokenizer" / "chat_template.jinja").read_text(),
        "mistral-small-3": (RECIPES / "flux2-tiny" / "checkpoint" / "tokenizer" / "chat_template.jinja").read_text(),
        "smollm2-chatml": SMOLLM2_TEMPLATE,
    }


CONVERSATIONS = [
    ([{"role": "user", "content": "A red fox in the snow, \"quoted\" & <tagged> é 🦊"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nworld"}], {}),
    ([{"role": "user", "content": "Think?"}], {"enable_thinking": False}),
]


@pytest.mark.parametrize("name", ["llama3", "qwen3", "mistral-small-3", "smollm2-chatml"])
def test_real_templates_render_as_transformers(name):
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    template = _real_templates()[name]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    for messages, extra in CONVERSATIONS:
        for generation_prompt in (False, True):
            try:
                expected = chat_template_utils.render_jinja_template(
                    conversations=[messages], chat_template=template, add_generation_prompt=generation_prompt,
                    **special, **extra)
            except Exception:  # noqa: BLE001 - a conversation this template refuses: we must refuse it too
                with pytest.raises(CheckpointError):
                    render_chat(template, messages, special, name, generation_prompt, extra)
                continue
            expected = expected[0][0] if isinstance(expected, tuple) else expected
            expected = expected[0] if isinstance(expected, list) else expected
            assert render_chat(template, messages, special, name, generation_prompt, extra) == expected


# ---- recipe expressions ---------------------------------------------------------------------------------------
EVALUATE = textwrap.dedent("""
    import sys
    from luminal_recipes.recipe.safe_eval import ExprError, evaluate, parse, unwrap
    try:
        value = evaluate(parse(unwrap(sys.argv[1])), lambda name, node: None)
    except ExprError as exc:
        print("error:", exc.message)
        sys.exit(2)
    print("value", repr(value)[:80])
""")


@pytest.mark.parametrize(("expression", "words"), [
    ("${len(sum([[0] * 99999] * 99999, []))}", "make more than 100000"),
    ("${len(sum([[0] * 300] * 300, [0] * 99999))}", "sum() of these lists"),
    ("${'%0999999999d' % 0}", "at most 100000"),
    ("${'%*d' % (10 ** 9, 1)}", "at most 100000"),
    ("${len(str([[0] * 300] * 300))}", "str() of this value"),
    ("${round(5, -2 ** 62)}", None),  # 0, at once: Python would compute 10 ** (2 ** 62) first
    ("${'a' * 60000 + 'b' * 60000}", "at most 100000"),
], ids=["sum-of-repeated-lists", "sum-quadratic", "printf-width", "printf-star", "str-of-repeated", "round",
        "concat"])
def test_expressions_are_sized_before_computing(expression, words):
    if words is None:
        rc, output, seconds = bounded_python(EVALUATE, expression)
        assert rc == 0 and "value 0" in output and seconds < SECONDS, output
        return
    assert_refused(EVALUATE, expression, words=("error:", words))


def test_expressions_within_the_bounds_compute():
    from luminal_recipes.recipe.safe_eval import evaluate, parse, unwrap

    def value(text):
        return evaluate(parse(unwrap(text)), lambda name, node: None)

    assert value("${sum([[1, 2], [3]], [])}") == [1, 2, 3]
    assert value("${sum([(1,), (2,)], ())}") == (1, 2)
    assert value("${sum([1, 2, 3])}") == 6
    assert value("${'%s-%03d' % ('a', 7)}") == "a-007"
    assert value("${round(1234, -2)}") == 1200
    assert value("${str([1, 2])}") == "[1, 2]"
    assert len(value("${[0] * 100000}")) == 100000


# ---- YAML from the command line and from golden manifests -----------------------------------------------------
def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_chat_var_alias_bomb_is_refused():
    code = textwrap.dedent("""
        import sys
        from luminal_recipes.errors import LuminalError
        from luminal_recipes.tasks.generation.cli import parse_chat_vars
        try:
            parse_chat_vars(["x=" + sys.argv[1]])
        except LuminalError as exc:
            print("error:", exc)
            sys.exit(2)
    """)
    assert_refused(code, _alias_bomb(), words=("--chat-var x", "aliases"))


@pytest.mark.parametrize("module", ["luminal_recipes.pipeline.golden", "luminal_recipes.tasks.generation.golden"])
def test_golden_manifest_alias_bomb_is_refused(tmp_path, module):
    manifest = tmp_path / "golden.yaml"
    manifest.write_text(_alias_bomb())
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from luminal_recipes.errors import LuminalError
        from {module} import load_manifest
        try:
            load_manifest(Path(sys.argv[1]))
        except LuminalError as exc:
            print("error:", exc)
            sys.exit(2)
    """)
    assert_refused(code, str(manifest), words=("golden.yaml", "aliases"))


def test_chat_vars_still_read_yaml():
    from luminal_recipes.tasks.generation.cli import parse_chat_vars

    assert parse_chat_vars(["a=true", "b=[1, 2]", "c=text: with colon: twice", "d="]) == {
        "a": True, "b": [1, 2], "c": "text: with colon: twice", "d": ""}


# ---- prompts that are not UTF-8 -------------------------------------------------------------------------------
SMALL = ["--no-compile", "--steps", "2", "--width", "32", "--height", "32", "--set", "max_sequence_length=64",
         "--quiet"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    yield from empty_workdir(tmp_path, monkeypatch)


@pytest.mark.parametrize("recipe", ["flux2-tiny.yaml", "flux2-klein-tiny.yaml"])
def test_flux2_prompt_not_utf8_is_refused_naming_the_byte(workdir, recipe):
    result = CliRunner().invoke(app, ["run", str(RECIPES / recipe), *SMALL, "-p", "a fox", "-p", "caf\udce9 au lait"])
    assert result.exit_code == 2, result.output
    message = result.stderr
    assert message.startswith("error: prompt 2 of 2:"), message
    assert "byte 0xe9 at character 3" in message and "Traceback" not in result.output


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "tasks" / "generation"))
    from generation_checkpoints import save_llama

    folder = tmp_path_factory.mktemp("llama")
    save_llama(folder, seed=0)
    return folder


@pytest.mark.parametrize(("flags", "words"), [
    (["-p", "caf\udce9"], "the prompt 'caf\\udce9' is not valid UTF-8 text (byte 0xe9 at character 3)"),
    (["-p", "hi", "--system", "\udcff"], "--system"),
    (["-p", "hi", "--stop", "x\udc80"], "--stop"),
])
def test_generation_text_not_utf8_is_refused_naming_the_byte(workdir, llama_checkpoint, flags, words):
    result = CliRunner().invoke(app, ["run", str(RECIPES / "llama.yaml"), "--weights", str(llama_checkpoint),
                                      "--no-compile", "--max-new-tokens", "1", "--quiet", *flags])
    assert result.exit_code == 2, result.output
    assert words in result.stderr and "Traceback" not in result.output, result.stderr


def test_generation_template_limit_is_a_located_error(workdir, llama_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    import shutil

    shutil.copytree(llama_checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text("{% if false %}{{ 10 ** (10 ** 10) }}{% endif %}\n{{ 'a' * 10**9 }}")
    code = textwrap.dedent("""
        import sys
        from luminal_recipes.cli import app
        sys.argv = ["luminal-recipe", "run", sys.argv[1], "--weights", sys.argv[2], "--no-compile",
                    "--max-new-tokens", "1", "--quiet", "-p", "hi"]
        app()
    """)
    rc, output, _ = bounded_python(code, str(RECIPES / "llama.yaml"), str(folder), memory=16 << 30, seconds=120)
    assert rc == 2, output
    assert "chat_template.jinja:2:" in output and "repetitions" in output and "Traceback" not in output, output
