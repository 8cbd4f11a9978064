"""Element types of the graph, mapped onto numpy dtypes through ``ml_dtypes``.

``f4e2m1`` is a sub-byte type: in memory two codes share one byte, so its byte size is half its element count.
Checkpoints store packed FP4 as ``u8`` (see ``ops.quant``); the graph decodes the nibbles with primitive ops.
``f64`` is PyTorch's float64 through the torch backend: element-wise ops compute it in f64 on the numpy runtime
(the expression language's f64 typing) and the reference interpreter; other kernels compute floats in f32, and
the CUDA backends have no f64 (docs/torch.md: which ops translate float64).
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

from ..errors import DTypeError


class DType(enum.Enum):
    F32 = "f32"
    F64 = "f64"
    F16 = "f16"
    BF16 = "bf16"
    F8E4M3 = "f8e4m3"
    F8E5M2 = "f8e5m2"
    F4E2M1 = "f4e2m1"
    I32 = "i32"
    U8 = "u8"
    BOOL = "bool"

    @property
    def np(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in (DType.I32, DType.U8)

    def nbytes(self, numel: int) -> int:
        """Bytes that ``numel`` elements occupy when packed (sub-byte types round up)."""
        return (numel * self.bits + 7) // 8

    def __str__(self) -> str:
        return self.value


_NUMPY = {
    DType.F32: np.dtype(np.float32),
    DType.F64: np.dtype(np.float64),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F8E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.F8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DType.F4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
    DType.I32: np.dtype(np.int32),
    DType.U8: np.dtype(np.uint8),
    DType.BOOL: np.dtype(np.bool_),
}
_BITS = {
    DType.F32: 32, DType.F64: 64, DType.F16: 16, DType.BF16: 16, DType.F8E4M3: 8, DType.F8E5M2: 8, DType.F4E2M1: 4,
    DType.I32: 32, DType.U8: 8, DType.BOOL: 8,
}
_FLOATS = {DType.F32, DType.F64, DType.F16, DType.BF16, DType.F8E4M3, DType.F8E5M2, DType.F4E2M1}

# The 16 values of the E2M1 (FP4) codes 0..15, as ml_dtypes decodes them: bit 3 = sign, bits 2-1 = exponent
# (bias 1), bit 0 = mantissa; no inf/nan. The one table every part of the project uses (NVFP4 decoding).
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
E2M1_VALUES.flags.writeable = False

# safetensors dtype names -> graph dtypes (the checkpoint loader's vocabulary)
SAFETENSORS_NAMES = {
    "F32": DType.F32, "F16": DType.F16, "BF16": DType.BF16, "F8_E4M3": DType.F8E4M3, "F8_E5M2": DType.F8E5M2,
    "I32": DType.I32, "U8": DType.U8, "BOOL": DType.BOOL,
}

_ALIASES = {
    "float32": DType.F32, "float": DType.F32, "float64": DType.F64, "double": DType.F64,
    "float16": DType.F16, "half": DType.F16, "bfloat16": DType.BF16,
    "int32": DType.I32, "int": DType.I32, "uint8": DType.U8, "float8_e4m3fn": DType.F8E4M3,
    "float8_e5m2": DType.F8E5M2, "float4_e2m1fn": DType.F4E2M1,
}


def to_dtype(x: DType | str | np.dtype) -> DType:
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        key = x.strip()
        for d in DType:
            if d.value == key.lower():
                return d
        if key in SAFETENSORS_NAMES:
            return SAFETENSORS_NAMES[key]
        if key.lower() in _ALIASES:
            return _ALIASES[key.lower()]
        names = ", ".join(d.value for d in DType)
        raise DTypeError(f"unknown dtype '{x}'; use one of {names}")
    npd = np.dtype(x)
    for d, n in _NUMPY.items():
        if n == npd:
            return d
    raise DTypeError(f"numpy dtype {npd} has no graph dtype; convert the array to one of "
                     + ", ".join(str(n) for n in _NUMPY.values()))
