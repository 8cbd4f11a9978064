"""Prompt -> token ids for FLUX.2's Mistral-3 text encoder, exactly as diffusers' Flux2Pipeline makes them.

diffusers formats the prompt as a chat (its fixed system message, then the user prompt with any ``[IMG]``
removed), renders the Mistral chat template to
``<s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt}[/INST]``, tokenizes that without adding special
tokens, truncates to ``max_sequence_length`` and pads to it with ``<pad>`` (id 11 in Tekken), with an
attention mask of 1 on real tokens. This module does the same with the ``tokenizers`` package and the
checkpoint's ``tokenizer/tokenizer.json``; the rendering is fixed here rather than read from the Jinja
template, because for a system + text-only user turn every Mistral-3 template renders this same string.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import numpy as np
import tokenizers

from luminal_recipes.errors import CheckpointError, PipelineError

logger = logging.getLogger(__name__)

# diffusers.pipelines.flux2.system_messages.SYSTEM_MESSAGE (from BFL's flux2 repository), newline included.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
DEFAULT_MAX_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class TokenizedPrompt:
    """One padded prompt: ``input_ids`` and ``attention_mask`` are int32, shape (1, max_sequence_length)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    num_tokens: int  # real (unpadded) tokens kept
    num_truncated: int  # tokens cut off at max_sequence_length


class Flux2Tokenizer:
    """The Tekken tokenizer of a FLUX.2 checkpoint plus diffusers' chat formatting, padding and truncation."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str = "<s>",
        pad_token: str = "<pad>",
        padding_side: str = "right",
        truncation_side: str = "right",
        system_message: str = SYSTEM_MESSAGE,
        source: str = "tokenizer",
    ):
        tokenizer.no_padding()  # padding and truncation are done below, as transformers does them
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        self.bos_token = bos_token
        self.pad_token = pad_token
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.system_message = system_message
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None or tokenizer.token_to_id(bos_token) is None:
            missing = pad_token if pad_id is None else bos_token
            raise CheckpointError(
                f"{source}: the vocabulary has no {missing!r} token; FLUX.2 needs Mistral's Tekken tokenizer "
                "(copy tokenizer/ from the original checkpoint)."
            )
        self.pad_token_id = pad_id
        for side, value in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if value not in ("left", "right"):
                raise CheckpointError(f"{source}: {side} is {value!r}; it must be 'left' or 'right'.")

    @classmethod
    def from_pretrained(cls, folder: str | PathLike) -> Flux2Tokenizer:
        """Load from a checkpoint's ``tokenizer/`` folder (or the checkpoint folder that contains it)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file() and (folder / "tokenizer" / "tokenizer.json").is_file():
            folder = folder / "tokenizer"
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{path}: file not found; a FLUX.2 checkpoint keeps its Tekken tokenizer in "
                "tokenizer/tokenizer.json (download the checkpoint's tokenizer folder, e.g. "
                "huggingface-cli download REPO --include 'tokenizer/*')."
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers package raises a bare Exception on malformed files
            raise CheckpointError(
                f"{path}: not a valid tokenizers file ({exc}); restore it from the checkpoint."
            ) from None
        options = _read_tokenizer_config(folder / "tokenizer_config.json")
        return cls(
            tokenizer,
            bos_token=_token_text(options.get("bos_token"), "<s>"),
            pad_token=_token_text(options.get("pad_token"), "<pad>"),
            padding_side=options.get("padding_side") or "right",
            truncation_side=options.get("truncation_side") or "right",
            source=str(folder),
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. to decode ids)."""
        return self._tokenizer

    def format(self, prompt: str) -> str:
        """The chat-template rendering of ``prompt`` (diffusers' ``format_input`` + Mistral's template)."""
        return (
            f"{self.bos_token}[SYSTEM_PROMPT]{self.system_message}[/SYSTEM_PROMPT]"
            f"[INST]{prompt.replace('[IMG]', '')}[/INST]"
        )

    def __call__(
        self, prompt: str, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    ) -> TokenizedPrompt:
        if not isinstance(prompt, str):
            raise PipelineError(f"prompt must be text, got {type(prompt).__name__}.")
        if not prompt.replace("[IMG]", ""):
            raise PipelineError("the prompt is empty; pass some text with --prompt.")
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int | np.integer):
            raise PipelineError(f"max_sequence_length must be an integer, got {max_sequence_length!r}.")
        if max_sequence_length < 1:
            raise PipelineError(f"max_sequence_length must be positive, got {max_sequence_length}.")
        length = int(max_sequence_length)

        ids = self._tokenizer.encode(self.format(prompt), add_special_tokens=False).ids
        num_truncated = max(0, len(ids) - length)
        if num_truncated:
            kept, dropped = (
                (ids[:length], ids[length:])
                if self.truncation_side == "right"
                else (ids[-length:], ids[:-length])
            )
            dropped_text = self._tokenizer.decode(dropped, skip_special_tokens=False)
            if len(dropped_text) > 80:
                dropped_text = dropped_text[:38] + " ... " + dropped_text[-37:]
            logger.warning(
                "The prompt is %d tokens long after the chat template, more than max_sequence_length=%d; "
                "%d tokens were cut off (%r). Shorten the prompt or raise max_sequence_length.",
                len(ids),
                length,
                num_truncated,
                dropped_text,
            )
            ids = kept

        padding = [self.pad_token_id] * (length - len(ids))
        mask = [1] * len(ids)
        if self.padding_side == "right":
            ids, mask = ids + padding, mask + [0] * len(padding)
        else:
            ids, mask = padding + ids, [0] * len(padding) + mask
        return TokenizedPrompt(
            input_ids=np.asarray([ids], dtype=np.int32),
            attention_mask=np.asarray([mask], dtype=np.int32),
            num_tokens=length - len(padding),
            num_truncated=num_truncated,
        )


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: cannot read it as JSON ({exc}); restore it from the checkpoint."
        ) from None
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: expected a JSON object.")
    return options


def _token_text(value, default: str) -> str:
    """transformers writes special tokens as plain strings or as AddedToken dicts with a ``content`` key."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else default
