"""What a backend's kernel is given when it is prepared for one Program node (``Backend.kernels[name](ctx)``).

``prepare(ctx) -> bind`` runs once per node: it reads the node, its output shape and storage dtype, each input's
bound view (concrete shape/strides/offset/mask), storage dtype and element count, and asks for typed scratch
arrays (``ctx.scratch.add``), which the memory planner places in the arena. ``bind(out, flats, scratch) -> step``
then receives backend arrays - the output's typed flat array reshaped to the output shape, each input's flat
buffer, the scratch arrays - and returns the zero-argument ``step`` the hot loop calls. Nothing allocates in a
step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from luminal_recipes.graph.core import Node
from luminal_recipes.graph.view import BoundView

ALIGNMENT = 64  # bytes; every arena buffer and scratch array starts on a cache line

Step = Callable[[], None]
Bind = Callable[[Any, list, list], Step]  # (out, input flats, scratch arrays) -> step
Prepare = Callable[["KernelContext"], Bind]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class Scratch:
    """The scratch arrays one kernel asks for, in order; the memory planner places them in the arena, one after
    another (each aligned), and the executable hands them to ``bind`` in the same order."""

    def __init__(self) -> None:
        self.specs: list[tuple[tuple[int, ...], np.dtype]] = []

    def add(self, shape, dtype) -> int:
        self.specs.append((tuple(int(d) for d in shape), np.dtype(dtype)))
        return len(self.specs) - 1

    @property
    def nbytes(self) -> int:
        return sum(aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in self.specs)

    def layout(self) -> list[tuple[int, int, tuple[int, ...], np.dtype]]:
        """``(byte offset in the kernel's scratch region, nbytes, shape, dtype)`` of every array."""
        out, at = [], 0
        for shape, dtype in self.specs:
            n = math.prod(shape) * dtype.itemsize
            out.append((at, n, shape, dtype))
            at += aligned(n)
        return out


@dataclass
class KernelInput:
    view: BoundView  # how the edge reads the producer's buffer
    dtype: np.dtype  # the producer's storage dtype
    size: int  # elements in the producer's buffer


@dataclass
class KernelContext:
    node: Node
    shape: tuple[int, ...]  # the output's shape
    dtype: np.dtype  # the output's storage dtype
    inputs: list[KernelInput]
    scratch: Scratch

    def fail(self, why: str) -> NoReturn:
        raise ValueError(f"{self.node.op} #{self.node.id}: {why} (malformed program)")
