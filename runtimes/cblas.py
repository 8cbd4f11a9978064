"""The address of ``cblas_sgemm`` in the BLAS that numpy itself uses, for compiled kernels (``numpy_jit``) that
call a matrix product between their own passes without returning to Python.

Found through threadpoolctl (the library numpy loaded, so ``cpu_threads.blas_single_threaded`` governs its
threads like numpy's own calls) and only for OpenBLAS, whose symbol names (``scipy_`` prefix and ``64_`` suffix
in numpy's wheels) and integer width (``USE64BITINT`` in its configuration string) can be read from the library
itself. Anything else (MKL, Accelerate, a BLAS whose integer width cannot be told) gives ``None``: callers keep
their numpy path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path


@functools.cache
def sgemm() -> tuple[int, bool] | None:
    """``(address of cblas_sgemm, whether its integers are 64-bit)`` in numpy's BLAS, or None."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # pragma: no cover - a dependency of the project
        return None
    import numpy as np

    np.ones((2, 2)) @ np.ones((2, 2))  # numpy loads its BLAS on first use
    libraries = [info for info in threadpool_info()
                 if info.get("user_api") == "blas" and info.get("internal_api") == "openblas"]
    numpy_dir = Path(np.__file__).resolve().parent.parent  # numpy's own (e.g. numpy.libs/) first, then any other
    libraries.sort(key=lambda info: not Path(info["filepath"]).resolve().is_relative_to(numpy_dir / "numpy.libs"))
    for info in libraries:
        try:
            lib = ctypes.CDLL(info["filepath"])
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("scipy_", ""), ("", "")):
            config = getattr(lib, f"{prefix}openblas_get_config{suffix}", None)
            fn = getattr(lib, f"{prefix}cblas_sgemm{suffix}", None)
            if config is None or fn is None:
                continue
            config.restype = ctypes.c_char_p
            ilp64 = b"USE64BITINT" in (config() or b"")
            return ctypes.cast(fn, ctypes.c_void_p).value, ilp64
    return None
