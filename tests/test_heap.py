"""``heap.zero``: an array set to zeros by handing its whole pages back, so that pages it never wrote stay
unallocated and written ones are freed; ``heap.clear``: set to zeros keeping the pages it holds (a KV cache
planned for a long reply costs the rows some reply wrote, and a reply does not fault them in again). The resident
set is read from /proc (Linux); the buffer is 64 MiB so that the page counts are far above the noise."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from luminal_recipes import heap

MIB = 1 << 20


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * heap.PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm and madvise: Linux")
def test_zero_leaves_unwritten_pages_unallocated_and_frees_written_ones():
    buf = np.zeros(64 * MIB + 123, np.uint8)[77:]  # a view at no page boundary: the ragged ends are written
    before = resident()
    heap.zero(buf)
    assert resident() - before < 8 * MIB  # writing zeros over it (np.copyto) would make all 64 MiB resident
    buf[:] = 7
    touched = resident()
    heap.zero(buf)
    assert touched - resident() > 48 * MIB
    assert not buf.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm and mincore: Linux")
def test_clear_keeps_written_pages_and_leaves_unwritten_ones_unallocated():
    buf = np.zeros(64 * MIB + 123, np.uint8)[77:]
    heap.zero(buf)  # nothing resident
    before = resident()
    buf[5:16 * MIB] = 7  # the first quarter written (from a ragged start)
    buf[-100:] = 9  # and the ragged end
    written = resident()
    assert written - before > 15 * MIB
    heap.clear(buf)
    assert not buf.any()
    after = resident()
    assert abs(after - written) < 4 * MIB  # the written pages kept, the 48 MiB never written still unallocated
    assert heap._resident(buf.ctypes.data - buf.ctypes.data % heap.PAGE + heap.PAGE, 4 * heap.PAGE).all()


def test_zero_writes_what_is_not_numpys_own_whole_pages():
    small = np.full(1000, 3.0, np.float32)
    heap.zero(small)  # under a page: written
    strided = np.ones((4, 6), np.float32)
    heap.zero(strided[:, :2])  # not contiguous: written
    assert not small.any() and not strided[:, :2].any() and strided[:, 2:].all()
    other = np.frombuffer(bytearray(b"\x01" * (8 * heap.PAGE)), np.uint8)  # another object's memory
    heap.zero(other)
    assert not other.any()
    for array in (np.full(1000, 3.0, np.float32), np.ones((4, 6), np.float32)[:, :2],
                  np.frombuffer(bytearray(b"\x01" * (8 * heap.PAGE)), np.uint8)):
        heap.clear(array)
        assert not array.any()
