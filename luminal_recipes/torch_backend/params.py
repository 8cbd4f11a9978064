"""Tensors across the boundary: torch -> numpy for inputs and weights (no copy where the layout and dtype allow),
numpy -> torch for outputs. Weights are the module's own parameters and buffers, bound once per executable;
``WeightBinding.stale`` notices a parameter replaced by another tensor (``load_state_dict`` with ``assign``), so
the next call re-binds instead of computing with the old values."""

from __future__ import annotations

import math
import operator
import sys

import numpy as np
import torch

from ..errors import InputError
from ..graph import DType

_INT32 = np.iinfo(np.int32)
_DATA_PTR = torch.Tensor.data_ptr
_FEW = 64


def to_numpy(t: torch.Tensor, dtype: DType, what: str) -> np.ndarray:
    """``t`` as an array of ``dtype``: a view of the tensor's memory when it is contiguous and already of that
    dtype (f32, i32, u8, bool; bf16 by reinterpreting its bits), else one converted copy."""
    if t.requires_grad:  # (``detach`` otherwise: one more torch op in a call's cold Python)
        t = t.detach()
    if not t.is_cpu:
        raise InputError(f"{what} is on {t.device}; the luminal torch backend takes CPU tensors (its runtimes "
                         f"upload them): move the model and inputs to the CPU")
    if t.dtype == torch.int64:
        shape = tuple(t.shape)
        if math.prod(shape) <= _FEW:
            # a decode step's ids or positions, as Python ints: checked with Python's min and max (less than torch
            # ops), converted by numpy from the list (in a call's cold Python, two such inputs cost 37 us a decode
            # step, 83 through ``numpy()`` and numpy's cast)
            values = t.tolist()
            flat = _flat(values)
            if flat and (max(flat) > _INT32.max or min(flat) < _INT32.min):
                raise InputError(f"{what} holds int64 values beyond the int32 range the graph computes in")
            return np.array(values, np.int32) if flat else np.zeros(shape, np.int32)
        if int(t.max()) > _INT32.max or int(t.min()) < _INT32.min:
            raise InputError(f"{what} holds int64 values beyond the int32 range the graph computes in")
        return t.contiguous().numpy().astype(np.int32)
    if t.dtype == torch.bfloat16:
        array = t.contiguous().view(torch.int16).numpy().view(DType.BF16.np)  # (ml_dtypes imported now)
    else:
        array = t.contiguous().numpy()
    return array if array.dtype == dtype.np else array.astype(dtype.np)


def _flat(values) -> list:
    """``Tensor.tolist()``'s nested lists (or a 0-dim tensor's number) as one flat list."""
    if not isinstance(values, list):
        return [values]
    while values and isinstance(values[0], list):
        values = [v for row in values for v in row]
    return values


def to_torch(array: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    array = np.asarray(array)
    # ml_dtypes is imported only where a bf16 tensor was seen (its import: ~0.55 s of CPU, in every cold start of
    # a float32 model before): without it there is no bf16 array
    if "ml_dtypes" in sys.modules and array.dtype == DType.BF16.np:
        array = array.astype(np.float32)
    out = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return out.reshape(tuple(int(d) for d in shape)) if tuple(out.shape) != tuple(int(d) for d in shape) else out


class WeightBinding:
    """The weight placeholders' tensors of the call that loaded the executable, by graph name."""

    def __init__(self, names: dict[int, str], dtypes: dict[str, DType]):
        self.names = names  # placeholder position -> weight name
        self.dtypes = dtypes
        self.tensors: dict[str, torch.Tensor] = {}
        self._ptrs: tuple = ()
        # the weights of a call's arguments as one tuple (hundreds, checked every call: one C-level pass)
        at = tuple(names)
        self._take = operator.itemgetter(*at) if len(at) > 1 else lambda args: tuple(args[i] for i in at)

    def _data_ptrs(self, args) -> tuple:
        return tuple(map(_DATA_PTR, self._take(args)))

    def stale(self, args) -> bool:
        return self._data_ptrs(args) != self._ptrs

    def bind(self, args) -> None:
        self.tensors = {name: args[i] for i, name in self.names.items()}
        self._ptrs = self._data_ptrs(args)

    def load(self, name: str) -> np.ndarray:
        return to_numpy(self.tensors[name], self.dtypes[name], f"parameter {name}")
