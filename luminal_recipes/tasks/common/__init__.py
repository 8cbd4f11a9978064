"""Steps any pipeline may use: small array helpers with no model behind them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luminal_recipes.pipeline.plugins import StepContext


def full(ctx: StepContext, value: float, n: int = 1) -> dict:
    """A float32 vector of ``n`` copies of ``value`` (per-batch scalars such as the timestep or guidance)."""
    return {"value": np.full((int(n),), float(value), dtype=np.float32)}


STEPS: dict[str, Callable] = {"full": full}
