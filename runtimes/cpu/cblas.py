"""The address of ``cblas_sgemm`` in the BLAS that numpy itself uses, for compiled kernels (``numba_kernels``) that
call a matrix product between their own passes without returning to Python.

Found through threadpoolctl (the library numpy loaded, so ``cpu_threads.blas_single_threaded`` governs its
threads like numpy's own calls; its symbol names, ``scipy_`` prefix and ``64_`` suffix in numpy's wheels, as
threadpoolctl resolves them) and only for OpenBLAS, whose integer width (``USE64BITINT`` in its configuration
string) can be read from the library itself. Anything else (MKL, Accelerate, a BLAS whose integer width cannot
be told) gives ``None``: callers keep their numpy path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path


@functools.cache
def sgemm() -> tuple[int, bool] | None:
    """``(address of cblas_sgemm, whether its integers are 64-bit)`` in numpy's BLAS, or None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a dependency of the project
        return None
    import numpy as np

    np.ones((2, 2)) @ np.ones((2, 2))  # numpy loads its BLAS on first use
    libraries = ThreadpoolController().select(internal_api="openblas").lib_controllers
    numpy_libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"  # numpy's own first, then any other
    libraries.sort(key=lambda lib: not Path(lib.filepath).resolve().is_relative_to(numpy_libs))
    for lib in libraries:
        # threadpoolctl's look-up of a symbol with the library's prefix and suffix (``scipy_`` and ``64_`` in
        # numpy's wheels), as cpu_threads' thread controls use it
        symbol = getattr(lib, "_get_symbol", lambda name: None)
        config, fn = symbol("openblas_get_config"), symbol("cblas_sgemm")
        if config is None or fn is None:
            continue
        config.restype = ctypes.c_char_p
        ilp64 = b"USE64BITINT" in (config() or b"")
        return ctypes.cast(fn, ctypes.c_void_p).value, ilp64
    return None
