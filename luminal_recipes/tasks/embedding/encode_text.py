"""The ``encode_text`` pipeline step: a prompt tokenized exactly as transformers' ``tokenizer(text)`` does (the
checkpoint's own tokenizer.json: normaliser, pre-tokenizer, model and the post-processor's special tokens, such
as BERT's [CLS] ... [SEP]), truncated to ``max_length`` tokens as ``truncation=True`` does (special tokens kept)
and padded with the pad token to ``max_length``, with the attention mask. No chat template: for encoders
(sentence embeddings), whose pipelines tokenize the text as is."""

from __future__ import annotations

import numpy as np
import tokenizers

from ...errors import CheckpointError, PipelineError
from ...pipeline.plugins import StepContext


def encode_text(ctx: StepContext, text: str, max_length: int) -> dict:
    """``input_ids`` and ``attention_mask`` ``[1, max_length]`` (i32), and ``num_tokens`` (the real ones). The
    tokenizer is the checkpoint's (in the pipeline's ``tokenizer.path`` folder when it names one)."""
    from ...text.tokenizer import TextTokenizer

    max_length = int(max_length)
    if max_length < 2:
        raise PipelineError(f"encode_text: max_length is {max_length}; it must be at least 2 tokens")
    section = getattr(ctx.recipe, "tokenizer", None)
    folder = ctx.checkpoint / section.path if section is not None and section.path else ctx.checkpoint
    tok = ctx.shared("embedding.tokenizer", lambda: TextTokenizer.from_checkpoint(folder))
    # a copy of the checkpoint's tokenizer that truncates as transformers does for one sequence: from the right,
    # room kept for the post-processor's special tokens
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.enable_truncation(max_length)
    ids = backend.encode(text).ids
    pad = tok.special_tokens.get("pad_token")
    pad_id = backend.token_to_id(pad) if pad is not None else None
    if pad_id is None:
        raise CheckpointError(f"{tok.folder}: the tokenizer has no pad token (pad_token in tokenizer_config.json); "
                              "encode_text pads every prompt to max_length with it")
    input_ids = np.full((1, max_length), pad_id, dtype=np.int32)
    attention_mask = np.zeros((1, max_length), dtype=np.int32)
    input_ids[0, :len(ids)] = ids
    attention_mask[0, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "num_tokens": len(ids)}
