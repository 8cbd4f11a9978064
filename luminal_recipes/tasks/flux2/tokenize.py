"""Prompt -> token ids for FLUX.2's text encoders, exactly as diffusers' FLUX.2 pipelines make them.

``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` (FLUX.2 [dev], the ``flux2`` conversation) formats the prompt
as a conversation (its system message, then the user prompt with any ``[IMG]`` removed, each as one text content
block), renders it with the checkpoint's own chat template (``apply_chat_template``, ``add_generation_prompt=False``),
tokenizes the text without adding special tokens (a processor adds them unless the text starts with the BOS token),
truncates to ``max_sequence_length`` and pads to it with the pad token, with an attention mask of 1 on real tokens.
``Flux2KleinPipeline._get_qwen3_prompt_embeds`` (FLUX.2 [klein], the ``user`` conversation) renders one user
message whose content is the prompt, with ``add_generation_prompt=True`` and ``enable_thinking=False``, and
tokenizes it as ``tokenizer(text)`` does (special tokens added), padded and truncated the same way. A pipeline
recipe's ``tokenizer:`` section says which (``conversation``, ``generation_prompt``, ``template_args``,
``add_special_tokens``) and may replace the template or the system message (``chat_template``, ``system``). A
``flux2`` checkpoint without any template gets the FLUX.2-dev rendering, with a warning naming it; a ``user`` one
is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from os import PathLike

import numpy as np
import tokenizers

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.text.check import check_text
from luminal_recipes.text.tokenizer import Tokenizer, check_length, read_tokenizer

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


def user_messages(prompt: str) -> list[dict]:
    """Flux2KleinPipeline's conversation: one user message whose content is the prompt (a string)."""
    return [{"role": "user", "content": prompt}]


CONVERSATIONS = {"flux2", "user"}


