"""Text embeddings with encoder recipes (recipes/minilm.yaml): the prompt tokenized as transformers'
``tokenizer(text)`` does, for a model stage that pools and normalises (recipes/bert.yaml)."""

from __future__ import annotations

from collections.abc import Callable

from .encode_text import encode_text

STEPS: dict[str, Callable] = {"encode_text": encode_text}
