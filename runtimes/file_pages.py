"""The file pages behind a memory-mapped numpy array: ask the kernel to read them ahead, or to drop them.

A checkpoint tensor handed out by ``weights.safetensors_io.Checkpoint`` is a view (possibly reshaped,
transposed or re-typed) whose ``.base`` chain ends at a ``numpy.memmap`` over an ``mmap.mmap``. From that
chain we recover which pages of which file the array covers. ``will_need`` starts the kernel's read-ahead
(``MADV_WILLNEED``); ``drop`` removes the pages from this process (``MADV_DONTNEED``: for a read-only file
mapping this only unmaps them, the next access faults them in again) and from the page cache
(``POSIX_FADV_DONTNEED``), so a streamed checkpoint does not accumulate in memory. Only whole pages inside the
array are touched, never a neighbouring tensor's. Arrays not backed by a file mapping are left alone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import numpy as np

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class FileSpan:
    """Whole pages of a mapped file that lie inside an array: ``length`` bytes at ``map_offset`` in the
    mapping (``file_offset`` in the file)."""

    mapping: mmap.mmap
    filename: str
    map_offset: int
    file_offset: int
    length: int


def owner(array: np.ndarray) -> tuple[np.ndarray, object]:
    """(the last array, the object after it) at the end of ``array``'s base chain: what owns its memory (an
    ``mmap.mmap`` under a ``numpy.memmap``, or None after an array owning its data). Followed through the holder
    ``numpy.lib.stride_tricks.as_strided`` leaves (an object with ``__array_interface__`` and ``base``: the
    runtime's operand views are made so)."""
    root, base = None, array
    while True:
        if isinstance(base, np.ndarray):
            root, base = base, base.base
        elif hasattr(base, "__array_interface__") and isinstance(getattr(base, "base", None), np.ndarray):
            base = base.base
        else:
            return root, base


def file_span(array: np.ndarray) -> FileSpan | None:
    """The whole pages of the file mapping that ``array`` reads, or None when it is not file-backed."""
    root, base = owner(array)
    if not isinstance(base, mmap.mmap) or not isinstance(root, np.memmap) or root.filename is None:
        return None
    lo, hi = np.lib.array_utils.byte_bounds(array)
    skew = root.offset % mmap.ALLOCATIONGRANULARITY  # numpy maps from an aligned offset below ``offset``
    map_start = root.__array_interface__["data"][0] - skew
    start = -(-(lo - map_start) // PAGE) * PAGE  # inward: whole pages only
    stop = min((hi - map_start) // PAGE * PAGE, len(base))
    if stop <= start:
        return None
    return FileSpan(base, str(root.filename), start, root.offset - skew + start, stop - start)


def will_need(array: np.ndarray) -> None:
    """Start reading the array's pages from disk in the background (a hint; errors are ignored)."""
    span = file_span(array)
    if span is not None and hasattr(span.mapping, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        with contextlib.suppress(OSError, ValueError):
            span.mapping.madvise(mmap.MADV_WILLNEED, span.map_offset, span.length)


class PageDropper:
    """Drops the pages of arrays once they are copied; keeps one read-only descriptor per file for fadvise."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def drop(self, array: np.ndarray) -> int:
        """Unmap the array's whole pages and evict them from the page cache; returns the bytes dropped."""
        span = file_span(array)
        if span is None:
            return 0
        dropped = 0
        if hasattr(span.mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                span.mapping.madvise(mmap.MADV_DONTNEED, span.map_offset, span.length)
                dropped = span.length
            except (OSError, ValueError):
                pass
        if hasattr(os, "posix_fadvise"):
            try:
                fd = self._fds.get(span.filename)
                if fd is None:
                    fd = self._fds[span.filename] = os.open(span.filename, os.O_RDONLY)
                os.posix_fadvise(fd, span.file_offset, span.length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        return dropped

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
