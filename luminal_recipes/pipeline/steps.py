"""Built-in pipeline steps: the host-side glue a pipeline recipe names with ``run: STEP``.

Each step is a plain function of keyword arguments (evaluated from the stage's ``inputs`` expressions) returning a
dict of named results (mapped to values by the stage's ``outputs``). They hold no model-specific numerics beyond
what the referenced diffusers pipeline does on the host (tokenizing, noise, position ids, schedule, Euler step).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import PipelineError
from . import latents as L
from .scheduler import Flux2Schedule
from .tokenize import Flux2Tokenizer


class StepContext:
    """What steps may read besides their arguments: the checkpoint folder and the pipeline's tokenizer/scheduler."""

    def __init__(self, checkpoint: Path, tokenizer_path: str | None, scheduler_config: str | None,
                 chat_template: str | None = None, system_message: str | None = None):
        self.checkpoint = checkpoint
        self._tokenizer_path = tokenizer_path
        self._scheduler_config = scheduler_config
        self._chat_template = chat_template  # the pipeline recipe's tokenizer.chat_template / tokenizer.system
        self._system_message = system_message
        self._tokenizer: Flux2Tokenizer | None = None
        self._schedule: Flux2Schedule | None = None

    @property
    def tokenizer(self) -> Flux2Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Flux2Tokenizer.from_pretrained(
                self.checkpoint / (self._tokenizer_path or "tokenizer"),
                chat_template=self._chat_template,
                system_message=self._system_message,
            )
        return self._tokenizer

    @property
    def schedule(self) -> Flux2Schedule:
        if self._schedule is None:
            if self._scheduler_config is None:
                raise PipelineError("this pipeline recipe names no scheduler config (scheduler.config)")
            self._schedule = Flux2Schedule.from_config(self.checkpoint / self._scheduler_config)
        return self._schedule


def tokenize(ctx: StepContext, text: str, max_length: int) -> dict:
    tok = ctx.tokenizer(text, int(max_length))
    return {"input_ids": tok.input_ids, "attention_mask": tok.attention_mask, "num_tokens": tok.num_tokens}


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
    text = ctx.tokenizer.backend.decode([int(i) for i in ids], skip_special_tokens=bool(skip_special_tokens))
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
    from ..ops.attention import rope_tables as one_axis

    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        c, s = one_axis(ids[:, axis], int(dim), float(theta), style="pairs")
        cos_parts.append(c)
        sin_parts.append(s)
    return {"cos": np.concatenate(cos_parts, -1), "sin": np.concatenate(sin_parts, -1)}


def flux2_positions(ctx: StepContext, text_len: int, h: int, w: int, axes_dims: list[int], theta: float) -> dict:
    """RoPE tables for ``[text; image]`` tokens: text ids ``(0, 0, 0, k)``, image ids ``(0, i, j, 0)``."""
    ids = np.concatenate([L.text_ids(int(text_len)), L.latent_ids(int(h), int(w))]).astype(np.float64)
    return rope_tables(ctx, ids, axes_dims, theta)


def schedule(ctx: StepContext, steps: int, image_seq_len: int) -> dict:
    sigmas, timesteps = ctx.schedule.timesteps(int(steps), int(image_seq_len))
    return {"sigmas": sigmas, "timesteps": timesteps}


def euler_step(ctx: StepContext, velocity: np.ndarray, latents: np.ndarray, sigmas: np.ndarray, i: int) -> dict:
    return {"latents": ctx.schedule.step(velocity, float(sigmas[i]), float(sigmas[i + 1]), latents)}


def unpack_latents(ctx: StepContext, tokens: np.ndarray, h: int, w: int) -> dict:
    return {"latents": L.unpack_latents(tokens, int(h), int(w))}


def full(ctx: StepContext, value: float, n: int = 1) -> dict:
    """A float32 vector of ``n`` copies of ``value`` (per-batch scalars such as the timestep or guidance)."""
    return {"value": np.full((int(n),), float(value), dtype=np.float32)}


STEPS: dict[str, Callable] = {
    "tokenize": tokenize,
    "detokenize": detokenize,
    "initial_latents": initial_latents,
    "rope_tables": rope_tables,
    "flux2_positions": flux2_positions,
    "schedule": schedule,
    "euler_step": euler_step,
    "unpack_latents": unpack_latents,
    "full": full,
}
