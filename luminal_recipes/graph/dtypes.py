"""Element types of the graph, mapped onto numpy dtypes through ``ml_dtypes``.

``ml_dtypes`` is imported the first time a bf16/fp8/fp4 dtype is asked for (``DType.np``), not with this
module: its extension's start-up alone keeps ~8 MiB resident (84k Python objects, measured), which a model that
never holds such a dtype (a GGUF language model: f32, f16, u8, i32) need not pay. An array of an ml_dtypes type
exists only once ml_dtypes is imported, so ``is_float_storage`` and ``to_dtype`` need not import it to answer.

``f4e2m1`` is a sub-byte type: in memory two codes share one byte, so its byte size is half its element count.
Checkpoints store packed FP4 as ``u8`` (see ``ops.quant``); the graph decodes the nibbles with primitive ops.
``f64`` is PyTorch's float64 through the torch backend: element-wise ops compute it in f64 on the numpy runtime
(the expression language's f64 typing) and the reference interpreter; other kernels compute floats in f32, and
the CUDA backends have no f64 (docs/torch.md: which ops translate float64).
"""

from __future__ import annotations

import enum
import sys

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
        found = _NUMPY.get(self)
        return found if found is not None else _ml_dtypes()[self]

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


# numpy's own dtypes; the ml_dtypes ones join on first use (``_ml_dtypes``)
_NUMPY = {
    DType.F32: np.dtype(np.float32),
    DType.F64: np.dtype(np.float64),
    DType.F16: np.dtype(np.float16),
    DType.I32: np.dtype(np.int32),
    DType.U8: np.dtype(np.uint8),
    DType.BOOL: np.dtype(np.bool_),
}
_ML_NAMES = {DType.BF16: "bfloat16", DType.F8E4M3: "float8_e4m3fn", DType.F8E5M2: "float8_e5m2",
             DType.F4E2M1: "float4_e2m1fn"}
_ML: dict[DType, np.dtype] = {}


def _ml_dtypes() -> dict[DType, np.dtype]:
    """The graph dtypes numpy has not, as ml_dtypes' numpy dtypes (ml_dtypes imported now, once)."""
    if not _ML:
        import ml_dtypes

        _ML.update({d: np.dtype(getattr(ml_dtypes, name)) for d, name in _ML_NAMES.items()})
    return _ML


def is_float_storage(dtype: np.dtype) -> bool:
    """Whether numpy ``dtype`` holds one of the graph's float types (most of ml_dtypes' floats have numpy kind
    "V");
    does not import ml_dtypes (an array of its types means it is imported)."""
    if dtype.kind == "f":
        return True
    return "ml_dtypes" in sys.modules and dtype in _ml_dtypes().values()
_BITS = {
    DType.F32: 32, DType.F64: 64, DType.F16: 16, DType.BF16: 16, DType.F8E4M3: 8, DType.F8E5M2: 8, DType.F4E2M1: 4,
    DType.I32: 32, DType.U8: 8, DType.BOOL: 8,
}
_FLOATS = {DType.F32, DType.F64, DType.F16, DType.BF16, DType.F8E4M3, DType.F8E5M2, DType.F4E2M1}

# The 16 values of the E2M1 (FP4) codes 0..15, as ml_dtypes decodes them: bit 3 = sign, bits 2-1 = exponent
# (bias 1), bit 0 = mantissa; no inf/nan. The one table every part of the project uses (NVFP4 decoding); written
# from the bits so that ml_dtypes is not imported for it (tests/graph/test_dtypes_lazy.py: equal to ml_dtypes').
_E2M1_CODES = np.arange(16)
_E2M1_EXP, _E2M1_MAN = (_E2M1_CODES >> 1) & 3, _E2M1_CODES & 1
E2M1_VALUES = (np.where(_E2M1_CODES & 8, -1.0, 1.0) * np.where(
    _E2M1_EXP == 0, 0.5 * _E2M1_MAN, 2.0 ** (_E2M1_EXP - 1) * (1 + 0.5 * _E2M1_MAN))).astype(np.float32)
E2M1_VALUES.flags.writeable = False

# The 256 values of the E4M3 (``float8_e4m3fn``) bytes, as ml_dtypes decodes them: bit 7 = sign, bits 6-3 =
# exponent (bias 7; 0: subnormal), bits 2-0 = mantissa; no inf, nan at 0x7f and 0xff. From the bits, so that the
# CPU runtime's start-up check of the NVFP4 product (``amx/dequant.py``) imports no ml_dtypes (its import: ~0.55 s
# of CPU in every process on a CPU with AMX). tests/graph/test_dtypes_lazy.py: equal to ml_dtypes'.
_E4M3_CODES = np.arange(256)
_E4M3_EXP, _E4M3_MAN = (_E4M3_CODES >> 3) & 15, _E4M3_CODES & 7
E4M3_VALUES = np.copysign(np.where(
    (_E4M3_EXP == 15) & (_E4M3_MAN == 7), np.nan,
    np.where(_E4M3_EXP == 0, 2.0 ** -6 * _E4M3_MAN / 8, 2.0 ** (_E4M3_EXP - 7) * (1 + _E4M3_MAN / 8))),
    np.where(_E4M3_CODES & 128, -1.0, 1.0)).astype(np.float32)
E4M3_VALUES.flags.writeable = False

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
    if "ml_dtypes" in sys.modules:  # an ml_dtypes type (not imported: npd is none of them)
        for d, n in _ml_dtypes().items():
            if n == npd:
                return d
    raise DTypeError(f"numpy dtype {npd} has no graph dtype; convert the array to one of "
                     + ", ".join(str(d.np) for d in DType))
