"""FLUX.2 text-to-image and editing (diffusers Flux2Pipeline) as a task plug-in: its host steps (``steps.py``), the
checks of the parameters and inputs they read (denoising steps, seed, image size, guidance, the prompt,
``--init-latents``, the reference images of ``--image``), the parameters the reference images decide
(``references.py``: the output size, the reference tokens), and what an image records about the run that made
it. The modules: ``tokenize.py`` (the prompt as diffusers tokenizes it), ``latents.py`` (noise, packing,
positions), ``scheduler.py`` (the flow-match Euler schedule)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from luminal_recipes.errors import PipelineError

from .latents import check_seed, check_side, load_init_latents
from .references import derive_from_references, read_references
from .scheduler import check_steps
from .steps import STEPS, check_tokenize, prepare
from .tokenize import check_prompt


def check_guidance(value: Any, given: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise PipelineError(f"{given}: the guidance scale must be a finite number, e.g. 4.0")


def read_prompt(prompt: Any, params: Mapping[str, Any]) -> str:
    check_prompt(prompt)
    return prompt


def read_init_latents(path: Path, params: Mapping[str, Any]):
    """``--init-latents FILE.npy``, checked against the image size the parameters give."""
    if "height" not in params or "width" not in params:
        raise PipelineError("--init-latents: the pipeline has no width/height parameters to check the latents' "
                            "shape against")
    return load_init_latents(path, int(params["height"]), int(params["width"]))


def describe(params: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, str]:
    """The settings an image records (PNG text chunks): the seed ("none" when it started from given latents),
    steps, sampler, guidance, size, the latents file and the reference images (a path each, "pixels" for an
    image given as an array in Python, ``image[k]`` for the k-th image uploaded to `serve`)."""
    text = {}
    init = given.get("init_latents")
    if "seed" in params:
        text["seed"] = "none" if init is not None else str(params["seed"])
    if "steps" in params:
        text["steps"] = str(params["steps"])
        text["sampler"] = "Euler"  # the flow-matching Euler scheduler (A1111's name for the method)
    if "guidance" in params:
        text["guidance"] = repr(float(params["guidance"]))
    if "width" in params and "height" in params:
        text["size"] = f"{params['width']}x{params['height']}"
    if init is not None:
        text["init_latents"] = str(init)
    if given.get("images"):
        text["images"] = ", ".join(str(image) if isinstance(image, str | Path) else f"image[{k}]"
                                   if isinstance(image, bytes) else "pixels"
                                   for k, image in enumerate(given["images"]))
    return text


PARAM_CHECKS = {
    "steps": check_steps,
    "seed": check_seed,
    "guidance": check_guidance,
    "width": lambda value, given: check_side("--width", value),
    "height": lambda value, given: check_side("--height", value),
}
INPUTS = {"prompt": read_prompt, "init_latents": read_init_latents, "images": read_references}
DESCRIBE = describe
PREPARE = prepare
DERIVE = {"images": derive_from_references}
CHECKS = {"tokenize": check_tokenize}
__all__ = ["CHECKS", "DERIVE", "DESCRIBE", "INPUTS", "PARAM_CHECKS", "PREPARE", "STEPS"]
