"""Giving freed heap memory back to the operating system.

glibc's ``malloc`` keeps what a program frees for its next allocations instead of returning it, so a burst of
short-lived allocations stays in the resident set (and in every later peak) for the life of the process.
``trim()`` asks glibc to return the free pages (``malloc_trim(0)``, every thread's heap; a few milliseconds).
Called after such bursts: parsing a ``tokenizer.json`` with ``tokenizers`` allocates ~190 MiB for the Tekken
tokenizer, of which ~145 MiB is the parse's scratch, freed when it returns and kept resident until trimmed.
Elsewhere (not glibc) it does nothing.

``zero(array)`` sets a host array to zeros without touching the pages it never wrote: whole pages are handed back
(``madvise(MADV_DONTNEED)``: private anonymous memory reads back as zeros, and takes no memory until written
again). ``clear(array)`` sets it to zeros keeping the pages it holds: the whole pages resident now (``mincore``)
are written with zeros, the others stay unallocated. A KV cache planned for a long reply is reset with ``clear``
before each reply: only the rows some reply wrote are resident (SmolLM2's 512-row cache is 22.5 MiB in f32; a
short reply writes a few pages of it), and the next reply writes into pages it already holds. Handing them back
instead made every reply fault its cache's pages in again as it wrote them, one row at a time: ~1 ms a token for
a ~1B Llama at 2 threads, 0.2 ms at 1 (``bench/chain_timeline.py``), where llama.cpp keeps its cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

_TRIM = None  # libc's malloc_trim, found on first use; False where there is none


def trim() -> bool:
    """Return the heap's free pages to the system; False where the C library offers no way to."""
    global _TRIM
    if _TRIM is None:
        _TRIM = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            except (OSError, AttributeError):  # musl and others: no malloc_trim
                pass
            else:
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _TRIM = fn
    if not _TRIM:
        return False
    _TRIM(0)
    return True


PAGE = mmap.PAGESIZE


def zero(array: np.ndarray) -> None:
    """``array[...] = 0``; on Linux, the whole pages inside a C-contiguous array that numpy allocated (private
    anonymous memory: not a file map, not a buffer of another library) are dropped instead of written, so that
    pages never written stay unallocated and written ones are freed."""
    pages = _whole_pages(array)
    if pages is None:
        array[...] = 0
        return
    flat, first, last = pages
    if last - first < PAGE or not _madvise(flat.ctypes.data + first, last - first):
        flat[:] = 0
        return
    flat[:first] = 0
    flat[last:] = 0


def clear(array: np.ndarray) -> None:
    """``array[...] = 0`` keeping its pages: where ``zero`` would hand whole pages back, only those resident now
    are written (with zeros) and the others are left unallocated; where residency cannot be read, ``zero``."""
    pages = _whole_pages(array)
    if pages is None:
        array[...] = 0
        return
    flat, first, last = pages
    held = _resident(flat.ctypes.data + first, last - first) if last - first >= PAGE else None
    if held is None:
        zero(array)
        return
    flat[:first] = 0
    flat[last:] = 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], held, [0])).astype(np.int8)))  # runs of resident pages
    for a, b in edges.reshape(-1, 2):
        flat[first + int(a) * PAGE:first + int(b) * PAGE] = 0


def _whole_pages(array: np.ndarray) -> tuple[np.ndarray, int, int] | None:
    """``(array's bytes, first, last)``: ``flat[first:last]`` are the whole pages inside it; None where they are
    not numpy's own writable, C-contiguous memory (written as it is)."""
    flat = array.reshape(-1).view(np.uint8) if array.flags.c_contiguous else None
    if flat is None or not flat.flags.writeable or not _numpy_owned(array):
        return None
    first = -flat.ctypes.data % PAGE  # the first whole page's offset in the array
    return flat, first, (flat.nbytes - first) // PAGE * PAGE + first


_LIBC: dict[str, object] = {}  # libc functions found on first use; False where there is none


def _libc(name: str, argtypes: list):
    """libc's ``name`` (Linux only), its argument types set; False where there is none."""
    if name not in _LIBC:
        _LIBC[name] = False
        if sys.platform.startswith("linux"):
            try:
                fn = getattr(ctypes.CDLL(None, use_errno=True), name)
            except (OSError, AttributeError):
                pass
            else:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                _LIBC[name] = fn
    return _LIBC[name]


def _resident(address: int, length: int) -> np.ndarray | None:
    """Per page of ``[address, address + length)`` (page-aligned), 1 where it is resident, else 0; None where
    the system cannot say."""
    mincore = _libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
    if not mincore:
        return None
    vec = np.zeros(length // PAGE, np.uint8)
    if mincore(address, length, vec.ctypes.data) != 0:
        return None
    return vec & 1


def _numpy_owned(array: np.ndarray) -> bool:
    owner = array
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner.base is None and owner.flags.owndata and not isinstance(owner, np.memmap)


def _madvise(address: int, length: int) -> bool:
    """``madvise(MADV_DONTNEED)`` over the range; whether it was done."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return False
    madvise = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    return bool(madvise) and madvise(address, length, mmap.MADV_DONTNEED) == 0
