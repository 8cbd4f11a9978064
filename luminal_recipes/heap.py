"""Giving freed heap memory back to the operating system.

glibc's ``malloc`` keeps what a program frees for its next allocations instead of returning it, so a burst of
short-lived allocations stays in the resident set (and in every later peak) for the life of the process.
``trim()`` asks glibc to return the free pages (``malloc_trim(0)``, every thread's heap; a few milliseconds).
Called after such bursts: parsing a ``tokenizer.json`` with ``tokenizers`` allocates ~190 MiB for the Tekken
tokenizer, of which ~145 MiB is the parse's scratch, freed when it returns and kept resident until trimmed.
Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

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
