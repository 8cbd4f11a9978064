"""The CUDA runtime (imported as ``luminal_recipes.runtimes.cuda``): CUDA C kernels generated per program node,
compiled by NVRTC and launched through CuPy (``cuda``), or compiled by g++ and run on the CPU (``cuda-emu``, for
tests). Importing this package needs neither CuPy nor a GPU.
"""

from .backend import CudaBackend, CudaEmuBackend, CudaExecutable, CudaRuntime, CudaUnavailableError
from .nodes import CudaOptions, CudaPrepareError

__all__ = ["CudaBackend", "CudaEmuBackend", "CudaExecutable", "CudaOptions", "CudaPrepareError", "CudaRuntime",
           "CudaUnavailableError"]
