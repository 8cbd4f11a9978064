"""FLUX.2's host steps: the glue diffusers' Flux2Pipeline runs on the host between its models (tokenizing,
starting noise, position tables, the flow-match schedule and its Euler step, unpacking the latents).

Each step is a function of keyword arguments (evaluated from the stage's ``inputs`` expressions) returning a dict
of named results (mapped to values by the stage's ``outputs``); ``ctx`` is the driver's ``StepContext``. They
hold no numerics beyond what the referenced diffusers pipeline does on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luminal_recipes.errors import PipelineError
from luminal_recipes.pipeline.plugins import StepContext, run_steps

from . import latents as L
from .scheduler import Flux2Schedule
from .tokenize import Flux2Tokenizer


def tokenizer(ctx: StepContext) -> Flux2Tokenizer:
    """The pipeline's tokenizer: the checkpoint's ``tokenizer.path`` folder (default ``tokenizer``), with the
    recipe's ``tokenizer:`` options (template, system message, conversation, template arguments...)."""
    spec = ctx.recipe.tokenizer
    options = {} if spec is None else dict(
        chat_template=spec.chat_template, system_message=spec.system, conversation=spec.conversation,
        generation_prompt=spec.generation_prompt, template_args=spec.template_args,
        add_special_tokens=spec.add_special_tokens)
    return ctx.shared("flux2.tokenizer", lambda: Flux2Tokenizer.from_pretrained(
        ctx.checkpoint / (spec.path if spec else "tokenizer"), **options))


def schedule_of(ctx: StepContext) -> Flux2Schedule:
    """The pipeline's schedule: the checkpoint's ``scheduler.config`` file, with ``scheduler.options`` replacing
    its entries."""
    spec = ctx.recipe.scheduler
    if spec is None or spec.config is None:
        raise PipelineError("this pipeline recipe names no scheduler config (scheduler.config)")
    return ctx.shared("flux2.schedule", lambda: Flux2Schedule.from_config(
        ctx.checkpoint / spec.config, spec.options, ctx.where("scheduler", "options")))


def prepare(ctx: StepContext) -> None:
    """Load the tokenizer and the schedule the pipeline's steps will use, so a bad file fails before any work."""
    used = {stage.run for _, stage in run_steps(ctx.recipe.stages)}
    if used & {"tokenize", "detokenize"}:
        tokenizer(ctx)
    if used & {"schedule", "euler_step"}:
        schedule_of(ctx)


def tokenize(ctx: StepContext, text: str, max_length: int, allow_empty: bool = False) -> dict:
    """``allow_empty``: an empty text is tokenized too (the negative prompt "" of classifier-free guidance)."""
    tok = tokenizer(ctx)(text, int(max_length), allow_empty=bool(allow_empty))
    return {"input_ids": tok.input_ids, "attention_mask": tok.attention_mask, "num_tokens": tok.num_tokens}


def check_tokenize(ctx: StepContext, text: str, max_length: int, allow_empty: bool = False) -> None:
    """What ``tokenize`` would refuse, refused before any work (``CHECKS``): every prompt, not only the first."""
    tokenizer(ctx).check(text, int(max_length), allow_empty=bool(allow_empty))


def detokenize(ctx: StepContext, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
               skip_special_tokens: bool = False) -> dict:
    """The text the tokens of one prompt stand for (e.g. to see what the text encoder was given after the chat
    template and truncation): ``input_ids`` (1, S), the padding masked out by ``attention_mask``."""
    ids = np.asarray(input_ids).reshape(-1)
    if attention_mask is not None:
        mask = np.asarray(attention_mask).reshape(-1)
        if mask.shape != ids.shape:
            raise PipelineError(f"detokenize: attention_mask has {mask.size} entries for {ids.size} tokens")
        ids = ids[mask != 0]
    text = tokenizer(ctx).decode(ids, skip_special_tokens=bool(skip_special_tokens))
    return {"text": text}


