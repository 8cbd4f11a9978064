"""``views.alias`` is numpy's ``as_strided`` without the holder object as_strided leaves as each view's base (a
``DummyArray`` and its ``__array_interface__``: objects the garbage collector tracks, kept as long as a bound step
keeps the view): the same elements, at the same addresses, writeable or not as asked, for float, bf16, reversed
and broadcast views of a slot of an arena and of arrays that view it without being contiguous."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from luminal_recipes.runtimes.views import alias

as_strided = np.lib.stride_tricks.as_strided


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _arena_slot(dtype, n: int, at: int = 64) -> np.ndarray:
    arena = np.arange(4096, dtype=np.uint8)  # every byte distinct enough to tell views apart
    return arena[at: at + n * np.dtype(dtype).itemsize].view(dtype)


CASES = [  # (source from the slot, shape, strides in elements)
    (lambda s: s, (4, 6), (6, 1)),
    (lambda s: s[3:], (5, 2), (1, 7)),  # transposed
    (lambda s: s[40:], (4, 3), (-6, 1)),  # reversed rows, reaching before the source's first element
    (lambda s: s[5:], (3, 4), (0, 2)),  # broadcast along the first axis
    (lambda s: s.reshape(8, 8)[:, :4], (20,), (1,)),  # a strided source: its flat span
    (lambda s: s.reshape(8, 8).T[2:], (3, 5), (8, 1)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.int32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("writeable", [False, True])
def test_alias_is_as_strided_without_its_holder(dtype, case, writeable):
    make, shape, strides = CASES[case]
    src = make(_arena_slot(dtype, 64))
    item = np.dtype(dtype).itemsize
    byte_strides = tuple(s * item for s in strides)
    got = alias(src, shape, byte_strides, writeable=writeable)
    want = as_strided(src, shape, byte_strides, writeable=writeable)
    assert got.dtype == want.dtype and got.shape == want.shape and got.strides == want.strides
    assert _address(got) == _address(want)
    assert np.array_equal(got.view(f"u{item}"), want.view(f"u{item}"))
    assert got.flags.writeable == want.flags.writeable
    base = got
    while isinstance(base, np.ndarray):
        base = base.base
    assert base is None  # a chain of arrays down to the arena: no DummyArray


def test_alias_writes_land_in_the_source():
    slot = _arena_slot(np.float32, 16)
    view = alias(slot[2:], (3,), (8,), writeable=True)
    view[:] = [1.5, 2.5, 3.5]
    assert slot[2] == 1.5 and slot[4] == 2.5 and slot[6] == 3.5


def test_alias_of_a_read_only_source_stays_read_only():
    slot = _arena_slot(np.float32, 16)
    slot.flags.writeable = False
    assert not alias(slot, (4,), (4,), writeable=True).flags.writeable
    assert not as_strided(slot, (4,), (4,), writeable=True).flags.writeable  # (as numpy's)
