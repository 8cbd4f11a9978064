"""numba's disk cache of a kernel goes stale when a helper it compiles in from another of our files changes
(runtimes/cpu/jit/disk_cache.py): numba alone keys a cached function on its own file."""

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

from {dots}helper import value
{install}

@numba.njit(cache=True)
def kernel():
    return value() * 10
"""

RUN = """
import sys
from pathlib import Path
sys.path[:0] = [{root!r}, {tmp!r}]
from runtimes.cpu.jit import disk_cache as numba_cache
numba_cache.HERE = Path({tmp!r}) / "pkg"  # the fake package stands in for runtimes/cpu/
from pkg{sub}.kernel import kernel
print(kernel())
"""


def _write_package(tmp: Path, value: int, install: bool, nested: bool) -> None:
    """pkg/helper.py and the kernel beside it (``from .helper``) or in a sub-package (``from ..helper``)."""
    pkg = tmp / "pkg"
    kernel_dir = pkg / "sub" if nested else pkg
    kernel_dir.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (kernel_dir / "__init__.py").write_text("")
    (pkg / "helper.py").write_text(HELPER.format(value=value))
    call = "from runtimes.cpu.jit.disk_cache import install\ninstall()" if install else ""
    (kernel_dir / "kernel.py").write_text(KERNEL.format(install=call, dots=".." if nested else "."))


def _run(tmp: Path, nested: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    code = RUN.format(root=str(ROOT), tmp=str(tmp), sub=".sub" if nested else "")
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize(("install", "nested"), [(True, False), (False, False), (True, True)])
def test_editing_an_inlined_helper_recompiles_the_kernel(tmp_path, install, nested):
    _write_package(tmp_path, 1, install, nested)
    assert _run(tmp_path, nested) == 10  # compiled and cached
    assert _run(tmp_path, nested) == 10  # from the cache
    _write_package(tmp_path, 2, install, nested)  # only the helper's file changes
    # with the locator the kernel's cache is stale and it is compiled again; numba alone serves the old code
    assert _run(tmp_path, nested) == (20 if install else 10)


def test_runtime_kernels_are_stamped_with_their_helpers():
    from runtimes.cpu.amx import attention as amx_attention
    from runtimes.cpu.amx import dequant_gemm as amx_dequant_gemm
    from runtimes.cpu.amx import gemm as amx_gemm
    from runtimes.cpu.jit import disk_cache as numba_cache

    def helpers(module):
        return {p.relative_to(numba_cache.HERE).as_posix() for p in numba_cache.helper_files(Path(module.__file__))}

    # a sibling and a cousin folder, and what they import in turn (``jit/spin.py``: the atomic ``fetch_add``)
    assert helpers(amx_attention) == {"amx/gemm.py", "jit/numba_kernels.py", "jit/spin.py"}
    assert helpers(amx_dequant_gemm) == {"amx/gemm.py", "jit/spin.py"}
    assert helpers(amx_gemm) == {"jit/spin.py"}
    kernel = amx_attention.task
    assert type(kernel._cache._impl._locator).__name__ == "HelpersStampLocator"


def test_relative_imports_are_read_as_python_reads_them_without_ast():
    """The helpers are found with a pattern, not ``ast.parse`` (which fails when two threads parse at once on
    CPython 3.11: the jit warm-up thread while Dynamo traces): on every file of the project it finds exactly the
    relative imports the AST has, and it never calls ``ast.parse``."""
    import ast
    from unittest import mock

    from luminal_recipes.runtimes.cpu.jit import disk_cache

    files = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    assert len(files) > 100
    for path in files:
        text = path.read_text()
        want = sorted((n.level, n.module or "", [a.name for a in n.names]) for n in ast.walk(ast.parse(text))
                      if isinstance(n, ast.ImportFrom) and n.level >= 1)
        assert sorted(disk_cache.relative_imports(text)) == want, path
    sample = "from .a import (x,  # why\n    y as z)\nfrom .. import amx\n  from ...b.c import d as e, f\n"
    assert disk_cache.relative_imports(sample) == [(1, "a", ["x", "y"]), (2, "", ["amx"]), (3, "b.c", ["d", "f"])]
    disk_cache._numba_imports.cache_clear()
    with mock.patch.object(ast, "parse", side_effect=AssertionError("ast.parse called")):
        assert disk_cache.helper_files(ROOT / "runtimes" / "cpu" / "amx" / "attention.py")
