"""Whether an output holds NaN or infinity, found in one cheap pass: a pipeline stage's outputs and a language
model's logits are checked with it before anything is written or sampled from them (``--allow-nonfinite``
skips the check)."""

from __future__ import annotations

from typing import Any

import numpy as np


def nonfinite_counts(value: Any) -> tuple[int, int] | None:
    """``(NaN count, infinity count)`` when the floating-point array ``value`` holds any, else None (also for
    anything that is not a floating-point array). One float64 sum decides (any NaN or infinity poisons it, and
    values of at most 32 bits cannot overflow it): no copy, microseconds for a logits row; the counts are taken
    only when something is wrong."""
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.size == 0:
        return None
    if value.dtype.itemsize < 8:
        if np.isfinite(np.sum(value, dtype=np.float64)):
            return None
    elif np.isfinite(value).all():
        return None
    return int(np.isnan(value).sum()), int(np.isinf(value).sum())
