"""Runtimes (imported as ``luminal_recipes.runtimes``): execute compiled Programs within a memory budget.

Backend-neutral pieces live here: ``kernels`` is the kernel registry (every kernel's spec); a ``Backend``
(``backend.py``) supplies memory and kernel implementations for one device; ``BackendRuntime`` runs Programs on a
backend with the one generic executable (``executable.py``); ``plan_memory`` is the memory planner (liveness,
in-place kernels, one activation arena) that both the runtimes and the compiler's budget check use. Each backend
is a package of its own: ``cpu/`` (``NumpyRuntime``) and ``cuda/``.
"""

from .backend import Backend
from .cpu import NumpyBackend, NumpyExecutable, NumpyRuntime
from .executable import BackendRuntime
from .memory import MemoryPlan, plan_memory
from .program import KERNELS, Program
from .protocol import Executable, MemoryReport, Runtime, RuntimeBase, UnsupportedKernelError, time_executable
from .registry import get_runtime, register_runtime, runtime_names

__all__ = [
    "KERNELS", "Backend", "BackendRuntime", "Executable", "MemoryPlan", "MemoryReport",
    "NumpyBackend", "NumpyExecutable", "NumpyRuntime", "Program", "Runtime", "RuntimeBase",
    "UnsupportedKernelError", "get_runtime", "plan_memory", "register_runtime", "runtime_names", "time_executable",
]
