"""Images in and out: input images read and fitted as diffusers does; decoded images written as PNG (diffusers'
post-processing, atomic writes with text chunks, file-name slugs).

Out: the VAE decodes to float pixels in about [-1, 1]. diffusers' ``VaeImageProcessor.postprocess`` maps them with
``(x * 0.5 + 0.5).clamp(0, 1)`` and, for PIL output, ``(x * 255).round()`` to uint8; both are reproduced here
in float32. The PNG is written to a temporary file next to the target and moved into place (``atomic_file``),
so a reader never sees a partial image and a failed run leaves nothing behind.

In: a file is read as ``diffusers.utils.load_image`` reads it (Pillow, EXIF orientation applied, converted to
RGB), and fitted to a model's grid as ``Flux2ImageProcessor`` does for reference images (above an area, resized
with Lanczos to about that area; both sides floored to a multiple; center-cropped; scaled to [-1, 1]): the same
Pillow calls in the same order, and the same float32 arithmetic, so the pixels are bit-identical.
"""

from __future__ import annotations

import io
import math
import re
import unicodedata
from collections.abc import Mapping
from os import PathLike
from pathlib import Path

import numpy as np

from luminal_recipes.errors import PipelineError
from luminal_recipes.files import read_regular
from luminal_recipes.pipeline.atomic_file import atomic_write

MAX_IMAGE_FILE_BYTES = 512 << 20  # a compressed picture; larger is not an input image


def load_image(path: str | PathLike, flag: str = "--image") -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB pixels of an image file, as ``diffusers.utils.load_image`` gives them (Pillow's
    decoder, ``ImageOps.exif_transpose``, ``convert("RGB")``). PipelineError naming ``flag`` and the file when it
    cannot be read as an image (missing, not a regular file, not a format Pillow decodes, truncated, a
    decompression bomb)."""
    path = Path(path)
    try:
        data = read_regular(path, f"{flag} image", MAX_IMAGE_FILE_BYTES, PipelineError)
    except FileNotFoundError:
        raise PipelineError(f"{flag} {path}: file not found.") from None
    except OSError as exc:
        raise PipelineError(f"{flag} {path}: cannot read it ({exc.strerror or exc}).") from None
    return decode_image_bytes(data, f"{flag} {path}")


def decode_image_bytes(data: bytes, where: str) -> np.ndarray:
    """``load_image`` of an image file's bytes (an upload); ``where`` names it in the PipelineError."""
    from PIL import Image, ImageOps  # here: a text-only run never imports Pillow (3.6 MiB resident)

    try:
        with Image.open(io.BytesIO(data)) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except Image.UnidentifiedImageError:
        raise PipelineError(f"{where}: not an image Pillow can read; give a PNG, JPEG, WebP or another "
                            f"format Pillow reads.") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise PipelineError(f"{where}: cannot read it as an image ({exc}).") from None
    return np.asarray(image)


