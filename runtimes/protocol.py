"""The Runtime protocol: what the compiler and the pipeline may ask of any runtime (``executable.BackendRuntime``
over a numpy, CUDA... ``Backend``).

A runtime says which kernels it has (``capabilities``) and how much memory its device has (``capacity``: the
default budget), plans a program's memory (``plan``), loads a program
with its weights and dims into an ``Executable`` (binding weights, planning memory, preallocating every
buffer), and times a program for the compiler's search (``time``: median of ``repeats`` runs after one warm-up
run).
"""

from __future__ import annotations

import statistics
import time as _time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from luminal_recipes.errors import LuminalError

from .memory import MemoryPlan
from .program import Program


class UnsupportedKernelError(LuminalError):
    """A program uses kernels the runtime does not implement (e.g. a plan compiled for another runtime)."""


@dataclass
class MemoryReport:
    """Byte-accurate accounting of a loaded program.

    ``weight_bytes``: packed size of the bound weights (what a budget counts; f4e2m1 is half a byte an
    element); ``weight_array_bytes``: bytes of the numpy arrays bound for them (memory-mapped arrays are paged
    in on use); ``constant_bytes``: program constants; ``arena_bytes``: the one preallocated activation arena;
    ``planned_peak``: weights + constants + arena; ``live_peak``: the most bytes held by live activation
    arrays and kernel scratch at one step, summed over the arrays actually bound (the arena must hold at least
    this); ``transient_peak``: after ``run(..., trace=True)``, the peak of allocations made outside the arena.
    """

    weight_bytes: int
    weight_array_bytes: int
    constant_bytes: int
    arena_bytes: int
    planned_peak: int
    live_peak: int | None = None
    transient_peak: int | None = None
    state_bytes: int = 0  # state buffers (kept across runs), included in planned_peak


@runtime_checkable
class Executable(Protocol):
    program: Program
    dims: dict[str, int]
    plan: MemoryPlan

    @property
    def memory(self) -> MemoryReport: ...

    def run(self, inputs: Mapping[str, np.ndarray] | None = None, copy_outputs: bool = True
            ) -> dict[str, np.ndarray]: ...


@runtime_checkable
class Runtime(Protocol):
    name: str
    device: str

    def capabilities(self) -> set[str]: ...

    def capacity(self) -> int: ...  # the default memory budget: this runtime's device memory

    def plan(self, program: Program, dims: Mapping[str, int] | None = None,
             weight_bytes: int | None = None) -> MemoryPlan: ...

    def load(self, program: Program, weights=None, dims: Mapping[str, int] | None = None) -> Executable: ...

    def time(self, program: Program, inputs: Mapping[str, np.ndarray] | None = None, weights=None,
             dims: Mapping[str, int] | None = None, repeats: int = 3) -> float: ...

    def run(self, program: Program, inputs: Mapping[str, np.ndarray] | None = None, weights=None,
            dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]: ...


class RuntimeBase:
    """Shared behaviour: capability check, timing and one-shot runs in terms of ``load``."""

    name = "base"
    device = "none"

    def capabilities(self) -> set[str]:
        raise NotImplementedError

    def load(self, program: Program, weights=None, dims=None) -> Executable:
        raise NotImplementedError

    def check_capabilities(self, program: Program) -> None:
        have = self.capabilities()
        missing = sorted({n.op for n in program.nodes} - have)
        if missing:
            raise UnsupportedKernelError(
                f"the {self.name} runtime ({self.device}) has no kernel for {', '.join(missing)}; its "
                f"kernels are {', '.join(sorted(have))}. Compile the graph for this runtime (its "
                f"capabilities) instead of reusing a plan made for another one"
            )

    def time(self, program: Program, inputs=None, weights=None, dims=None, repeats: int = 3) -> float:
        """Seconds per run: median of ``repeats`` timed runs after one warm-up run (loading is not timed)."""
        exe = self.load(program, weights, dims)
        return time_executable(exe, inputs, repeats)

    def run(self, program: Program, inputs=None, weights=None, dims=None) -> dict[str, np.ndarray]:
        return self.load(program, weights, dims).run(inputs)


def time_executable(exe: Executable, inputs=None, repeats: int = 3) -> float:
    """Median seconds of ``exe.run`` after one warm-up run (outputs are not copied out)."""
    exe.run(inputs, copy_outputs=False)
    times = []
    for _ in range(max(1, repeats)):
        t0 = _time.perf_counter()
        exe.run(inputs, copy_outputs=False)
        times.append(_time.perf_counter() - t0)
    return statistics.median(times)
