"""``heap.zero``: an array set to zeros by handing its whole pages back, so that pages it never wrote stay
unallocated and written ones are freed (a KV cache planned for a long reply costs the rows a reply writes). The
resident set is read from /proc (Linux); the buffer is 64 MiB so that the page counts are far above the noise."""

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


def test_zero_writes_what_is_not_numpys_own_whole_pages():
    small = np.full(1000, 3.0, np.float32)
    heap.zero(small)  # under a page: written
    strided = np.ones((4, 6), np.float32)
    heap.zero(strided[:, :2])  # not contiguous: written
    assert not small.any() and not strided[:, :2].any() and strided[:, 2:].all()
    other = np.frombuffer(bytearray(b"\x01" * (8 * heap.PAGE)), np.uint8)  # another object's memory
    heap.zero(other)
    assert not other.any()
