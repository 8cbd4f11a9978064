"""What a device supplies to run Programs: the ``Backend`` protocol (see /work's BACKEND_CONTRACT and
``docs/ARCHITECTURE.md``).

A backend owns memory and kernels, nothing else: one generic ``executable.Executable`` does the arena offsets,
input/weight/state binding, block weight streaming and timing for every backend. ``Array`` is the backend's flat
typed array (``numpy.ndarray`` for numpy and cuda-emu, ``cupy.ndarray`` for cuda).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .kernels import Machine, Prepare

Array = Any


@runtime_checkable
class Backend(Protocol):
    name: str  # "numpy", "cuda", "cuda-emu": the runtime's name
    device: str  # e.g. "cpu", "NVIDIA H200 (sm_90)"
    machine: Machine  # cost-model constants of this device
    kernels: Mapping[str, Prepare]  # kernel name -> prepare(ctx) -> bind (runtimes.kernels.context)
    host_arrays: bool  # arrays are numpy arrays in host memory: outputs can be handed out as views

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
        """A weight or constant as a flat device array (numpy: the caller's array, no copy)."""
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
