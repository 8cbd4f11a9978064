"""Weights already in device memory, given to the cuda runtime without a host round trip.

CuPy has no bfloat16 or fp8 dtype, so a device array cannot say "bf16" itself: ``DeviceTensor`` pairs the raw
device array (any dtype of the same item size, e.g. CuPy int16 for bf16 bits) with the dtype the program
declares. The cuda backend binds its memory as it is (no copy); ``check_array`` sees the declared shape and
dtype. It is also the cuda backend's array type: every slot of the arena, weight and state is one (``twin`` gives
the CuPy dtype that holds a numpy dtype's bits). ``from_torch`` shares a torch CUDA tensor's memory through
DLPack, so torch and our runtime can run the same weights (bench/gpu_check.py compares against diffusers that
way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luminal_recipes.graph.dtypes import to_dtype


@dataclass(frozen=True)
class DeviceTensor:
    data: object  # a CuPy array (the raw bits)
    dtype: np.dtype  # the element type it holds (ml_dtypes' bfloat16 for bf16)

    def __post_init__(self):
        if np.dtype(self.data.dtype).itemsize != np.dtype(self.dtype).itemsize:
            raise ValueError(f"a {self.data.dtype} device array cannot hold {np.dtype(self.dtype)} elements "
                             "(item sizes differ)")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def ptr(self) -> int:
        """The device address of the first element."""
        return int(self.data.data.ptr)

    def reshape(self, *shape) -> DeviceTensor:
        return DeviceTensor(self.data.reshape(*shape), self.dtype)

    def __getitem__(self, index) -> DeviceTensor:
        return DeviceTensor(self.data[index], self.dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.data.__cuda_array_interface__


def twin(dtype) -> np.dtype:
    """The dtype a CuPy array holds ``dtype``'s elements in: itself when CuPy has it, else the unsigned integer
    of the same size (bf16, fp8, fp4 codes)."""
    dtype = np.dtype(dtype)
    if dtype.isbuiltin == 1 and dtype.kind in "biuf":
        return dtype
    return np.dtype(f"u{dtype.itemsize}")


_TORCH_TWINS = {"bfloat16": ("int16", "bf16"), "float8_e4m3fn": ("uint8", "f8e4m3"),
                "float8_e5m2": ("uint8", "f8e5m2")}


def from_torch(tensor) -> DeviceTensor:
    """A torch CUDA tensor as a ``DeviceTensor`` sharing its memory (contiguous tensors only)."""
    import cupy
    import torch

    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("from_torch needs a contiguous CUDA tensor")
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _TORCH_TWINS:
        twin, ours = _TORCH_TWINS[name]
        raw = cupy.from_dlpack(tensor.view(getattr(torch, twin)))
        return DeviceTensor(raw, to_dtype(ours).np)
    raw = cupy.from_dlpack(tensor)
    return DeviceTensor(raw, np.dtype(raw.dtype))
