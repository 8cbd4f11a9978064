"""Fixtures for compiler tests: the numpy runtime and a private plan cache (helpers: compiler_helpers.py)."""

from __future__ import annotations

import pytest

from luminal_recipes.runtimes.cpu.backend import NumpyRuntime


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets its own empty plan cache."""
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(tmp_path / "plans"))
    return tmp_path / "plans"


@pytest.fixture(scope="session")
def runtime() -> NumpyRuntime:
    """The numpy runtime on a machine it takes as quiet: its busy check (``contended``, which leaves the choice to
    the cost model) samples the real machine, whose other load the timing tests do not control
    (``test_search.py`` checks the busy case itself)."""
    rt = NumpyRuntime()
    rt.backend.contended = lambda: None
    return rt
