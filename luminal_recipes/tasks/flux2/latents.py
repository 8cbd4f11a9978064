"""FLUX.2 latents on the host: initial noise, ``--init-latents`` files, token packing and the VAE-side glue.

Shapes follow diffusers' ``Flux2Pipeline``. For an image of ``H x W`` pixels the VAE works on ``(1, 32, H/8,
W/8)`` latents; the pipeline folds each 2x2 patch into channels, so the transformer's latents are ``(1, 128,
h, w)`` with ``h, w = H/16, W/16`` and are packed into ``h * w`` tokens of 128 features, row-major over ``(h,
w)``. Positions for the 4-axis RoPE are ``(t, h, w, l)``: image token ``(i, j)`` is ``(0, i, j, 0)``, text
token ``k`` is ``(0, 0, 0, k)``. After denoising, the tokens are unpacked, de-normalised with the running
statistics of the VAE's ``bn`` layer (``x * sqrt(running_var + eps) + running_mean``) and unpatchified back to
``(1, 32, H/8, W/8)`` for the decoder. All arithmetic is float32 in the same order as diffusers, so results
are bit-identical, except that numpy's float32 sqrt is correctly rounded where torch's is sometimes one ulp
off (de-normalisation agrees to ~1e-6).
"""

from __future__ import annotations

import math
import os
from os import PathLike
from pathlib import Path

import numpy as np

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.files import MAX_JSON_BYTES, open_regular, read_json
from luminal_recipes.weights.safetensors_io import Checkpoint

PIXELS_PER_TOKEN = 16  # VAE downsampling (8) x the 2x2 patch folded into channels
LATENT_CHANNELS = 128  # transformer in_channels: 32 VAE channels x 2 x 2


def check_side(flag: str, value: int) -> None:
    """One side of the image (``--width`` or ``--height``) is a positive multiple of 16 pixels."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PipelineError(f"{flag} must be an integer number of pixels, got {value!r}.")
    if value < PIXELS_PER_TOKEN or value % PIXELS_PER_TOKEN:
        lower = max(PIXELS_PER_TOKEN, value - value % PIXELS_PER_TOKEN)
        raise PipelineError(
            f"{flag} {value} is not a positive multiple of {PIXELS_PER_TOKEN}: FLUX.2 latents cover "
            f"{PIXELS_PER_TOKEN}x{PIXELS_PER_TOKEN} pixels each. Use e.g. {flag} {lower} or "
            f"{lower + PIXELS_PER_TOKEN}."
        )


def latent_grid(height: int, width: int) -> tuple[int, int]:
    """``(H / 16, W / 16)``, the transformer's latent grid; the size must be a positive multiple of 16."""
    for flag, value in (("--height", height), ("--width", width)):
        check_side(flag, value)
    return int(height) // PIXELS_PER_TOKEN, int(width) // PIXELS_PER_TOKEN


MAX_SEED = 2**64 - 1