def fitted_size(width: int, height: int, max_area: int, multiple: int) -> tuple[int, int]:
    """``(width, height)`` of an image of that size after ``fit_image``."""
    if width * height > max_area:
        scale = math.sqrt(max_area / (width * height))
        width, height = int(width * scale), int(height * scale)
    return (width // multiple) * multiple, (height // multiple) * multiple


def fit_image(pixels: np.ndarray, max_area: int, multiple: int) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB -> ``(1, 3, h, w)`` float32 in [-1, 1], as Flux2Pipeline prepares a reference image:
    above ``max_area`` pixels resized with Lanczos to ``int(W * s) x int(H * s)``, ``s = sqrt(max_area / (W * H))``
    (``Flux2ImageProcessor._resize_to_target_area``); both sides floored to a multiple of ``multiple``;
    center-cropped to that (``Flux2ImageProcessor._resize_and_crop`` via ``preprocess(resize_mode="crop")``);
    ``x / 255`` in float32, then ``2 x - 1`` (``pil_to_numpy``, ``normalize``)."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), "RGB")
    width, height = image.size
    if width * height > max_area:
        scale = math.sqrt(max_area / (width * height))
        image = image.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
        width, height = image.size
    crop_w, crop_h = (width // multiple) * multiple, (height // multiple) * multiple
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    image = image.crop((left, top, left + crop_w, top + crop_h)).convert("RGB")
    unit = np.array(image).astype(np.float32) / 255.0
    return np.ascontiguousarray((2.0 * unit - 1.0).transpose(2, 0, 1)[None])

_SLUG_MAX_CHARS = 48


def to_unit_range(image: np.ndarray) -> np.ndarray:
    """VAE output ``(1, 3, H, W)`` or ``(3, H, W)`` -> ``(H, W, 3)`` float32 in [0, 1] (diffusers' "np")."""
    image = np.asarray(image)
    if image.ndim == 4:
        if image.shape[0] != 1:
            raise ValueError(f"to_unit_range: expected one image, got a batch of {image.shape[0]}")
        image = image[0]
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"to_unit_range: expected (1, 3, H, W) or (3, H, W), got {image.shape}")
    image = image.astype(np.float32, copy=False)
    unit = np.clip(image * np.float32(0.5) + np.float32(0.5), 0, 1)
    unit = np.nan_to_num(unit, copy=False, nan=0.0)  # only with --allow-nonfinite: NaN pixels become black
    return np.ascontiguousarray(unit.transpose(1, 2, 0))


def to_uint8(image: np.ndarray) -> np.ndarray:
    """VAE output -> ``(H, W, 3)`` uint8, exactly as diffusers' ``numpy_to_pil`` (round half to even)."""
    return (to_unit_range(image) * np.float32(255)).round().astype(np.uint8)


def slugify(text: str, max_chars: int = _SLUG_MAX_CHARS) -> str:
    """A file-name-safe, lowercase ASCII rendering of ``text`` ("A Cat, in a Hat!" -> "a-cat-in-a-hat")."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    if len(slug) > max_chars:
        cut = slug[: max_chars + 1]
        slug = cut.rsplit("-", 1)[0] if "-" in cut else cut[:max_chars]
    return slug.strip("-")


def png_text(value: str) -> str:
    """``value`` fit for a PNG text chunk: control characters other than newline (a NUL would end the chunk's
    text early, and the PNG specification forbids it) are written as escapes such as ``\\x00``."""
    return "".join(c if c == "\n" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in value)


def write_png(
    path: str | PathLike, pixels: np.ndarray, text: Mapping[str, str] | None = None, *, overwrite: bool = True
) -> Path:
    """Write ``(H, W, 3)`` uint8 ``pixels`` to ``path`` atomically, with ``text`` as PNG text chunks.

    The parent folder is created if needed. Any failure raises ``PipelineError`` naming the path and leaves
    neither a partial PNG nor a temporary file behind; an existing file is replaced only once the new one is
    complete, and only when ``overwrite`` (else ``OutputExistsError``).
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise PipelineError(f"--output {path}: the file name must end with .png (images are written as PNG).")
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"write_png: expected (H, W, 3) uint8 pixels, got {pixels.shape} {pixels.dtype}")
    return atomic_write(path, lambda handle: encode_png(handle, pixels, text), overwrite=overwrite, what="image")


def encode_png(handle, pixels: np.ndarray, text: Mapping[str, str] | None = None) -> None:
    """``pixels`` ((H, W, 3) uint8) as PNG bytes with ``text`` chunks, written to the binary ``handle``."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    for key, value in (text or {}).items():
        info.add_text(key, png_text(value))  # Pillow switches to an iTXt (UTF-8) chunk for text outside Latin-1
    Image.fromarray(pixels, mode="RGB").save(handle, format="PNG", pnginfo=info)


def save_image(
    path: str | PathLike, image: np.ndarray, text: Mapping[str, str] | None = None, *, overwrite: bool = True
) -> Path:
    """Post-process a VAE output like diffusers and write it as a PNG (see ``to_uint8`` and ``write_png``)."""
    return write_png(path, to_uint8(image), text, overwrite=overwrite)


def read_png(path: str | PathLike) -> tuple[np.ndarray, dict[str, str]]:
    """``(pixels (H, W, 3) uint8, text chunks)`` of a PNG, e.g. one this module wrote (a regular file: a FIFO or
    a device is refused, never read)."""
    from PIL import Image

    data = read_regular(path, "a PNG", MAX_IMAGE_FILE_BYTES, PipelineError)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return np.asarray(image.convert("RGB")), dict(getattr(image, "text", {}))
    except Image.UnidentifiedImageError:
        raise PipelineError(f"{path}: not an image Pillow can read; write the PNG again.") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # truncated, a bomb...
        raise PipelineError(f"{path}: cannot read it as an image ({exc}); write the PNG again.") from None
