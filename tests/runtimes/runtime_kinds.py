"""Which kernels a runtime under test runs (a plain module, not conftest: a `from conftest import` clashes
with the other test folders' conftest modules when several folders run in one pytest call)."""

from luminal_recipes.runtimes.cpu.backend import NumpyBackend


def runs_numpy_kernels(runtime) -> bool:
    """The runtime runs numpy's kernels (numpy, numpy-device): tests of their own paths apply to it."""
    return getattr(getattr(runtime, "backend", None), "kernels", None) is NumpyBackend.kernels
