"""numba's on-disk cache of our kernels, made stale by an edit of any helper a kernel compiles in.

numba keys a cached function on its own source file only. Our kernels compile in helpers from other files
(``amx/attention.py`` and ``amx/dequant_gemm.py`` inline ``amx/gemm.py``'s tile IR and ``jit/numba_kernels.py``'s
row loops), so after an edit of ``amx/gemm.py`` alone the cache would keep serving machine code built from the old
helpers. ``install()`` puts a locator in front of numba's own: for a file of the CPU backend's package
(``runtimes/cpu``, any sub-folder) it takes the locator numba would have chosen (same folder, same file names)
and adds to its source stamp the digest of every file of that package the module imports numba code from
(relative imports, any depth), transitively. A stale stamp is a cache miss: numba compiles again and overwrites it.
A module that compiles in helpers of another of our files calls ``install()`` before it defines a kernel (files
without such helpers keep numba's own locator, so the order of imports never changes a stamp).

It relies on ``numba.core.caching``'s list of locator classes (``CacheImpl._locator_classes``; ``_CacheImpl``
before numba 0.61): where that is missing, ``install()`` does nothing and numba's own stamps apply.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # the CPU backend's package (runtimes/cpu)


def _defines_numba_code(text: str) -> bool:
    """Whether a file defines compiled functions or intrinsics (not merely mentions or imports numba)."""
    return "njit(" in text or "@intrinsic" in text


def _module_file(package: Path, dotted: str) -> Path | None:
    """The file of module ``dotted`` below the folder ``package`` (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``)."""
    base = package.joinpath(*dotted.split(".")) if dotted else package
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


# ``from .a.b import (x, y as z)``: its dots, its module, its names. Read with a pattern, not ``ast.parse``: this
# runs on the jit warm-up thread, and CPython 3.11's AST constructor keeps its recursion depth per interpreter, so
# two threads parsing at once (Dynamo tracing a model on the main thread) fail with "SystemError: AST constructor
# recursion depth mismatch" (seen 2026-12-04: the warm-up died, the AMX kernels were left unloaded and a warm
# start's output differed in its last bits; or the main thread's parse raised)
_RELATIVE_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.+)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.MULTILINE)


def relative_imports(text: str) -> list[tuple[int, str, list[str]]]:
    """Every relative ``from`` import of a module's source at the start of a line: (level, module - "" for
    ``from .. import x`` -, the names imported)."""
    out = []
    for dots, module, names in _RELATIVE_IMPORT.findall(text):
        names = re.sub(r"#[^\n]*", "", names).strip().strip("()").replace("\\", " ")
        out.append((len(dots), module, [n.split()[0] for n in names.split(",") if n.split()]))
    return out


@functools.cache
def _numba_imports(path: Path) -> tuple[Path, ...]:
    """The files of this package (the CPU backend, ``HERE``) that ``path`` imports with a relative import
    (``from .name import ...``, ``from ..jit.numba_kernels import ...``, ``from .. import amx``) and that define
    numba code (kernels, inlined helpers or intrinsics)."""
    found = []
    for level, module, names in relative_imports(path.read_text()):
        package = path.parent
        for _ in range(level - 1):
            package = package.parent
        for name in [module] if module else names:
            dep = _module_file(package, name)
            if (dep is not None and dep.is_relative_to(HERE) and dep != Path(__file__).resolve()
                    and _defines_numba_code(dep.read_text())):
                found.append(dep)
    return tuple(found)


def helper_files(path: Path) -> list[Path]:
    """``path``'s numba helpers in this package, transitively (sorted; ``path`` itself not included)."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        for dep in _numba_imports(todo.pop()):
            if dep not in seen and dep != path:
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


@functools.cache
def helpers_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for dep in helper_files(path):
        digest.update(dep.relative_to(HERE).as_posix().encode())
        digest.update(dep.read_bytes())
    return digest.hexdigest()


def install() -> bool:
    """Put the locator in front of numba's (once per process); False where numba's internals differ."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    base = getattr(caching, "_CacheLocator", None)
    classes = getattr(impl, "_locator_classes", None)
    if base is None or not isinstance(classes, list):
        return False
    if any(getattr(c, "_luminal_helpers", False) for c in classes):
        return True

    class HelpersStampLocator(base):
        """numba's locator for a file of this package, its stamp extended by the digest of its helpers."""

        _luminal_helpers = True

        def __init__(self, inner, path: Path):
            self._inner, self._path = inner, path

        def ensure_cache_path(self):
            return self._inner.ensure_cache_path()

        def get_cache_path(self):
            return self._inner.get_cache_path()

        def get_disambiguator(self):
            return self._inner.get_disambiguator()

        def get_source_stamp(self):
            return self._inner.get_source_stamp(), helpers_digest(self._path)

        @classmethod
        def from_function(cls, py_func, py_file):
            path = Path(py_file).resolve()
            if not path.is_relative_to(HERE) or not helper_files(path):
                return None  # numba's own locator and stamp: nothing else is compiled in
            for other in classes:
                if other is not cls:
                    inner = other.from_function(py_func, py_file)
                    if inner is not None:
                        return cls(inner, path)
            return None

    classes.insert(0, HelpersStampLocator)
    return True
