"""The CUDA runtime (imported as ``luminal_recipes.runtimes.cuda``): CUDA C kernels generated per program node,
compiled by NVRTC and launched through CuPy (``cuda``), or compiled by g++ and run on the CPU (``cuda-emu``, for
tests), both run by the generic executable. Importing this package needs neither CuPy nor a GPU.
"""

from .backend import CudaBackend, CudaEmuBackend, CudaRuntime, CudaUnavailableError, PlanningCudaRuntime
from .nodes import CudaOptions, CudaPrepareError

__all__ = ["CudaBackend", "CudaEmuBackend", "CudaOptions", "CudaPrepareError", "CudaRuntime", "CudaUnavailableError",
           "PlanningCudaRuntime"]
