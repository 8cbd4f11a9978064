"""Runtimes (imported as ``luminal_recipes.runtimes``): execute compiled Programs within a memory budget.

``Runtime`` is the protocol every backend follows; ``NumpyRuntime`` is the CPU backend; ``plan_memory`` is the
memory planner (liveness, in-place kernels, one activation arena) that both the runtimes and the compiler's
budget check use.
"""

from .memory import MemoryPlan, plan_memory
from .numpy_runtime import NumpyExecutable, NumpyRuntime
from .program import KERNELS, Program
from .protocol import Executable, MemoryReport, Runtime, RuntimeBase, UnsupportedKernelError, time_executable

__all__ = [
    "KERNELS", "Executable", "MemoryPlan", "MemoryReport", "NumpyExecutable", "NumpyRuntime", "Program",
    "Runtime", "RuntimeBase", "UnsupportedKernelError", "plan_memory", "time_executable",
]
