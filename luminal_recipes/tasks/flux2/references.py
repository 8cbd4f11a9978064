"""Reference images (``--image``, editing) as diffusers' Flux2Pipeline takes them: read and checked before any
work, and the pipeline parameters they decide.

``Flux2Pipeline(image=...)`` checks each image (``Flux2ImageProcessor.check_image_input``: both sides at least 64
pixels, aspect ratio at most 8), fits it to the latent grid (above 1024 x 1024 pixels resized to about that area,
sides floored to a multiple of 16, center-cropped: the pipeline's ``fit_images`` step, ``image_io.fit_image``),
encodes it with the VAE and appends its tokens to the noisy latents' at time coordinate ``10 + 10 i``. When no
``height``/``width`` is given, the output takes the first reference's fitted size. diffusers sets no limit on how
many references there are; Black Forest Labs documents one per model (FLUX.2 [dev]: at most 6 recommended, [klein]:
up to 4), which a pipeline states as its ``max_images`` parameter.

The parameters derived here (``DERIVE``) are the pipeline's, by name: ``width``/``height`` (unless given),
``reference_tokens`` (the latent tokens of all references: the transformer's sequence grows by as many) and
``reference_height``/``reference_width`` (the largest fitted reference, to plan the VAE encoder for), all from
``reference_max_area`` and the 16-pixel latent grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from luminal_recipes.errors import PipelineError
from luminal_recipes.image_io import decode_image_bytes, fitted_size, load_image

from .latents import PIXELS_PER_TOKEN

MIN_SIDE = 64  # Flux2ImageProcessor.check_image_input's defaults
MAX_ASPECT = 8
DERIVED = ("reference_tokens", "reference_height", "reference_width")


def check_reference(pixels: np.ndarray, where: str) -> None:
    """``Flux2ImageProcessor.check_image_input``: both sides at least 64 pixels, aspect ratio at most 8:1."""
    height, width = pixels.shape[:2]
    if width < MIN_SIDE or height < MIN_SIDE:
        raise PipelineError(f"{where}: the image is {width}x{height} pixels; FLUX.2 takes reference images of at "
                            f"least {MIN_SIDE} pixels a side (diffusers' Flux2ImageProcessor.check_image_input)")
    aspect = max(width / height, height / width)
    if aspect > MAX_ASPECT:
        raise PipelineError(f"{where}: the image is {width}x{height} pixels, an aspect ratio of {aspect:.1f}:1; "
                            f"FLUX.2 takes reference images of at most {MAX_ASPECT}:1 (diffusers' "
                            f"Flux2ImageProcessor.check_image_input); crop it")


def read_references(paths: Sequence[Path | np.ndarray | bytes], params: Mapping[str, Any]) -> list[np.ndarray]:
    """``--image PATH`` (repeatable): each file read as ``diffusers.utils.load_image`` reads it, ``(H, W, 3)``
    uint8 RGB, and checked; at most ``max_images`` of them when the pipeline declares that parameter."""
    paths = list(paths)
    limit = params.get("max_images")
    if limit is not None and len(paths) > int(limit):
        raise PipelineError(f"--image was given {len(paths)} times, but this pipeline takes at most {limit} "
                            f"reference images (its max_images parameter, the maximum Black Forest Labs documents "
                            f"for the model); pass fewer, or raise it with --set max_images={len(paths)}")
    images = []
    for index, path in enumerate(paths):
        if isinstance(path, np.ndarray):  # pixels given in Python (the API reads a PIL image as load_image does)
            if path.dtype != np.uint8 or path.ndim != 3 or path.shape[2] != 3:
                raise PipelineError(f"image {index + 1}: expected (H, W, 3) uint8 RGB pixels, got "
                                    f"{path.shape} {path.dtype}")
            pixels, where = path, f"image {index + 1}"
        elif isinstance(path, bytes):  # an image file's bytes (`serve`'s uploads: the `image[]` fields)
            pixels, where = decode_image_bytes(path, f"`image[{index}]`"), f"`image[{index}]`"
        else:
            pixels, where = load_image(path, "--image"), f"--image {path}"
        check_reference(pixels, where)
        images.append(pixels)
    return images


def derive_from_references(images: Sequence[np.ndarray] | None, params: Mapping[str, Any],
                           set_by: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """What the reference images decide (see the module docstring): ``{parameter: (value, origin)}``."""
    if not images or "reference_max_area" not in params:
        return {}
    for name in DERIVED:
        if name in set_by:
            raise PipelineError(f"{set_by[name]}: '{name}' follows from the reference images (--image); leave it "
                                f"unset")
    sizes = [fitted_size(int(px.shape[1]), int(px.shape[0]), int(params["reference_max_area"]), PIXELS_PER_TOKEN)
             for px in images]
    values = {
        "reference_tokens": sum((w // PIXELS_PER_TOKEN) * (h // PIXELS_PER_TOKEN) for w, h in sizes),
        "reference_height": max(h for _, h in sizes),
        "reference_width": max(w for w, _ in sizes),
    }
    derived = {name: (value, f"--image ({len(images)} reference image{'s' * (len(images) > 1)})")
               for name, value in values.items() if name in params}
    for name, value in (("width", sizes[0][0]), ("height", sizes[0][1])):
        if name in params and name not in set_by:  # diffusers: height = height or image_height
            derived[name] = (value, f"the first --image (fitted to {sizes[0][0]}x{sizes[0][1]})")
    return derived
