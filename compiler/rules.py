"""Rewrite rules as data: every ``rules/*.egg`` file is one rule family, found by listing the folder.

``schema.egg`` (the sorts, facts and layout rules every family uses) always comes first, with the kernels'
constructors inserted where it says (generated from the kernel registry, ``runtimes/kernels``, so a kernel's
constructor is declared once, next to how its arguments become attributes). Every other file is one family of
rewrites, tested on its own in ``tests/compiler``; a new file is a new family, used by default.
"""

from __future__ import annotations

import hashlib
from importlib import resources

from luminal_recipes.errors import LuminalError
from luminal_recipes.runtimes.kernels import egglog_declarations

SCHEMA = "schema"
MARKER = "; @KERNEL-CONSTRUCTORS"


def rules_dir():
    return resources.files(__package__).joinpath("rules")


def families() -> tuple[str, ...]:
    """Every rule family in ``compiler/rules/`` (file stem), schema aside, in name order."""
    names = sorted(p.name[: -len(".egg")] for p in rules_dir().iterdir() if p.name.endswith(".egg"))
    return tuple(n for n in names if n != SCHEMA)


FAMILIES = families()


def rule_text(name: str) -> str:
    path = rules_dir().joinpath(f"{name}.egg")
    if not path.is_file():
        known = ", ".join((SCHEMA, *families()))
        raise LuminalError(f"no rule family '{name}' in compiler/rules/; known families: {known}")
    return path.read_text()


def schema_text() -> str:
    text = rule_text(SCHEMA)
    if MARKER not in text:
        raise LuminalError(f"compiler/rules/{SCHEMA}.egg lacks the line '{MARKER}' where the kernel constructors go")
    return text.replace(MARKER, egglog_declarations())


def program_text(families=None) -> str:
    """The schema followed by the given rule families (default: all), as one egglog program."""
    names = FAMILIES if families is None else tuple(families)
    return "\n".join([schema_text(), *(rule_text(name) for name in names)])


def fingerprint(families=None) -> str:
    """A hash of the rule texts the compiler loads (plan caches are keyed on it)."""
    return hashlib.sha256(program_text(families).encode()).hexdigest()
