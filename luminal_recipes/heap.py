"""Giving freed heap memory back to the operating system.

glibc's ``malloc`` keeps what a program frees for its next allocations instead of returning it, so a burst of
short-lived allocations stays in the resident set (and in every later peak) for the life of the process.
``trim()`` asks glibc to return the free pages (``malloc_trim(0)``, every thread's heap; a few milliseconds).
Called after such bursts: parsing a ``tokenizer.json`` with ``tokenizers`` allocates ~190 MiB for the Tekken
tokenizer, of which ~145 MiB is the parse's scratch, freed when it returns and kept resident until trimmed.
Elsewhere (not glibc) it does nothing.

``zero(array)`` sets a host array to zeros without touching the pages it never wrote: whole pages are handed back
(``madvise(MADV_DONTNEED)``: private anonymous memory reads back as zeros, and takes no memory until written
again). A KV cache planned for a long reply is reset this way before each reply, so that only the rows written
are resident (SmolLM2's 512-row cache is 22.5 MiB in f32; a short reply writes a few pages of it).
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


_MADVISE = None  # libc's madvise, found on first use; False where there is none
PAGE = mmap.PAGESIZE


def zero(array: np.ndarray) -> None:
    """``array[...] = 0``; on Linux, the whole pages inside a C-contiguous array that numpy allocated (private
    anonymous memory: not a file map, not a buffer of another library) are dropped instead of written, so that
    pages never written stay unallocated and written ones are freed."""
    flat = array.reshape(-1).view(np.uint8) if array.flags.c_contiguous else None
    if flat is None or not flat.flags.writeable or not _numpy_owned(array):
        array[...] = 0
        return
    start = flat.ctypes.data
    first = -start % PAGE  # the first whole page's offset in the array
    last = (flat.nbytes - first) // PAGE * PAGE + first
    if last - first < PAGE or not _madvise(start + first, last - first):
        flat[:] = 0
        return
    flat[:first] = 0
    flat[last:] = 0


def _numpy_owned(array: np.ndarray) -> bool:
    owner = array
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner.base is None and owner.flags.owndata and not isinstance(owner, np.memmap)


def _madvise(address: int, length: int) -> bool:
    global _MADVISE
    if _MADVISE is None:
        _MADVISE = False
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                pass
            else:
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                _MADVISE = fn
    return bool(_MADVISE) and _MADVISE(address, length, mmap.MADV_DONTNEED) == 0
