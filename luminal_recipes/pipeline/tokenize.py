"""Prompt -> token ids for FLUX.2's Mistral-3 text encoder, exactly as diffusers' Flux2Pipeline makes them.

diffusers (``Flux2Pipeline._get_mistral_3_small_prompt_embeds``) formats the prompt as a conversation (its system
message, then the user prompt with any ``[IMG]`` removed, each as one text content block), renders it with the
checkpoint's own chat template (``apply_chat_template``, ``add_generation_prompt=False``), tokenizes the text
without adding special tokens (a processor adds them unless the text starts with the BOS token), truncates to
``max_sequence_length`` and pads to it with the pad token, with an attention mask of 1 on real tokens. This module
does the same with the ``tokenizers`` package, the checkpoint's ``tokenizer/`` files and the template rendered as
transformers renders it (``chat_template.py``). A pipeline recipe may replace the template or the system message
(``tokenizer.chat_template``, ``tokenizer.system``). A checkpoint without any template gets the FLUX.2-dev
rendering, with a warning naming it.
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
from luminal_recipes.files import MAX_JSON_BYTES, not_regular, read_regular_text

from .chat_template import SPECIAL_TOKEN_NAMES, find_chat_templates, render_chat

logger = logging.getLogger(__name__)

# diffusers.pipelines.flux2.system_messages.SYSTEM_MESSAGE (from BFL's flux2 repository), newline included.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
DEFAULT_MAX_SEQUENCE_LENGTH = 512
# Used only when the checkpoint has no chat template at all: what FLUX.2-dev's Mistral-Small-3.2 template renders
# for a system message and one user text message.
FALLBACK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ raise_exception('only system and user messages are supported') }}{% endif %}{% endfor %}"
)
FALLBACK_NAME = "the FLUX.2-dev (Mistral-Small-3.2) format <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]"


def flux2_messages(prompt: str, system_message: str) -> list[dict]:
    """diffusers' ``format_input`` for one text prompt: a system message, then the prompt without ``[IMG]``."""
    return [
        {"role": "system", "content": [{"type": "text", "text": system_message}]},
        {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
    ]


@dataclass(frozen=True)
class TokenizedPrompt:
    """One padded prompt: ``input_ids`` and ``attention_mask`` are int32, shape (1, max_sequence_length)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    num_tokens: int  # real (unpadded) tokens kept
    num_truncated: int  # tokens cut off at max_sequence_length


class Flux2Tokenizer:
    """A FLUX.2 checkpoint's tokenizer and chat template plus diffusers' conversation, padding and truncation."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str = FALLBACK_TEMPLATE,
        special_tokens: dict[str, str] | None = None,
        padding_side: str = "right",
        truncation_side: str = "right",
        system_message: str = SYSTEM_MESSAGE,
        processor: bool = False,
        source: str = "tokenizer",
        template_source: str | None = None,
    ):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_source = template_source or source
        self.special_tokens = dict(special_tokens if special_tokens is not None else {"bos_token": "<s>",
                                                                                      "pad_token": "<pad>"})
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.system_message = system_message
        self.processor = processor
        for side, value in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if value not in ("left", "right"):
                raise CheckpointError(f"{source}: {side} is {value!r}; it must be 'left' or 'right'.")
        self.pad_token = self.special_tokens.get("pad_token")
        pad_id = None if self.pad_token is None else tokenizer.token_to_id(self.pad_token)
        if pad_id is None:
            what = "names no pad token" if self.pad_token is None else f"has no {self.pad_token!r} token"
            raise CheckpointError(
                f"{source}: the tokenizer {what}; Flux2Pipeline pads every prompt to max_sequence_length with it "
                "(copy tokenizer/ from the original checkpoint)."
            )
        self.pad_token_id = pad_id
        self.bos_token = self.special_tokens.get("bos_token")

    @classmethod
    def from_pretrained(
        cls,
        folder: str | PathLike,
        chat_template: str | None = None,
        system_message: str | None = None,
        processor: bool | None = None,
    ) -> Flux2Tokenizer:
        """Load from a checkpoint's ``tokenizer/`` folder (or the checkpoint folder that contains it).

        ``chat_template`` replaces the checkpoint's template (a Jinja template, or the name of one of its named
        templates), ``system_message`` diffusers' system message. ``processor``: whether the pipeline loads this
        folder as a processor (default: as model_index.json next to it says).
        """
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file() and (folder / "tokenizer" / "tokenizer.json").is_file():
            folder = folder / "tokenizer"
        path = folder / "tokenizer.json"
        kind = not_regular(path)
        if kind is not None:
            raise CheckpointError(f"{path}: the tokenizer must be a regular file, but this is {kind}.")
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
        if options.get("split_special_tokens"):
            raise CheckpointError(
                f"{folder / 'tokenizer_config.json'}: split_special_tokens is true (special tokens in the text are "
                "encoded as plain text), which this pipeline does not implement; set it to false."
            )
        if processor is None:
            processor = _loaded_as_processor(folder)
        # tokenizer.json's own padding/truncation settings are defaults that tokenizer_config.json overrides
        padding = tokenizer.padding or {}
        truncation = tokenizer.truncation or {}
        special = _special_tokens(folder, options)
        if "pad_token" not in special and padding.get("pad_token"):
            special["pad_token"] = padding["pad_token"]
        templates = find_chat_templates(folder, options, processor)
        if chat_template is None and templates.templates is None:
            logger.warning(
                "%s has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
                "using %s. Add the checkpoint's template, or set tokenizer.chat_template in the pipeline recipe.",
                folder,
                FALLBACK_NAME,
            )
            template, template_source = FALLBACK_TEMPLATE, FALLBACK_NAME
            special.setdefault("bos_token", "<s>")
        else:
            template, template_source = templates.choose(chat_template)
        return cls(
            tokenizer,
            chat_template=template,
            special_tokens=special,
            padding_side=options.get("padding_side") or padding.get("direction") or "right",
            truncation_side=options.get("truncation_side") or truncation.get("direction") or "right",
            system_message=SYSTEM_MESSAGE if system_message is None else system_message,
            processor=processor,
            source=str(folder),
            template_source=template_source,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. to decode ids)."""
        return self._tokenizer

    def format(self, prompt: str) -> str:
        """The chat-template rendering of ``prompt`` (diffusers' ``format_input`` + the checkpoint's template)."""
        return render_chat(
            self.chat_template, flux2_messages(prompt, self.system_message), self.special_tokens, self.template_source
        )

    def add_special_tokens(self, text: str) -> bool:
        """A tokenizer's apply_chat_template never adds special tokens; a processor's adds them unless the
        rendered text already starts with the BOS token (transformers' ProcessorMixin.apply_chat_template)."""
        return self.processor and not (self.bos_token is not None and text.startswith(self.bos_token))

    def __call__(
        self, prompt: str, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    ) -> TokenizedPrompt:
        check_prompt(prompt)
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int | np.integer):
            raise PipelineError(f"max_sequence_length must be an integer, got {max_sequence_length!r}.")
        if max_sequence_length < 1:
            raise PipelineError(f"max_sequence_length must be positive, got {max_sequence_length}.")
        length = int(max_sequence_length)
        text = self.format(prompt)
        special = self.add_special_tokens(text)

        # transformers pads and truncates with the backend's own settings (TokenizersBackend.__call__)
        backend = self._tokenizer
        backend.no_padding()
        backend.no_truncation()
        full = backend.encode(text, add_special_tokens=special).ids
        backend.enable_truncation(length, stride=0, strategy="longest_first", direction=self.truncation_side)
        backend.enable_padding(direction=self.padding_side, pad_id=self.pad_token_id, pad_token=self.pad_token,
                               length=length)
        try:
            encoding = backend.encode(text, add_special_tokens=special)
        finally:
            backend.no_padding()
            backend.no_truncation()
        mask = encoding.attention_mask
        num_tokens = int(sum(mask))
        num_truncated = max(0, len(full) - num_tokens)
        if num_truncated:
            dropped = full[length:] if self.truncation_side == "right" else full[:-length]
            dropped_text = backend.decode(dropped, skip_special_tokens=False)
            if len(dropped_text) > 80:
                dropped_text = dropped_text[:38] + " ... " + dropped_text[-37:]
            logger.warning(
                "The prompt is %d tokens long after the chat template, more than max_sequence_length=%d; "
                "%d tokens were cut off (%r). Shorten the prompt or raise max_sequence_length.",
                len(full),
                length,
                num_truncated,
                dropped_text,
            )
        return TokenizedPrompt(
            input_ids=np.asarray([encoding.ids], dtype=np.int32),
            attention_mask=np.asarray([mask], dtype=np.int32),
            num_tokens=num_tokens,
            num_truncated=num_truncated,
        )


