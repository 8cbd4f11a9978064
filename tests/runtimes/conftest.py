"""Fixtures for runtime tests. ``runtime`` is every registered runtime (``runtimes.registry``: a new backend
joins the conformance suite by registering there) plus ``numpy-device``, a test-only numpy backend that behaves
like a device (weights and constants copied on upload, outputs downloaded, no host views, streamed weights staged
through a copy stream), so the executable's device paths are exercised without a GPU; a runtime that cannot start
on this machine is skipped.
``numpy_runtime`` is for tests of numpy's own kernels and zero-copy behaviour. ``compare`` runs a Program on
the runtime and its primitive graph on the reference interpreter and checks the outputs through the shared
tolerance table (``tests/TOLERANCES.md``; family ``runtime`` falls back to the ``*`` rows)."""

from __future__ import annotations

import numpy as np
import pytest

from luminal_recipes.errors import LuminalError
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes.copy_stream import HostCopyStream
from luminal_recipes.runtimes.cpu.backend import NumpyBackend, NumpyRuntime
from luminal_recipes.runtimes.executable import BackendRuntime
from luminal_recipes.runtimes.program import Program
from luminal_recipes.runtimes.registry import get_runtime, register_runtime, runtime_names


class DeviceLikeBackend(NumpyBackend):
    """numpy kernels behind a device's memory contract: nothing the caller holds is bound, nothing bound is
    handed out."""

    name = "numpy-device"
    device = "cpu (device-like test backend)"
    host_arrays = False

    def upload(self, host: np.ndarray) -> np.ndarray:
        return np.array(host, copy=True).reshape(-1)

    def download(self, src: np.ndarray) -> np.ndarray:
        return np.array(src, copy=True)

    def copy_stream(self) -> HostCopyStream:
        return HostCopyStream(self.copy_in)  # streamed weights go through staging buffers, as on a GPU


register_runtime("numpy-device", lambda: BackendRuntime(DeviceLikeBackend()))
CONFORMANCE = runtime_names()


@pytest.fixture(scope="session", params=CONFORMANCE)
def runtime(request):
    try:
        return get_runtime(request.param)
    except LuminalError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def numpy_runtime() -> NumpyRuntime:
    return NumpyRuntime()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def compare(runtime, assert_close):
    """Run ``program`` on the runtime and ``graph`` on the reference interpreter; outputs must agree."""

    def run(graph: Graph, program: Program, inputs=None, weights=None, dims=None, family="runtime",
            dtype="f32", names=None):
        want = run_reference(graph, inputs, weights, dims)
        got = runtime.run(program, inputs, weights, dims)
        for name in names or want:
            assert got[name].dtype == want[name].dtype or dtype != "f32", name
            assert_close(family, got[name], want[name], dtype)
        return got, want

    return run
