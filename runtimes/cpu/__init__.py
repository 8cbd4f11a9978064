"""The CPU backend (``--runtime numpy``): numpy arrays in host memory, kernels in numpy passes, numba-compiled
row kernels where numba is installed, and AMX tile products where the CPU has them.

``backend.py`` (``NumpyBackend``, ``NumpyRuntime``: the shared executable over host memory); ``kernels/`` one
module per kernel family and the ``PREPARE`` table; ``jit/`` the numba kernels, their lazy loading and disk
cache; ``amx/`` the AMX tile products (GEMM, attention, quantized weights); ``threads.py`` the worker pool that
runs a kernel's parts on every core; ``cblas.py`` the address of numpy's own ``cblas_sgemm`` for compiled code;
``isa.py`` which instruction-set path (AMX, AVX-512, AVX2, plain numpy) the kernels take, from what the CPU
reports (``LUMINAL_RECIPES_ISA`` forces one; ``docs/cpu-backend.md``).
"""

from . import isa  # noqa: F401 - first: it points numba at the selected instruction-set path before any kernel compiles
from .backend import NumpyBackend, NumpyExecutable, NumpyRuntime

__all__ = ["NumpyBackend", "NumpyExecutable", "NumpyRuntime"]
