"""The thread count of the BLAS numpy calls (OpenBLAS, through its C API), so that a kernel can run its BLAS
products single-threaded on parts split over ``cpu_threads`` instead.

Why: OpenBLAS' own threads split a small GEMM (FLUX.2's linear layers at a few hundred tokens: M 256-800, K and N
256-2304) poorly, and when the OS deschedules one of them the other spins and the whole product stalls (a 2-thread
sgemm measured 2-20 GFLOP/s on this shared 2-core machine while one thread ran 150). Parts of the output computed
by single-threaded calls on our pool keep every core busy, and a part no worker has started is run by the caller
(``cpu_threads``). ``single_threaded(step)`` wraps a step so that BLAS uses one thread while it runs and its
previous count afterwards. Where numpy's BLAS is not an OpenBLAS whose library exports the calls, ``AVAILABLE`` is
False and kernels keep BLAS' own threading.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable

import numpy as np


def _functions():
    """OpenBLAS' (get_num_threads, set_num_threads) in the library numpy loaded, or None."""
    folder = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(folder, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                               ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                return get, put
    return None


_FUNCTIONS = _functions()
# LUMINAL_RECIPES_BLAS_SPLIT=0 keeps BLAS' own threading in every kernel
AVAILABLE = _FUNCTIONS is not None and os.environ.get("LUMINAL_RECIPES_BLAS_SPLIT", "1") != "0"


def single_threaded(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with BLAS on one thread while it runs (its thread count restored after, also on error)."""
    if _FUNCTIONS is None:
        return step
    get, put = _FUNCTIONS

    def run() -> None:
        before = get()
        if before == 1:
            step()
            return
        put(1)
        try:
            step()
        finally:
            put(before)

    return run
