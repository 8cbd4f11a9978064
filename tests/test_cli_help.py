"""Every command's and subcommand's `--help` prints its usage and exits 0. The commands are enumerated from the
typer app itself, so a command added later is covered without editing this file."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from luminal_recipes.cli import app


def command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """``()`` for the app itself, then every command and subcommand as its argument path (a group is any
    command with ``commands``: typer may use click's classes or its own copy of them)."""
    paths = [path]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        paths += command_paths(sub, path + (name,))
    return paths


COMMANDS = command_paths(typer.main.get_command(app))


def test_the_enumeration_sees_every_command():
    names = {" ".join(p) for p in COMMANDS}
    assert {"run", "validate", "inspect", "schema", "quantize", "golden check", "golden update"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "luminal-recipe")
def test_help_prints_usage(path):
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and "Traceback" not in result.output
    assert f"luminal-recipe {' '.join(path)}".strip() in result.output


def test_help_shows_bracketed_text_verbatim():
    """Square brackets in help texts are text, not markup (they crashed `run --help` once)."""
    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0, result.output
    assert "hf://org/repo[@rev][/subfolder]" in result.output
