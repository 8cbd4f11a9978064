"""The tiles of each GGUF weight (``gguf_tiles.repack``), made once per buffer and kept while the buffer lives.

A program is bound again at every new sequence length (``Executable.bind``: the decode loop's symbolic dims), and
every bind prepares the product steps again; the repack (~100 ms for SmolLM2-135M) must not run each time. Tiles
are kept per source buffer - (address, size, type, shape) - and dropped when the object owning the buffer's memory
(the end of the array's base chain: a file map, or the array that owns its data) is collected, so a new buffer at
the same address never meets the old one's tiles.

Only read-only arrays are tiled (the file maps of a GGUF checkpoint, and the rows it copies to un-permute q/k,
which the loader marks read-only): a writable weight may change between runs (a streamed block's slot is refilled
while the program runs), and its tiles would then be stale. Those keep ``gguf_q8``'s per-row loops.

Once tiled, the source's pages are released from this process (``madvise(MADV_DONTNEED)``, whole pages inside the
array only) where - and only where - the array lies on a read-only file map (``numpy.memmap`` mode ``'r'``): there
the kernel just unmaps the pages and a later read (``GatherDequant`` on a tied embedding, rows past the last whole
tile) faults them back in from the page cache. On anonymous or copy-on-write memory the same call would replace
the data by zeros (or the file's bytes), so nothing else is ever released. Without the release the packed bytes
would count twice in the resident set (the file's pages and their tiles).
"""

from __future__ import annotations

import mmap
import time
import weakref
from dataclasses import dataclass

import numpy as np

from . import gguf_tiles


@dataclass
class Stats:
    repacks: int = 0  # tensors repacked (cache misses that made tiles)
    hits: int = 0  # binds that found their tiles
    seconds: float = 0.0  # spent repacking
    released_bytes: int = 0  # file pages released after repacking


STATS = Stats()
_TILES: dict[tuple, np.ndarray] = {}


def _owner(array: np.ndarray):
    """What owns ``array``'s memory: the map, or the array owning its data."""
    from ...file_pages import owner

    root, base = owner(array)
    return root if base is None else base


def _writable(array: np.ndarray) -> bool:
    """Whether the memory under ``array`` may be written through some array: the flag of the array at the end of
    its base chain (the runtime reads weights through read-only views of writable buffers alike)."""
    from ...file_pages import owner

    root, _ = owner(array)
    return root is None or array.flags.writeable or root.flags.writeable


def tiles_for(w: np.ndarray, kind: int) -> np.ndarray | None:
    """The tiles of ``w`` (uint8 [n, row bytes], GGUF rows of ``kind``), made now or found from an earlier bind;
    None where this weight keeps the per-row loops (no VNNI-512, under one tile, writable, or an owner that cannot
    be watched)."""
    if (not gguf_tiles.AVAILABLE or kind not in gguf_tiles.KINDS or w.ndim != 2 or w.shape[0] < gguf_tiles.TILE
            or not w.flags.c_contiguous or _writable(w)):
        return None
    key = (w.ctypes.data, w.nbytes, kind, w.shape)
    tiles = _TILES.get(key)
    if tiles is not None:
        STATS.hits += 1
        return tiles
    try:
        weakref.finalize(_owner(w), _TILES.pop, key, None)
    except TypeError:  # an owner without weak references: its end could not be seen
        return None
    t0 = time.perf_counter()
    tiles = _TILES[key] = gguf_tiles.repack(w, kind)
    STATS.seconds += time.perf_counter() - t0
    STATS.repacks += 1
    STATS.released_bytes += release_file_pages(w)
    return tiles


def read_only_file_map(array: np.ndarray) -> np.memmap | None:
    """The read-only ``numpy.memmap`` (mode ``'r'``, over an ``mmap.mmap``) that ``array`` is a view of, or None
    (anonymous memory, a copy-on-write or writable map, no map at all)."""
    from ...file_pages import owner

    root, base = owner(array)
    if not isinstance(base, mmap.mmap) or not isinstance(root, np.memmap) or root.mode != "r":
        return None
    return root


def release_file_pages(array: np.ndarray) -> int:
    """Drop ``array``'s whole pages from this process where it lies on a read-only file map; the bytes released
    (0 elsewhere: never on memory whose data would be lost)."""
    from ...file_pages import file_span

    if read_only_file_map(array) is None or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    span = file_span(array)
    if span is None or not hasattr(span.mapping, "madvise"):
        return 0
    try:
        span.mapping.madvise(mmap.MADV_DONTNEED, span.map_offset, span.length)
    except (OSError, ValueError):
        return 0
    return span.length


def clear() -> None:
    """Forget every tile (tests)."""
    _TILES.clear()