@dataclass(frozen=True)
class TokenizedPrompt:
    """One padded prompt: ``input_ids`` and ``attention_mask`` are int32, shape (1, max_sequence_length)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    num_tokens: int  # real (unpadded) tokens kept
    num_truncated: int  # tokens cut off at max_sequence_length


class Flux2Tokenizer(Tokenizer):
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
        conversation: str = "flux2",
        generation_prompt: bool = False,
        template_args: dict | None = None,
        add_special_tokens: bool | None = None,
    ):
        special = special_tokens if special_tokens is not None else {"bos_token": "<s>", "pad_token": "<pad>"}
        super().__init__(tokenizer, chat_template, special, padding_side, truncation_side, processor, source,
                         template_source)
        if conversation not in CONVERSATIONS:
            raise PipelineError(f"unknown conversation {conversation!r}; one of {', '.join(sorted(CONVERSATIONS))}")
        self.system_message = system_message
        self.conversation = conversation
        self.generation_prompt = bool(generation_prompt)
        self.template_args = dict(template_args or {})
        self.always_add_special_tokens = add_special_tokens
        if self.pad_token_id is None:
            what = "names no pad token" if self.pad_token is None else f"has no {self.pad_token!r} token"
            raise CheckpointError(
                f"{source}: the tokenizer {what}; Flux2Pipeline pads every prompt to max_sequence_length with it "
                "(copy tokenizer/ from the original checkpoint)."
            )

    @classmethod
    def from_pretrained(
        cls,
        folder: str | PathLike,
        chat_template: str | None = None,
        system_message: str | None = None,
        processor: bool | None = None,
        conversation: str = "flux2",
        generation_prompt: bool = False,
        template_args: dict | None = None,
        add_special_tokens: bool | None = None,
    ) -> Flux2Tokenizer:
        """Load from a checkpoint's ``tokenizer/`` folder (or the checkpoint folder that contains it).

        ``chat_template`` replaces the checkpoint's template (a Jinja template, or the name of one of its named
        templates), ``system_message`` diffusers' system message. ``processor``: whether the pipeline loads this
        folder as a processor (default: as model_index.json next to it says). ``conversation``,
        ``generation_prompt``, ``template_args`` and ``add_special_tokens`` are the pipeline recipe's tokenizer
        options (see the module docstring).
        """
        files = read_tokenizer(folder, chat_template, processor)
        special = dict(files.special_tokens)
        template, template_source = files.chat_template, files.template_source
        if template is None and conversation != "flux2":
            raise CheckpointError(
                f"{files.source}: the tokenizer has no chat template (chat_template.jinja, or chat_template in "
                "tokenizer_config.json), and this pipeline renders the prompt with the checkpoint's own template; "
                "copy the tokenizer folder from the original checkpoint, or set tokenizer.chat_template in the "
                "pipeline recipe."
            )
        if template is None:
            logger.warning(
                "%s has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
                "using %s. Add the checkpoint's template, or set tokenizer.chat_template in the pipeline recipe.",
                files.source,
                FALLBACK_NAME,
            )
            template, template_source = FALLBACK_TEMPLATE, FALLBACK_NAME
            special.setdefault("bos_token", "<s>")
        return cls(
            files.tokenizer,
            chat_template=template,
            special_tokens=special,
            padding_side=files.padding_side,
            truncation_side=files.truncation_side,
            system_message=SYSTEM_MESSAGE if system_message is None else system_message,
            processor=files.processor,
            source=files.source,
            template_source=template_source,
            conversation=conversation,
            generation_prompt=generation_prompt,
            template_args=template_args,
            add_special_tokens=add_special_tokens,
        )

    def messages(self, prompt: str) -> list[dict]:
        """The conversation diffusers builds for ``prompt``."""
        if self.conversation == "user":
            return user_messages(prompt)
        return flux2_messages(prompt, self.system_message)

    def format(self, prompt: str) -> str:
        """The chat-template rendering of ``prompt`` (diffusers' conversation + the checkpoint's template)."""
        return self.render(self.messages(prompt), self.generation_prompt, self.template_args)

    def check(self, prompt: str, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
              allow_empty: bool = False) -> None:
        """Refuse what ``__call__`` would refuse (the prompt, the template's rendering of it, its encoding), without
        the warning a truncated prompt gets: the check the driver runs for every prompt before any work."""
        self._encode(prompt, max_sequence_length, allow_empty)

    def _encode(self, prompt: str, max_sequence_length: int, allow_empty: bool):
        if not allow_empty:
            check_prompt(prompt)
        elif not isinstance(prompt, str):
            raise PipelineError(f"prompt must be text, got {type(prompt).__name__}.")
        else:
            check_text(prompt, "the prompt", PipelineError)
        length = check_length(max_sequence_length, "max_sequence_length")
        text = self.format(prompt)
        return self.encode(text, length, add_special_tokens=self.add_special_tokens(text)), length

    def add_special_tokens(self, text: str) -> bool:
        if self.always_add_special_tokens is not None:
            return self.always_add_special_tokens
        return super().add_special_tokens(text)

    def __call__(
        self, prompt: str, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH, allow_empty: bool = False
    ) -> TokenizedPrompt:
        """``allow_empty``: the prompt may be empty (the negative prompt "" of classifier-free guidance)."""
        encoded, length = self._encode(prompt, max_sequence_length, allow_empty)
        num_tokens = encoded.num_tokens
        num_truncated = max(0, len(encoded.untruncated) - num_tokens)
        if num_truncated:
            dropped_text = self.decode(self.dropped(encoded, length), skip_special_tokens=False)
            if len(dropped_text) > 80:
                dropped_text = dropped_text[:38] + " ... " + dropped_text[-37:]
            logger.warning(
                "The prompt is %d tokens long after the chat template, more than max_sequence_length=%d; "
                "%d tokens were cut off (%r). Shorten the prompt or raise max_sequence_length.",
                len(encoded.untruncated),
                length,
                num_truncated,
                dropped_text,
            )
        return TokenizedPrompt(
            input_ids=np.asarray([encoded.ids], dtype=np.int32),
            attention_mask=np.asarray([encoded.attention_mask], dtype=np.int32),
            num_tokens=num_tokens,
            num_truncated=num_truncated,
        )


def check_prompt(prompt: str) -> None:
    """A prompt is text with something left once ``[IMG]`` markers are removed (as diffusers removes them)."""
    if not isinstance(prompt, str):
        raise PipelineError(f"prompt must be text, got {type(prompt).__name__}.")
    check_text(prompt, "the prompt", PipelineError)
    if not prompt.replace("[IMG]", ""):
        raise PipelineError("the prompt is empty; pass some text with --prompt.")
