"""numba's disk cache of a kernel goes stale when a helper it compiles in from another of our files changes
(runtimes/numba_cache.py): numba alone keys a cached function on its own file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[2]

HELPER = """
import numba

@numba.njit(cache=True, inline="always")
def value():
    return {value}
"""

KERNEL = """
import numba

from .helper import value
{install}

@numba.njit(cache=True)
def kernel():
    return value() * 10
"""

RUN = """
import sys
from pathlib import Path
sys.path[:0] = [{root!r}, {tmp!r}]
from runtimes import numba_cache
numba_cache.HERE = Path({tmp!r}) / "pkg"  # the fake package stands in for runtimes/
from pkg.kernel import kernel
print(kernel())
"""


def _write_package(tmp: Path, value: int, install: bool) -> None:
    pkg = tmp / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text(HELPER.format(value=value))
    call = "from runtimes.numba_cache import install\ninstall()" if install else ""
    (pkg / "kernel.py").write_text(KERNEL.format(install=call))


def _run(tmp: Path) -> int:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", RUN.format(root=str(ROOT), tmp=str(tmp))], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("install", [True, False])
def test_editing_an_inlined_helper_recompiles_the_kernel(tmp_path, install):
    _write_package(tmp_path, 1, install)
    assert _run(tmp_path) == 10  # compiled and cached
    assert _run(tmp_path) == 10  # from the cache
    _write_package(tmp_path, 2, install)  # only the helper's file changes
    # with the locator the kernel's cache is stale and it is compiled again; numba alone serves the old code
    assert _run(tmp_path) == (20 if install else 10)


def test_runtime_kernels_are_stamped_with_their_helpers():
    from runtimes import amx_attention, amx_dequant_gemm, amx_gemm, numba_cache

    def helpers(module):
        return {p.name for p in numba_cache.helper_files(Path(module.__file__))}

    assert helpers(amx_attention) == {"amx_gemm.py", "numpy_jit.py"}
    assert helpers(amx_dequant_gemm) == {"amx_gemm.py"}
    assert helpers(amx_gemm) == set()  # numba's own stamp covers it
    kernel = amx_attention.task
    assert type(kernel._cache._impl._locator).__name__ == "HelpersStampLocator"