def _loaded_as_processor(folder: Path) -> bool:
    """Whether the pipeline's model_index.json loads this folder as a processor (e.g. ``PixtralProcessor``)."""
    index = folder.parent / "model_index.json"
    if not index.is_file():
        return False
    try:
        entry = json.loads(index.read_text(encoding="utf-8")).get(folder.name)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False
    return isinstance(entry, list) and len(entry) == 2 and str(entry[1]).endswith("Processor")


def _special_tokens(folder: Path, options: dict) -> dict[str, str]:
    """The special tokens transformers passes to the template as variables: the named ones, other ``*_token``
    entries and a dict of ``extra_special_tokens``, from tokenizer_config.json (and the legacy
    special_tokens_map.json, which transformers merges over it when the config lists no added tokens)."""
    merged = dict(options)
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in options and legacy.is_file():
        merged.update(_read_tokenizer_config(legacy))
    out: dict[str, str] = {}
    for key, value in merged.items():
        if key in SPECIAL_TOKEN_NAMES or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                out[key] = text
    extra = merged.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return out


def check_prompt(prompt: str) -> None:
    """A prompt is text with something left once ``[IMG]`` markers are removed (as diffusers removes them)."""
    if not isinstance(prompt, str):
        raise PipelineError(f"prompt must be text, got {type(prompt).__name__}.")
    if not prompt.replace("[IMG]", ""):
        raise PipelineError("the prompt is empty; pass some text with --prompt.")


def _read_tokenizer_config(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        options = json.loads(read_regular_text(path, "the tokenizer config", MAX_JSON_BYTES, CheckpointError))
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: cannot read it as JSON ({exc}); restore it from the checkpoint."
        ) from None
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: expected a JSON object.")
    return options


def _token_text(value) -> str | None:
    """transformers writes special tokens as plain strings or as AddedToken dicts with a ``content`` key."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
