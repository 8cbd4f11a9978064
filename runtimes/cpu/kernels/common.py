"""What every CPU kernel module shares: the f32 dtype, binding operands, running their scratch copies."""

from __future__ import annotations

import numpy as np

from luminal_recipes.graph.dtypes import is_float_storage

from ...kernels.context import Step
from .operands import Operand

F32 = np.dtype(np.float32)
F32_MIN = np.float32(np.finfo(np.float32).min)


def is_float(dtype: np.dtype) -> bool:
    return is_float_storage(dtype)  # ml_dtypes' floats have numpy kind "V"


def with_refresh(operands: list[Operand], body: Step) -> Step:
    """Run the operands' scratch copies (if any) before the body."""
    refreshes = [op.refresh for op in operands if op is not None and op.refresh is not None]
    if not refreshes:
        return body

    def step() -> None:
        for r in refreshes:
            r()
        body()

    if getattr(body, "chain", None) is not None:  # described for the chains (``jit/chain.py``) where all parts are
        from ..jit.chain import combine

        return combine(step, *refreshes, body)
    return step


def view_reshape(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``arr`` at ``shape`` as a view, or ``None`` where numpy would have to copy (a copy made at bind time
    would go stale: the hot loop must read the live buffer)."""
    try:
        return np.reshape(arr, shape, copy=False)
    except ValueError:
        return None


def bind_all(operands: list[Operand | None], flats: list, scratch: list) -> list:
    return [None if op is None else op.bind(flats[i], scratch) for i, op in enumerate(operands)]
