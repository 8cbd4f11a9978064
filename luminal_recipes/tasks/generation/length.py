"""A reply longer than the context allows: ``max_new_tokens`` beyond the room a prompt leaves is not an error (the
reply stops at the context, as transformers' does at ``max_length``), but it is said, since a huge value would
otherwise run silently to a 32k-token context for minutes."""

from __future__ import annotations

import warnings


class ContextLengthWarning(UserWarning):
    """``max_new_tokens`` exceeds what the context leaves after the prompt."""


def beyond_context(name: str, max_new_tokens: int, prompt_tokens: int, limit: int, limited_by: str) -> str | None:
    """The message when ``max_new_tokens`` exceeds the ``limit - prompt_tokens`` tokens left, else None."""
    room = limit - prompt_tokens
    if max_new_tokens <= room:
        return None
    return (f"max_new_tokens={max_new_tokens} exceeds what the context allows: the {prompt_tokens}-token prompt leaves "
            f"{room} of {name}'s {limit} tokens ({limited_by}), so the reply stops at {room} tokens at most; pass "
            f"max_new_tokens <= {room} (--max-new-tokens) to plan for what will run")


def warn_beyond_context(name: str, max_new_tokens: int, prompt_tokens: int, limit: int, limited_by: str,
                        stacklevel: int = 3) -> None:
    message = beyond_context(name, max_new_tokens, prompt_tokens, limit, limited_by)
    if message is not None:
        warnings.warn(ContextLengthWarning(message), stacklevel=stacklevel)