def check_seed(seed: int, given: str = "--seed") -> None:
    """A seed is an integer in [0, 2**64); ``given`` says where it came from ("--seed -1")."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed <= MAX_SEED:
        raise PipelineError(f"{given}: the seed must be an integer from 0 to {MAX_SEED}, got {seed!r}.")


def initial_noise(seed: int, height: int, width: int, channels: int = LATENT_CHANNELS) -> np.ndarray:
    """Gaussian starting latents ``(1, channels, H/16, W/16)`` float32 for ``--seed``.

    Drawn with ``numpy.random.default_rng(seed).standard_normal(shape, dtype=float32)`` (PCG64, ziggurat), so
    a seed gives the same latents on every machine and numpy version that keeps this generator stable. It is
    *not* the noise diffusers draws from ``torch.Generator().manual_seed(seed)``: to reproduce a diffusers
    image exactly, save its latents to a ``.npy`` file and pass them with ``--init-latents``.
    """
    check_seed(seed)
    h, w = latent_grid(height, width)
    return np.random.default_rng(int(seed)).standard_normal((1, channels, h, w), dtype=np.float32)


MAX_NPY_HEADER = 64 << 10  # numpy writes headers of a few hundred bytes


def npy_header(path: str | PathLike) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """``(shape, dtype, fortran_order, data offset)`` of an ``.npy`` file, read from its header alone: the
    array is not loaded, so a header claiming terabytes costs nothing. PipelineError if it is no .npy file."""
    path = Path(path)
    try:
        with open_regular(path, "--init-latents", PipelineError) as handle:
            if handle.read(4) == b"PK\x03\x04":  # a zip archive: numpy.savez
                raise PipelineError(f"--init-latents {path}: expected a single .npy array, found an .npz archive.")
            handle.seek(0)
            try:
                version = np.lib.format.read_magic(handle)
            except ValueError:
                raise PipelineError(
                    f"--init-latents {path}: not a readable .npy array (the file does not start with numpy's "
                    "'\\x93NUMPY' header); save the latents with numpy.save, e.g. numpy.save(path, "
                    "latents.float().numpy())."
                ) from None
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:
                raise PipelineError(f"--init-latents {path}: .npy format version {version} is not supported; "
                                    "save it with numpy.save.")
            shape, fortran, dtype = read[version](handle, max_header_size=MAX_NPY_HEADER)
            offset = handle.tell()
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        raise PipelineError(f"--init-latents {path}: file not found.") from None
    except OSError as exc:
        raise PipelineError(f"--init-latents {path}: cannot read it ({exc.strerror or exc}).") from None
    except ValueError as exc:  # a malformed header
        raise PipelineError(f"--init-latents {path}: its .npy header is not valid ({exc}).") from None
    if dtype.hasobject:
        raise PipelineError(f"--init-latents {path}: not a readable .npy array (it holds Python objects, which "
                            "would need unpickling, not numbers).")
    need = offset + math.prod(shape) * dtype.itemsize
    if size < need:
        raise PipelineError(f"--init-latents {path}: the header promises {math.prod(shape)} values of shape "
                            f"{shape}, but the file is {size} bytes (truncated?).")
    return tuple(shape), dtype, fortran, offset


def load_init_latents(
    path: str | PathLike, height: int, width: int, channels: int = LATENT_CHANNELS
) -> np.ndarray:
    """Read ``--init-latents FILE.npy``: diffusers' ``latents`` argument, shape ``(1, channels, H/16, W/16)``.

    Any floating dtype is accepted and converted to float32 (diffusers casts to the text embeddings' dtype). The
    header is checked (shape, dtype, file size) before a single value is read.
    """
    h, w = latent_grid(height, width)
    expected = (1, channels, h, w)
    path = Path(path)
    shape, dtype, _, _ = npy_header(path)
    if shape != expected:
        raise PipelineError(
            f"--init-latents {path}: shape {shape}, but a {height}x{width} image needs {expected} "
            f"(batch 1, {channels} channels, H/16, W/16), the layout of diffusers' Flux2Pipeline `latents`."
        )
    if not np.issubdtype(dtype, np.floating):
        raise PipelineError(
            f"--init-latents {path}: dtype {dtype}; the latents must be floating point."
        )
    try:
        with open_regular(path, "--init-latents", PipelineError) as handle:
            array = np.lib.format.read_array(handle, allow_pickle=False, max_header_size=MAX_NPY_HEADER)
    except (OSError, ValueError) as exc:
        raise PipelineError(f"--init-latents {path}: cannot read the array ({exc}).") from None
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise PipelineError(f"--init-latents {path}: contains NaN or infinite values.")
    return array


def pack_latents(latents: np.ndarray) -> np.ndarray:
    """``(B, C, h, w) -> (B, h*w, C)`` (diffusers ``Flux2Pipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    return np.ascontiguousarray(latents.reshape(b, c, h * w).transpose(0, 2, 1))


def unpack_latents(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    """``(B, h*w, C) -> (B, C, h, w)`` (diffusers ``_unpack_latents_with_ids`` with ``latent_ids(h, w)``)."""
    b, n, c = tokens.shape
    if n != h * w:
        raise ValueError(f"unpack_latents: {n} tokens cannot fill a {h}x{w} grid")
    return np.ascontiguousarray(tokens.reshape(b, h, w, c).transpose(0, 3, 1, 2))


def latent_ids(h: int, w: int) -> np.ndarray:
    """Image token positions ``(h*w, 4)`` int32; row ``i*w + j`` is ``(0, i, j, 0)`` (_prepare_latent_ids)."""
    ids = np.zeros((h, w, 4), dtype=np.int32)
    ids[..., 1] = np.arange(h, dtype=np.int32)[:, None]
    ids[..., 2] = np.arange(w, dtype=np.int32)[None, :]
    return ids.reshape(h * w, 4)


REFERENCE_TIME_SCALE = 10  # reference image i sits at time coordinate 10 + 10 * i (_prepare_image_ids)


def reference_ids(grids: list[tuple[int, int]]) -> np.ndarray:
    """Positions ``(sum h*w, 4)`` int32 of reference images' tokens, image after image: token ``(r, c)`` of image
    ``i`` (a ``h x w`` latent grid) is ``(10 + 10 i, r, c, 0)`` (``Flux2Pipeline._prepare_image_ids``)."""
    parts = []
    for index, (h, w) in enumerate(grids):
        ids = latent_ids(int(h), int(w))
        ids[:, 0] = REFERENCE_TIME_SCALE + REFERENCE_TIME_SCALE * index
        parts.append(ids)
    return np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int32)


def text_ids(seq_len: int) -> np.ndarray:
    """Text token positions ``(seq_len, 4)`` int32: row ``k`` is ``(0, 0, 0, k)`` (``_prepare_text_ids``)."""
    ids = np.zeros((seq_len, 4), dtype=np.int32)
    ids[:, 3] = np.arange(seq_len, dtype=np.int32)
    return ids


def denormalize_latents(
    latents: np.ndarray, running_mean: np.ndarray, running_var: np.ndarray, eps: float
) -> np.ndarray:
    """Undo the VAE's batch norm on ``(B, 128, h, w)`` latents: ``x * sqrt(var + eps) + mean`` per channel."""
    mean = np.asarray(running_mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.sqrt(np.asarray(running_var, dtype=np.float32).reshape(1, -1, 1, 1) + np.float32(eps))
    return latents.astype(np.float32, copy=False) * std + mean


def unpatchify_latents(latents: np.ndarray) -> np.ndarray:
    """``(B, C*4, h, w) -> (B, C, 2h, 2w)``: channel ``4c + 2p + q`` goes to pixel ``(2i + p, 2j + q)``."""
    b, c4, h, w = latents.shape
    c = c4 // 4
    return np.ascontiguousarray(
        latents.reshape(b, c, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(b, c, 2 * h, 2 * w)
    )


def tokens_to_vae_latents(
    tokens: np.ndarray, h: int, w: int, running_mean: np.ndarray, running_var: np.ndarray, eps: float
) -> np.ndarray:
    """Denoised tokens ``(1, h*w, 128)`` -> VAE decoder input ``(1, 32, 2h, 2w)``, as Flux2Pipeline does."""
    return unpatchify_latents(
        denormalize_latents(unpack_latents(tokens, h, w), running_mean, running_var, eps)
    )


def load_vae_batch_norm(vae_folder: str | PathLike) -> tuple[np.ndarray, np.ndarray, float]:
    """``(running_mean, running_var, batch_norm_eps)`` of a diffusers ``AutoencoderKLFlux2`` folder."""
    folder = Path(vae_folder)
    config_path = folder / "config.json"
    try:
        config = read_json(config_path, "the VAE config", MAX_JSON_BYTES, CheckpointError,
                           fix="restore it from the checkpoint")
        eps = float(config.get("batch_norm_eps", 1e-4))
    except FileNotFoundError:
        raise CheckpointError(
            f"{config_path}: file not found; the VAE folder needs its config.json."
        ) from None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{config_path}: cannot read batch_norm_eps ({exc}).") from None
    with Checkpoint.open(folder) as checkpoint:
        missing = [name for name in ("bn.running_mean", "bn.running_var") if name not in checkpoint]
        if missing:
            raise CheckpointError(
                f"{folder}: no tensor {', '.join(missing)} in its safetensors files; a FLUX.2 VAE "
                "(AutoencoderKLFlux2) stores the latent statistics there."
            )
        mean = checkpoint.load("bn.running_mean").astype(np.float32)
        var = checkpoint.load("bn.running_var").astype(np.float32)
    return mean, var, eps
