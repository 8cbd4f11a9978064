"""Flux2Tokenizer against the ids and mask diffusers' Flux2Pipeline feeds its text encoder."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as DIFFUSERS_SYSTEM_MESSAGE
from transformers import PreTrainedTokenizerFast

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.pipeline.tokenize import SYSTEM_MESSAGE, Flux2Tokenizer

CHECKPOINT = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny" / "checkpoint"

PROMPTS = [
    "a cat",
    "  A red fox in the snow,\n\tlooking left.  ",
    "Ein Fuchs 🦊 im Schnee — 雪の中の狐, 1234567 ünïcödé",
    "[IMG]a cat[IMG] wearing [INST]a hat[/INST] </s> <pad>",
    "x",
]
LONG_PROMPT = " ".join(f"word{i} and a fluffy purple cat number {i}" for i in range(120))


class RecordingTextEncoder:
    """Stands in for Mistral3ForConditionalGeneration: records what diffusers passes it."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __call__(self, input_ids, attention_mask, **kwargs):
        self.input_ids, self.attention_mask = input_ids, attention_mask
        hidden = torch.zeros(*input_ids.shape, 4)
        return SimpleNamespace(hidden_states=[hidden])


def diffusers_ids(tokenizer, prompt: str, max_sequence_length: int):
    encoder = RecordingTextEncoder()
    Flux2Pipeline._get_mistral_3_small_prompt_embeds(
        text_encoder=encoder,
        tokenizer=tokenizer,
        prompt=prompt,
        max_sequence_length=max_sequence_length,
        hidden_states_layers=(0,),
    )
    return encoder.input_ids.numpy(), encoder.attention_mask.numpy()


@pytest.fixture(scope="module")
def hf_tokenizer():
    # The class model_index.json names, loaded the way DiffusionPipeline.from_pretrained loads it.
    return PreTrainedTokenizerFast.from_pretrained(CHECKPOINT / "tokenizer")


@pytest.fixture(scope="module")
def ours():
    return Flux2Tokenizer.from_pretrained(CHECKPOINT / "tokenizer")


def assert_same(tokenized, reference):
    ids, mask = reference
    assert tokenized.input_ids.shape == ids.shape and tokenized.attention_mask.shape == mask.shape
    np.testing.assert_array_equal(tokenized.input_ids, ids)
    np.testing.assert_array_equal(tokenized.attention_mask, mask)
    assert tokenized.num_tokens == int(mask.sum())


def test_system_message_is_diffusers():
    assert SYSTEM_MESSAGE == DIFFUSERS_SYSTEM_MESSAGE


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_sequence_length", [512, 77])
def test_ids_and_mask_match_diffusers(ours, hf_tokenizer, prompt, max_sequence_length):
    tokenized = ours(prompt, max_sequence_length=max_sequence_length)
    assert_same(tokenized, diffusers_ids(hf_tokenizer, prompt, max_sequence_length))
    assert tokenized.input_ids.dtype == np.int32 and tokenized.input_ids[0, 0] == 1  # <s>
    if tokenized.num_tokens < max_sequence_length:
        assert tokenized.input_ids[0, -1] == ours.pad_token_id == 11


def test_template_rendering_matches_the_checkpoint_template(ours, hf_tokenizer):
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    for prompt in PROMPTS:
        rendered = hf_tokenizer.apply_chat_template(format_input([prompt])[0], tokenize=False)
        assert ours.format(prompt) == rendered


def test_long_prompt_is_truncated_with_a_warning(ours, hf_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="luminal_recipes.pipeline.tokenize"):
        tokenized = ours(LONG_PROMPT, max_sequence_length=512)
    assert_same(tokenized, diffusers_ids(hf_tokenizer, LONG_PROMPT, 512))
    assert tokenized.num_tokens == 512 and tokenized.num_truncated > 0
    full = len(hf_tokenizer(ours.format(LONG_PROMPT), add_special_tokens=False)["input_ids"])
    assert tokenized.num_truncated == full - 512
    assert (
        "max_sequence_length=512" in caplog.text
        and f"{tokenized.num_truncated} tokens were cut off" in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="luminal_recipes.pipeline.tokenize"):
        ours("a cat")
    assert caplog.text == ""


def test_tokenizer_config_sides_are_honoured(tmp_path, ours):
    folder = tmp_path / "tokenizer"
    shutil.copytree(CHECKPOINT / "tokenizer", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(padding_side="left", truncation_side="left")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    left = Flux2Tokenizer.from_pretrained(tmp_path)  # the checkpoint folder works too
    for prompt, length in [("a cat", 64), (LONG_PROMPT, 128)]:
        assert_same(left(prompt, length), diffusers_ids(hf, prompt, length))
    assert left("a cat", 64).input_ids[0, 0] == 11 and left("a cat", 64).attention_mask[0, 0] == 0
    assert left(LONG_PROMPT, 128).input_ids[0, -1] == 4  # [/INST] survives left truncation


@pytest.mark.parametrize("prompt", ["", "[IMG]", None, 3])
def test_bad_prompts(ours, prompt):
    with pytest.raises(PipelineError, match="prompt"):
        ours(prompt)


@pytest.mark.parametrize("length", [0, -1, 2.0, True])
def test_bad_lengths(ours, length):
    with pytest.raises(PipelineError, match="max_sequence_length"):
        ours("a cat", max_sequence_length=length)


def test_bad_tokenizer_folders(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: file not found"):
        Flux2Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a valid tokenizers file"):
        Flux2Tokenizer.from_pretrained(tmp_path)
    shutil.copy(CHECKPOINT / "tokenizer" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<nope>"}))
    with pytest.raises(CheckpointError, match="no '<nope>' token"):
        Flux2Tokenizer.from_pretrained(tmp_path)


def test_checkpoint_tokenizer_is_mistral_tekken(ours):
    """The committed tokenizer.json against mistral-common's own Tekken code (an independent reference)."""
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tekken = Tekkenizer.from_file(Path(mistral_common.__file__).parent / "data" / "tekken_240911.json")
    for text in [
        *PROMPTS[:3],
        LONG_PROMPT,
        SYSTEM_MESSAGE,
        "naïve café 東京 \u00a0tabs\tand\nnewlines 3.14159",
    ]:
        expected = tekken.encode(text, bos=False, eos=False)
        assert ours.backend.encode(text, add_special_tokens=False).ids == expected
    for token in ["<s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]:
        assert ours.backend.token_to_id(token) == tekken.get_special_token(token)
    assert ours.backend.get_vocab_size() == tekken.n_words == 131072
