"""Rewrite rules as data: ``rules/*.egg`` files, loaded by family name.

``schema.egg`` (the sorts, constructors and layout facts every family uses) always comes first. Each other
file is one family of rewrites, tested on its own in ``tests/compiler``.
"""

from __future__ import annotations

from importlib import resources

from luminal_recipes.errors import LuminalError

SCHEMA = "schema"
FAMILIES = ("cleanup", "matmul", "elementwise", "softmax", "norms", "attention", "conv", "dequant", "gather",
            "scatter")


def rule_text(name: str) -> str:
    path = resources.files(__package__).joinpath("rules", f"{name}.egg")
    if not path.is_file():
        known = ", ".join((SCHEMA,) + FAMILIES)
        raise LuminalError(f"no rule family '{name}' in compiler/rules/; known families: {known}")
    return path.read_text()


def program_text(families=FAMILIES) -> str:
    """The schema followed by the given rule families, as one egglog program."""
    return "\n".join(rule_text(name) for name in (SCHEMA, *families))
