"""LLVM's code pages handed back once numba has loaded or compiled what a run asked for.

numba compiles (or loads from its disk cache) through LLVM, whose shared library (``libllvmlite.so``; also
``libLLVM`` in conda's builds) is 170 MB of code and constant tables. Loading it runs its static initialisers
and making numba's JIT and runtime module touches more: SmolLM2-135M's process held 69 MiB of that library
resident (51 of code, 12 of tables) through the whole run, one fifth of its peak, while decoding never executes
a byte of it (the kernels' machine code lives in the JIT's own anonymous memory; numba's dispatch and runtime are
in numba's small extension modules).

``install()`` registers a listener on numba's compiler lock (``numba:compiler_lock``, which every compilation and
every load from the disk cache takes); when the outermost holder lets it go, ``release()`` drops the library's
read-only, never-written mappings from this process's page tables (``madvise(MADV_DONTNEED)``). The pages stay in
the kernel's page cache, shared and clean: the next compilation or load faults in the ones it runs (minor faults,
a few milliseconds), and a decoding loop that loads nothing keeps none. Mappings with private (written) pages -
the relocated data made read-only after loading - are never touched, so nothing the library wrote is lost.

Linux only (``/proc/self/smaps``, ``madvise``); elsewhere, or with ``LUMINAL_RECIPES_JIT_PAGES=keep``, nothing is
released.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

# llvmlite's library (LLVM linked in: the pip wheels), and LLVM's own where llvmlite links it (conda's builds)
LIBRARIES = ("libllvmlite", "libLLVM")
MADV_DONTNEED = 4
_LOCK = threading.Lock()
_RANGES: list[tuple[int, int]] | None = None
_INSTALLED = False
RELEASED = [0]  # how many times the pages were released (tests)


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("LUMINAL_RECIPES_JIT_PAGES", "release") != "keep"


def read_only_ranges(libraries: tuple[str, ...] = LIBRARIES) -> list[tuple[int, int]]:
    """The address ranges of the mappings of the shared libraries named ``libraries*`` that are read-only (code
    ``r-x``, tables ``r--``) and hold no private page (``Anonymous: 0`` in ``/proc/self/smaps``: never written,
    so dropping them loses nothing)."""
    found: list[list[int]] = []
    current: list[int] | None = None
    try:
        with open("/proc/self/smaps", "rb") as f:
            for line in f:
                head = line.split(None, 5)
                if not head:
                    continue
                if b"-" in head[0] and not head[0].endswith(b":"):
                    current = None
                    name = os.path.basename(head[5].strip()).decode(errors="replace") if len(head) > 5 else ""
                    if name.startswith(libraries) and ".so" in name and head[1] in (b"r-xp", b"r--p"):
                        start, end = (int(x, 16) for x in head[0].split(b"-"))
                        current = [start, end, -1]
                        found.append(current)
                elif current is not None and head[0] == b"Anonymous:":
                    current[2] = int(head[1])
    except OSError:
        return []
    return [(start, end) for start, end, private in found if private == 0]


def resident_kib(ranges: list[tuple[int, int]]) -> int:
    """KiB of the mappings starting at these ranges resident now (``/proc/self/smaps``'s ``Rss``)."""
    starts = {start for start, _ in ranges}
    total, counting = 0, False
    with open("/proc/self/smaps", "rb") as f:
        for line in f:
            head = line.split(None, 5)
            if not head:
                continue
            if b"-" in head[0] and not head[0].endswith(b":"):
                counting = int(head[0].split(b"-")[0], 16) in starts
            elif counting and head[0] == b"Rss:":
                total += int(head[1])
    return total


def _mapped(libraries: tuple[str, ...] = LIBRARIES) -> set[tuple[int, int]]:
    """The read-only mappings of ``libraries*`` now (``/proc/self/maps``: cheaper than smaps, read each time)."""
    out = set()
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            head = line.split(None, 5)
            if len(head) > 5 and head[1] in (b"r-xp", b"r--p"):
                name = os.path.basename(head[5].strip()).decode(errors="replace")
                if name.startswith(libraries) and ".so" in name:
                    start, end = (int(x, 16) for x in head[0].split(b"-"))
                    out.add((start, end))
    return out


def release() -> bool:
    """Drop LLVM's read-only pages from this process's page tables now (see the module's doc); False where there
    is nothing to drop (not Linux, the library not loaded, ``LUMINAL_RECIPES_JIT_PAGES=keep``). Only ranges still
    mapped to the library, with the same bounds and permissions, are dropped."""
    global _RANGES
    if not enabled():
        return False
    with _LOCK:
        if _RANGES is None:  # read once, after numba's first compilation or load: the mappings never move
            _RANGES = read_only_ranges()
        if not _RANGES:
            return False
        try:
            now = _mapped()
        except OSError:
            return False
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        for start, end in _RANGES:
            if (start, end) in now:
                madvise(start, end - start, MADV_DONTNEED)
        RELEASED[0] += 1
    return True


def install() -> None:
    """Release LLVM's pages each time numba's compiler lock is let go by its outermost holder (once per
    process; numba imported by the caller)."""
    global _INSTALLED
    if _INSTALLED or not enabled():
        return
    from numba.core import event
    from numba.core.compiler_lock import global_compiler_lock

    class _AfterCompiling(event.Listener):
        def on_start(self, ev) -> None:
            pass

        def on_end(self, ev) -> None:
            if not global_compiler_lock.is_locked():  # the outermost compilation or load is done
                release()

    event.register("numba:compiler_lock", _AfterCompiling())
    _INSTALLED = True
