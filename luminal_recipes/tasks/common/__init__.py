"""Steps any pipeline may use: small array helpers with no model behind them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luminal_recipes.errors import PipelineError
from luminal_recipes.pipeline.plugins import StepContext


def full(ctx: StepContext, value: float, n: int = 1) -> dict:
    """A float32 vector of ``n`` copies of ``value`` (per-batch scalars such as the timestep or guidance)."""
    return {"value": np.full((int(n),), float(value), dtype=np.float32)}


def concat(ctx: StepContext, values: list, axis: int = 0) -> dict:
    """The arrays ``values`` joined along ``axis`` (e.g. a prompt's and the negative prompt's embeddings into one
    batch of 2, so a model runs both in one call)."""
    arrays = [np.asarray(v) for v in values]
    if not arrays:
        raise PipelineError("concat: no values to join")
    shapes = {a.shape[:axis] + a.shape[axis + 1:] for a in arrays} if all(a.ndim > axis for a in arrays) else None
    if shapes is None or len(shapes) != 1:
        raise PipelineError(f"concat: cannot join shapes {[a.shape for a in arrays]} along axis {axis}")
    return {"value": np.concatenate(arrays, axis=axis)}


def classifier_free_guidance(ctx: StepContext, cond: np.ndarray, scale: float, uncond: np.ndarray | None = None
                             ) -> dict:
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)``, in float32 and in that order, as diffusers'
    pipelines combine the two predictions (Flux2KleinPipeline: ``neg_noise_pred + guidance_scale * (noise_pred -
    neg_noise_pred)``). Without ``uncond``, ``cond`` holds both on its first axis, conditional first (one model
    call of batch 2 on [prompt; negative prompt])."""
    cond = np.asarray(cond, dtype=np.float32)
    if uncond is None:
        if cond.ndim == 0 or cond.shape[0] % 2:
            raise PipelineError(f"classifier_free_guidance: without `uncond`, `cond` must stack the conditional and "
                                f"unconditional predictions on its first axis (an even size); got {cond.shape}")
        cond, uncond = np.split(cond, 2, axis=0)
    uncond = np.asarray(uncond, dtype=np.float32)
    if cond.shape != uncond.shape:
        raise PipelineError(f"classifier_free_guidance: `cond` {cond.shape} and `uncond` {uncond.shape} differ")
    return {"value": uncond + np.float32(scale) * (cond - uncond)}


STEPS: dict[str, Callable] = {"full": full, "concat": concat, "classifier_free_guidance": classifier_free_guidance}
