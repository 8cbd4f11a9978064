"""How long OpenBLAS's idle worker threads spin, set before numpy loads OpenBLAS.

After each multi-threaded call, OpenBLAS's workers busy-wait for the next one for 2^28 cycles (~0.1 s) by default.
Our kernels alternate BLAS calls with their own parts on every core (attention, element-wise, norms, convolutions),
so a spinning worker takes a core from them: measured in the medium FLUX.2 pipeline, the worker used 70-100 ms of
CPU during 230-250 ms of attention, and 2^16 cycles (~30 us: back-to-back BLAS calls still find the workers awake)
made the denoising step 10-20% faster (and PyTorch's too, on a loaded machine). OpenBLAS reads the setting once,
when it loads, so the package's ``__init__`` (which every entry imports first: the CLI, the Python API, the server,
the torch backend) and the benchmarks call ``limit_openblas_spin()`` before importing numpy; a value the user set
is kept, and a process that imported numpy before this package keeps OpenBLAS's default.
"""

from __future__ import annotations

import os
import sys

SPIN_EXPONENT = 16  # OPENBLAS_THREAD_TIMEOUT: workers spin 2^N cycles, then sleep (OpenBLAS clamps N to 4..30)


def limit_openblas_spin() -> bool:
    """Set ``OPENBLAS_THREAD_TIMEOUT`` unless the user did; False when numpy (so OpenBLAS) is already loaded."""
    if "numpy" in sys.modules:
        return False
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(SPIN_EXPONENT))
    return True
