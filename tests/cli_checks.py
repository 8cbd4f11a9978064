"""What the hostile-input tests (tests/test_adversarial.py, tests/test_hostile_*.py) share: running the CLI in
process, the shape of a clean refusal, and a working folder in which a default ``outputs/`` written by mistake
is seen."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from luminal_recipes.cli import app


def cli(*args: object):
    """``luminal-recipe ARGS...`` run in this process; the click result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result, *fragments: str, out: Path | None = None, secret: str | None = None,
            warnings: bool = True) -> str:
    """Exit 2, one clean message (``error: ...``) holding ``fragments``, no traceback; nothing at ``out``,
    ``secret`` nowhere in the output, and no warning printed unless ``warnings``. Returns the message."""
    message = result.stderr
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}{result.exception!r}"
    assert "Traceback" not in result.output, result.output
    assert warnings or "Warning" not in result.output, result.output
    assert secret is None or secret not in result.output, result.output
    assert message.startswith("error: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    if out is not None:
        assert not out.exists(), f"{out} was written"
    return message


def new_workdir(tmp_path: Path, monkeypatch) -> Path:
    """Run the test in a new empty folder (the current directory), returned."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def empty_workdir(tmp_path: Path, monkeypatch):
    """A fixture body: run the test in an empty folder and fail it if a default ``outputs/`` appears there."""
    work = new_workdir(tmp_path, monkeypatch)
    yield work
    assert not (work / "outputs").exists(), "a refused run wrote into outputs/"


def forbid_work(monkeypatch) -> None:
    """Fail the test if a model is planned or a weight read: a bad input must be refused before any work."""
    from luminal_recipes.pipeline import plan
    from luminal_recipes.recipe.builder import BuiltModel
    from luminal_recipes.weights.safetensors_io import Checkpoint

    def work(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(plan, "plan_model", work)
    monkeypatch.setattr(Checkpoint, "load", work)
    monkeypatch.setattr(BuiltModel, "load_weight", work)
