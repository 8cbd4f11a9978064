"""Regenerate the figures in docs/ that come from the code, so they cannot go stale.

    python docs/make_tables.py           # rewrite every generated block in place
    python docs/make_tables.py --check   # exit 1 naming each stale block (tests/test_docs.py runs this check)

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` in a docs file; its text is
``BLOCKS[NAME]()``: memory plans computed by the same planner `luminal-recipe inspect` prints (offline, from the
recipes' ``configs:`` folders), and the option lists of the CLI's commands read from the typer app (what
``--help`` prints).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RECIPES = ROOT / "recipes"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.DOTALL)


def _plans(recipe: str, sets: list[str], budget: int | None = None, model_index: dict | None = None):
    """The stage plans `inspect RECIPE [--set ...] [--max-memory ...]` prints, from the recipe's `configs:`."""
    from luminal_recipes.pipeline.driver import Pipeline
    from luminal_recipes.pipeline.plan import plan_stages

    pipeline = Pipeline(RECIPES / recipe, sets=sets, budget_bytes=budget)
    if model_index is not None:  # a Base checkpoint's model_index.json (the configs folder holds the distilled one)
        pipeline._model_index = {**pipeline.model_index, **model_index}
    return plan_stages(pipeline, budget, from_checkpoint=False)


def _gib(n: int) -> str:
    from luminal_recipes.pipeline.plan import format_bytes

    return format_bytes(n)


def flux2_dev_memory() -> str:
    plans = _plans("flux2.yaml", [], 24 << 30)
    rows = ["| stage | weights (bf16) | activations | weights held | planned peak | plan |",
            "| --- | --- | --- | --- | --- | --- |"]
    for p in plans:
        plan = f"streamed, {p.blocks} blocks, largest {_gib(p.largest_block_bytes)}" if p.streamed else "resident"
        rows.append(f"| {p.stage} | {_gib(p.weight_bytes)} | {_gib(p.activation_peak)} | "
                    f"{_gib(p.resident_weight_bytes)} | {_gib(p.planned_peak)} | {plan} |")
    return "\n".join(rows) + "\n"


def flux2_klein_memory() -> str:
    rows = ["| model | text encoder | transformer (distilled) | transformer (Base, CFG batch 2) | vae |",
            "| --- | --- | --- | --- | --- |"]
    for size, recipe in (("4B", "flux2-klein.yaml"), ("9B", "flux2-klein-9b.yaml")):
        distilled = {p.stage: p for p in _plans(recipe, [])}
        base = {p.stage: p for p in _plans(recipe, ["guidance=4"], model_index={"is_distilled": False})}
        paired = [p for name, p in base.items() if name.startswith("transformer") and p.dims.get("batch") == 2]
        cells = [distilled["text_encoder"], distilled["transformer"], paired[0], distilled["vae"]]
        rows.append(f"| {size} | " + " | ".join(f"{_gib(p.weight_bytes)} + {_gib(p.activation_peak)}" for p in cells)
                    + " |")
    return "\n".join(rows) + "\n"


def _options(command: str) -> str:
    """The options of ``luminal-recipe COMMAND`` as its ``--help`` lists them: the flags and their help text (read
    from the typer app; not the rendered help, whose layout varies with typer's version)."""
    import typer

    from luminal_recipes.cli import app

    cmd = typer.main.get_command(app)
    for part in command.split():
        cmd = cmd.commands[part]
    rows = ["| option | help |", "| --- | --- |"]
    for param in cmd.params:
        if getattr(param, "param_type_name", "") != "option" or param.hidden:  # typer may use its own click copy
            continue
        flags = ", ".join(f"`{flag}`" for flag in [*param.opts, *param.secondary_opts])
        text = " ".join((param.help or "").split()).replace("|", "\\|")
        rows.append(f"| {flags} | {text} |")
    return "\n".join(rows) + "\n"


# The memory tables are the CPU path without AMX (``LUMINAL_RECIPES_AMX=0``, what a CPU without AMX takes): the AMX
# products' packing scratch adds ~3 MiB to a stage's activations, so the same docs would read stale on the other kind
# of CPU. Planned in a child process: the path is decided when the runtime is imported.
PLANNED_PATH = {"LUMINAL_RECIPES_AMX": "0"}


def _planned(name: str) -> Callable[[], str]:
    def block() -> str:
        env = {**os.environ, **PLANNED_PATH}
        env.pop("LUMINAL_RECIPES_ISA", None)
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--print", name], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"planning block '{name}' failed:\n{done.stderr[-4000:]}")
        return done.stdout

    return block


PLANNERS: dict[str, Callable[[], str]] = {
    "memory-flux2-dev": flux2_dev_memory,
    "memory-flux2-klein": flux2_klein_memory,
}
BLOCKS: dict[str, Callable[[], str]] = {
    **{name: _planned(name) for name in PLANNERS},
    "cli-run-options": lambda: _options("run"),
    "cli-chat-options": lambda: _options("chat"),
}


def update(check: bool, names: set[str] | None = None) -> list[str]:
    """Rewrite (or, with ``check``, compare) every generated block of docs/*.md; returns the stale ones as
    ``file: block`` (``names``: only these blocks)."""
    stale = []
    cache: dict[str, str] = {}
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()

        def fill(m: re.Match, path: Path = path) -> str:
            name = m.group("name")
            if names is not None and name not in names:
                return m.group(0)
            if name not in BLOCKS:
                raise SystemExit(f"{path.name}: unknown generated block '{name}' (known: {', '.join(BLOCKS)})")
            if name not in cache:
                cache[name] = BLOCKS[name]()
            if m.group("body") != cache[name]:
                stale.append(f"{path.relative_to(ROOT)}: {name}")
            return m.group(1) + cache[name] + m.group(4)

        new = BLOCK.sub(fill, text)
        if new != text and not check:
            path.write_text(new)
    return stale


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print"]:  # a child of ``_planned``: one memory table, on the path it was started with
        sys.stdout.write(PLANNERS[sys.argv[2]]())
        sys.exit(0)
    check = "--check" in sys.argv[1:]
    chosen = {a for a in sys.argv[1:] if not a.startswith("--")} or None
    stale = update(check, chosen)
    for each in stale:
        print(f"{'stale' if check else 'updated'}: {each}")
    sys.exit(1 if check and stale else 0)
