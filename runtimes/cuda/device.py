"""Weights already in device memory, given to the cuda runtime without a host round trip.

CuPy has no bfloat16 or fp8 dtype, so a device array cannot say "bf16" itself: ``DeviceTensor`` pairs the raw
device array (any dtype of the same item size, e.g. CuPy int16 for bf16 bits) with the dtype the program
declares. The cuda backend binds its memory as it is (no copy); ``check_array`` sees the declared shape and
dtype. ``from_torch`` shares a torch CUDA tensor's memory through DLPack, so torch and our runtime can run the
same weights (bench/gpu_check.py compares against diffusers that way).
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
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.data.__cuda_array_interface__


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