def initial_latents(ctx: StepContext, seed: int, height: int, width: int, channels: int,
                    init: np.ndarray | None = None) -> dict:
    """Starting noise ``(1, channels, H/16, W/16)`` from ``seed``, or the given ``--init-latents`` array."""
    if init is not None:
        lat = np.asarray(init, dtype=np.float32)
        want = (1, channels, *L.latent_grid(height, width))
        if lat.shape != want:
            raise PipelineError(f"--init-latents: shape {lat.shape}, expected {want} for {width}x{height}")
    else:
        lat = L.initial_noise(seed, height, width, channels)
    h, w = lat.shape[2], lat.shape[3]
    return {"latents": L.pack_latents(lat), "h": h, "w": w}


def rope_tables(ctx: StepContext, ids: np.ndarray, axes_dims: list[int], theta: float) -> dict:
    """Multi-axis rotary tables for position ``ids [S, n_axes]``: per axis, cos/sin of ``pos * theta^(-2i/d)``
    in f64, each frequency repeated for an adjacent pair, axes concatenated (diffusers ``Flux2PosEmbed``)."""
    from luminal_recipes.ops.attention import rope_tables as one_axis

    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        c, s = one_axis(ids[:, axis], int(dim), float(theta), style="pairs")
        cos_parts.append(c)
        sin_parts.append(s)
    return {"cos": np.concatenate(cos_parts, -1), "sin": np.concatenate(sin_parts, -1)}


def flux2_positions(ctx: StepContext, text_len: int, h: int, w: int, axes_dims: list[int], theta: float,
                    references: list[np.ndarray] | None = None) -> dict:
    """RoPE tables for ``[text; image; references]`` tokens: text ids ``(0, 0, 0, k)``, image ids ``(0, i, j, 0)``,
    and for each reference image's latents ``(1, C, h_r, w_r)``, in order, ids ``(10 + 10 r, i, j, 0)``."""
    grids = [_grid(latents, "references") for latents in references or ()]
    ids = np.concatenate([L.text_ids(int(text_len)), L.latent_ids(int(h), int(w)), L.reference_ids(grids)])
    return rope_tables(ctx, ids.astype(np.float64), axes_dims, theta)


def pack_references(ctx: StepContext, latents: list[np.ndarray] | None, channels: int) -> dict:
    """The reference images' latents (each ``(1, channels, h_r, w_r)``, as the VAE encoder gives them), packed
    into tokens and joined image after image: ``(1, sum h_r * w_r, channels)`` (``prepare_image_latents``); no
    reference: ``(1, 0, channels)``."""
    parts = [L.pack_latents(np.asarray(x, dtype=np.float32)) for x in latents or ()]
    for part in parts:
        if part.shape[0] != 1 or part.shape[2] != int(channels):
            raise PipelineError(f"pack_references: reference latents of {part.shape[2]} channels (batch "
                                f"{part.shape[0]}); expected batch 1 and {channels} channels")
    return {"tokens": np.concatenate([np.zeros((1, 0, int(channels)), np.float32), *parts], axis=1)}


def _grid(latents: np.ndarray, what: str) -> tuple[int, int]:
    shape = np.shape(latents)
    if len(shape) != 4:
        raise PipelineError(f"{what}: expected latents (1, C, h, w), got shape {shape}")
    return int(shape[2]), int(shape[3])


def schedule(ctx: StepContext, steps: int, image_seq_len: int) -> dict:
    sigmas, timesteps = schedule_of(ctx).timesteps(int(steps), int(image_seq_len))
    return {"sigmas": sigmas, "timesteps": timesteps}


def euler_step(ctx: StepContext, velocity: np.ndarray, latents: np.ndarray, sigmas: np.ndarray, i: int) -> dict:
    return {"latents": schedule_of(ctx).step(velocity, float(sigmas[i]), float(sigmas[i + 1]), latents)}


def unpack_latents(ctx: StepContext, tokens: np.ndarray, h: int, w: int) -> dict:
    return {"latents": L.unpack_latents(tokens, int(h), int(w))}


STEPS: dict[str, Callable] = {
    "tokenize": tokenize,
    "detokenize": detokenize,
    "initial_latents": initial_latents,
    "rope_tables": rope_tables,
    "flux2_positions": flux2_positions,
    "pack_references": pack_references,
    "schedule": schedule,
    "euler_step": euler_step,
    "unpack_latents": unpack_latents,
}
