"""``--threads N``: one setting for every thread pool a run uses on the CPU.

It sets, for this process: the parts our CPU kernels split their work into (``LUMINAL_RECIPES_THREADS``, the
runtime's thread pool), BLAS's threads (OpenBLAS, MKL, BLIS: through their environment variables before they
load, through threadpoolctl once loaded), OpenMP's (``OMP_NUM_THREADS``), numba's (``NUMBA_NUM_THREADS``, at most
the cores numba sees) and PyTorch's when it is loaded. Called before the runtimes load (the CLI does it first
thing in a command) every pool starts at that size; called later, each already running pool is resized.
"""

from __future__ import annotations

import os
import sys

from .errors import InputError

ENVIRONMENT = ("LUMINAL_RECIPES_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
# where the CPU runtime keeps its thread count (kernels read it when they are bound); the first found is used
POOL_MODULES = ("luminal_recipes.runtimes.cpu.threads", "luminal_recipes.runtimes.cpu_threads")
MAX_THREADS = 4096

_blas_limits = None  # threadpoolctl's limiter, kept so its setting lasts


def cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int, flag: str = "--threads") -> int:
    """Use ``threads`` threads in every pool (module docstring); returns it. Not a whole number in
    1..4096: InputError naming ``flag``."""
    global _blas_limits
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise InputError(f"{flag} {threads!r}: expected a whole number of threads from 1 to {MAX_THREADS} (this "
                         f"machine has {cpu_count()} cores)")
    for name in ENVIRONMENT:
        os.environ[name] = str(threads)
    os.environ["NUMBA_NUM_THREADS"] = str(min(threads, cpu_count()))  # numba refuses more than it sees
    for name in POOL_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module.THREADS = threads
    if "numpy" in sys.modules:  # BLAS is loaded: resize its pool now
        from threadpoolctl import threadpool_limits

        _blas_limits = threadpool_limits(limits=threads, user_api="blas")
    numba = sys.modules.get("numba")
    if numba is not None and hasattr(numba, "set_num_threads"):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads"):
        torch.set_num_threads(threads)
    return threads


def threads_in_use() -> dict[str, int]:
    """What each pool is set to now (for tests and ``--json``): ``ours``, ``blas`` (the loaded BLAS libraries'
    smallest setting) and ``numba`` when loaded."""
    import importlib

    out: dict[str, int] = {}
    for name in POOL_MODULES:
        try:
            out["ours"] = importlib.import_module(name).THREADS
            break
        except ImportError:
            continue
    from threadpoolctl import threadpool_info

    blas = [info["num_threads"] for info in threadpool_info() if info.get("user_api") == "blas"]
    if blas:
        out["blas"] = min(blas)
    numba = sys.modules.get("numba")
    if numba is not None:
        out["numba"] = numba.get_num_threads()
    return out
