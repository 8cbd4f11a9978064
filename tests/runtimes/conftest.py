"""Fixtures for runtime tests: the numpy runtime, a seeded generator, and ``compare``, which runs a Program on
the runtime and its primitive graph on the reference interpreter and checks the outputs through the shared
tolerance table (``tests/TOLERANCES.md``; family ``runtime`` falls back to the ``*`` rows)."""

from __future__ import annotations

import numpy as np
import pytest

from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes.numpy_runtime import NumpyRuntime
from luminal_recipes.runtimes.program import Program


@pytest.fixture
def runtime() -> NumpyRuntime:
    return NumpyRuntime()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def compare(runtime, assert_close):
    """Run ``program`` on the numpy runtime and ``graph`` on the reference interpreter; outputs must agree."""

    def run(graph: Graph, program: Program, inputs=None, weights=None, dims=None, family="runtime",
            dtype="f32", names=None):
        want = run_reference(graph, inputs, weights, dims)
        got = runtime.run(program, inputs, weights, dims)
        for name in names or want:
            assert got[name].dtype == want[name].dtype or dtype != "f32", name
            assert_close(family, got[name], want[name], dtype)
        return got, want

    return run
