"""Text embeddings with encoder recipes (recipes/minilm.yaml): the prompt tokenized as transformers'
``tokenizer(text)`` does, for a model stage that pools and normalises (recipes/bert.yaml)."""

from __future__ import annotations

from collections.abc import Callable

from .encode_text import encode_text


def check_encode_text(ctx, **inputs) -> None:
    """What ``encode_text`` refuses, refused for every prompt before any work (``CHECKS``): tokenizing is cheap,
    so the check is the step itself, its result dropped."""
    encode_text(ctx, **inputs)


STEPS: dict[str, Callable] = {"encode_text": encode_text}
CHECKS: dict[str, Callable] = {"encode_text": check_encode_text}
