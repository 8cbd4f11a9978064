"""Steps any pipeline may use: small array helpers with no model behind them, and images fitted to a model's grid."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from luminal_recipes.errors import PipelineError
from luminal_recipes.image_io import fit_image
from luminal_recipes.pipeline.plugins import StepContext


def full(ctx: StepContext, value: float, n: int = 1) -> dict:
    """A float32 vector of ``n`` copies of ``value`` (per-batch scalars such as the timestep or guidance)."""
    return {"value": np.full((int(n),), float(value), dtype=np.float32)}


def concat(ctx: StepContext, values: Sequence[np.ndarray], axis: int = 0) -> dict:
    """The arrays joined along ``axis`` (``torch.cat``): e.g. the noisy latents' tokens and the reference images'
    tokens, one sequence for the transformer, or a prompt's and the negative prompt's embeddings into one batch of
    2, so a model runs both in one call."""
    arrays = [np.asarray(v) for v in values]
    if not arrays:
        raise PipelineError("concat: no values to join")
    try:
        return {"value": np.concatenate(arrays, axis=int(axis))}
    except ValueError as exc:
        shapes = ", ".join(str(a.shape) for a in arrays)
        raise PipelineError(f"concat: cannot join arrays of shapes {shapes} along axis {axis} ({exc})") from None


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


def narrow(ctx: StepContext, value: np.ndarray, axis: int, start: int, stop: int) -> dict:
    """Entries ``start`` to ``stop`` (exclusive) of ``value`` along ``axis``, as a contiguous copy: e.g. the velocity
    of the noisy tokens only, as ``noise_pred[:, :latents.size(1)]``. The same arguments as ``narrow(x, axis,
    start, stop)`` in a forward (one meaning of ``narrow`` in the whole language; not ``torch.narrow``'s length)."""
    array = np.asarray(value)
    axis, start, stop = int(axis) % array.ndim, int(start), int(stop)
    if not 0 <= start <= stop <= array.shape[axis]:
        raise PipelineError(f"narrow: entries {start}..{stop} of axis {axis} do not lie in an array of "
                            f"shape {array.shape}")
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return {"value": np.ascontiguousarray(array[tuple(index)])}


# inputs a step once took, and how to write them now (check_steps_known reports them at their recipe line)
narrow.renamed_inputs = {
    "length": "the step `narrow` takes `stop` (exclusive), as narrow(x, axis, start, stop) does in a forward; it "
              "took `length` (torch.narrow's) before: write `stop: <start> + <length>` (e.g. `start: 0, stop: h * w`)"}


def fit_images(ctx: StepContext, images: Sequence[np.ndarray] | None, max_area: int, multiple: int) -> dict:
    """Each ``(H, W, 3)`` uint8 RGB image (an input ``run`` read, e.g. ``--image``) as a model's encoder takes it:
    ``(1, 3, h, w)`` float32 in [-1, 1], resized (Lanczos) to about ``max_area`` pixels when larger, both sides
    floored to a multiple of ``multiple`` and center-cropped, exactly as diffusers' ``Flux2ImageProcessor``
    prepares reference images (``image_io.fit_image``). ``images`` None (not given): an empty list."""
    return {"images": [fit_image(image, int(max_area), int(multiple)) for image in images or ()]}


STEPS: dict[str, Callable] = {"full": full, "concat": concat, "narrow": narrow, "fit_images": fit_images,
                              "classifier_free_guidance": classifier_free_guidance}
