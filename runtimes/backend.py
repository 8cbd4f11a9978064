"""What a device supplies to run Programs: the ``Backend`` protocol (see ``docs/ARCHITECTURE.md``).

A backend owns memory and kernels, nothing else: one generic ``executable.Executable`` does the arena offsets,
input/weight/state binding, block weight streaming, device-resident benchmark runs, graph replay and timing for
every backend. ``Array`` is the backend's flat typed array (``numpy.ndarray`` for numpy and cuda-emu; for cuda a
``cuda.device.DeviceTensor``: CuPy memory plus the declared dtype, since CuPy has no bf16/fp8).

Besides memory and kernels, a device backend may overlap weight uploads with compute: ``copy_stream()`` returns a
``CopyStream`` (a second queue of host -> device copies ordered against the compute queue by events), and weight
streaming then stages blocks through pinned host buffers on it. A host backend (numpy) returns None and streaming
copies straight into its slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .kernels import Bind, Machine, Prepare, Step

Array = Any
Event = Any  # a CopyStream's marker in one of its queues


class GraphCaptureError(RuntimeError):
    """These steps cannot be recorded as one device graph (the executable runs them one by one instead)."""


@runtime_checkable
class CopyStream(Protocol):
    """Host -> device copies on their own queue, ordered against the compute queue by events."""

    def staging(self, nbytes: int) -> np.ndarray:
        """A host buffer copies are made from (page-locked on a GPU, so a copy runs without the CPU)."""
        ...

    def record(self) -> Event:
        """An event that completes when the work issued to the compute queue so far has finished."""
        ...

    def upload(self, dst: Array, src: np.ndarray, after: Event | None = None) -> Event:
        """Copy ``src`` (a staging buffer's bytes) into the device slot ``dst`` (uint8, same size) on the copy
        queue, once ``after`` has completed; returns the event of the copy's completion. ``src`` must stay
        untouched until then."""
        ...

    def wait(self, event: Event) -> None:
        """Work issued to the compute queue from now on starts after ``event`` (the host does not block)."""
        ...

    def host_wait(self, event: Event) -> None:
        """Block the host until ``event`` has completed."""
        ...

    def close(self) -> None:
        """Wait for every copy, then release the staging buffers."""
        ...


@runtime_checkable
class Backend(Protocol):
    name: str  # "numpy", "cuda", "cuda-emu": the runtime's name
    device: str  # e.g. "cpu", "NVIDIA H200 (sm_90)"
    machine: Machine  # cost-model constants of this device
    kernels: Mapping[str, Prepare]  # kernel name -> prepare(ctx) -> bind (runtimes.kernels.context)
    host_arrays: bool  # arrays are numpy arrays in host memory: outputs can be handed out as views
    timed: bool  # the compiler may time candidates here (False for an emulator: its times say nothing)
    graphs: bool  # ``capture`` records device graphs (CUDA); False: steps always run one by one

    def capacity(self) -> int:
        """The default memory budget in bytes: host RAM (numpy), device memory (a GPU)."""
        ...

    def allocate(self, nbytes: int) -> Array:
        """One flat uint8 buffer (the activation arena, a state buffer, a streaming slot), zero-filled."""
        ...

    def slot(self, buf: Array, offset: int, nbytes: int, dtype: np.dtype) -> Array:
        """A typed flat view of ``nbytes`` bytes of ``buf`` at byte ``offset``."""
        ...

    def upload(self, host: np.ndarray) -> Array:
        """A weight or constant as a flat device array (numpy: the caller's array, no copy; a GPU: an array
        already in its memory is bound as it is)."""
        ...

    def copy_in(self, dst: Array, src: np.ndarray) -> None:
        """Host -> device: ``src``'s elements, in C order, into the flat slot ``dst`` (same dtype and size)."""
        ...

    def copy(self, dst: Array, src: Array) -> None:
        """Device -> device, flat arrays of the same dtype and size."""
        ...

    def download(self, src: Array) -> np.ndarray:
        """Device -> host (flat); a host backend returns the array itself."""
        ...

    def synchronize(self) -> None:
        """Wait until every kernel launched so far has finished (a no-op on a synchronous backend)."""
        ...

    def build(self, binds: Mapping[int, Bind]) -> None:
        """Called with every node's prepared kernel (node id -> bind) before any is bound: a backend that compiles
        a program as a whole (CUDA: one module of every node's CUDA C) does it here; numpy has nothing to do."""
        ...

    def copy_stream(self) -> CopyStream | None:
        """A queue of host -> device copies that overlaps compute, or None (a host backend)."""
        ...

    def capture(self, steps: Sequence[Step]) -> Step | None:
        """One step replaying ``steps`` as a device graph (recorded, not run), or None when this backend has no
        graphs; raises ``GraphCaptureError`` saying why these steps cannot be recorded."""
        ...

    def memory_held(self) -> int | None:
        """Bytes this backend holds on its device (allocations and its allocator's cache), None if unknown."""
        ...

    def release_memory(self) -> None:
        """Return what the allocator caches to the device (called when a stage ends)."""
        ...
