"""`luminal-recipe cache info|clear`: where the plan cache is and what it holds; clearing removes only the files
the cache wrote itself (entries, and temporary files of interrupted writes once they are stale)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from typer.testing import CliRunner

from luminal_recipes import ops
from luminal_recipes.cli import app
from luminal_recipes.compiler import SearchOptions, cache, compile_graph
from luminal_recipes.graph import Graph


def small_graph(width: int) -> Graph:
    g = Graph()
    x = g.input("x", (4, width))
    g.mark_output("y", ops.softmax(ops.linear(x, g.weight("w", (6, width))), -1))
    return g


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_info_and_clear(runtime, tmp_path, monkeypatch):
    folder = tmp_path / "plans"
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(folder))
    result = cli("cache", "info")
    assert result.exit_code == 0, result.output
    assert f"plan cache: {folder} (set by $LUMINAL_RECIPES_CACHE)" in result.output
    assert "does not exist yet" in result.output and "0 entries" in result.output

    for width in (8, 10):
        assert compile_graph(small_graph(width), runtime, options=SearchOptions(time_top=0)).report["cache"] == "miss"
    made = sorted(folder.glob("*.json"))
    assert len(made) == 2 and cache.entries(folder) == made
    size = sum(p.stat().st_size for p in made)
    result = cli("cache", "info")
    assert "2 entries" in result.output and f"({size} bytes)" in result.output, result.output

    # files the cache did not write stay, and so does a temporary file a compile may still be writing
    key = made[0].stem
    mine = [folder / "notes.json", folder / "README", folder / f"{'a' * 63}.json"]
    for path in mine:
        path.write_text("keep")
    (folder / "sub").mkdir()
    (folder / f"{'b' * 64}.json").symlink_to(folder / "notes.json")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # the pid of a writer that has exited
    fresh = folder / f".{key}.json.{gone}.{'1' * 12}.tmp"
    stale = folder / f".{key}.json.{gone}.{'2' * 12}.tmp"
    fresh.write_text("in progress")
    stale.write_text("interrupted")
    old = time.time() - 2 * cache.LEFTOVER_AGE_S
    os.utime(stale, (old, old))

    result = cli("cache", "clear")
    assert result.exit_code == 0, result.output
    assert "removed 3 files" in result.output and "other files there left alone" in result.output
    assert not any(p.exists() for p in made) and not stale.exists()
    assert all(p.read_text() == "keep" for p in mine) and fresh.exists() and (folder / "sub").is_dir()
    assert (folder / f"{'b' * 64}.json").is_symlink()
    assert compile_graph(small_graph(8), runtime, options=SearchOptions(time_top=0)).report["cache"] == "miss"


def test_the_default_location_is_reported(tmp_path, monkeypatch):
    monkeypatch.delenv("LUMINAL_RECIPES_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = cli("cache", "info")
    assert result.exit_code == 0
    assert f"plan cache: {tmp_path / 'luminal-recipes'} (under $XDG_CACHE_HOME" in result.output
