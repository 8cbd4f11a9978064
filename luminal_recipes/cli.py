"""The ``luminal-recipe`` command line.

User errors (``LuminalError``) print one paragraph and exit with code 2, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps

import typer

from . import __version__
from .errors import LuminalError

app = typer.Typer(
    name="luminal-recipe",
    help="Run generative models described by YAML recipes (graph builder, egglog search compiler, numpy/CuPy).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def user_errors(fn: Callable) -> Callable:
    """Turn LuminalError into a clean message and exit code 2."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LuminalError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"luminal-recipes {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """luminal-recipes: a model is a YAML recipe."""


def entry() -> None:  # pragma: no cover - console script shim for `python -m luminal_recipes`
    sys.exit(app())
