"""Tiny language-model checkpoints (saved by transformers, real tokenizers) shared by a test module."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint folder, transformers model) of a 2-layer Llama with a byte-level BPE tokenizer and a chat
    template."""
    from generation_checkpoints import save_llama

    folder = tmp_path_factory.mktemp("llama")
    return folder, save_llama(folder, seed=0)


@pytest.fixture(scope="module")
def llama_lm(llama):
    from generation_checkpoints import RECIPES

    from luminal_recipes.tasks.generation import LanguageModel

    model = LanguageModel(RECIPES / "llama.yaml", weights=llama[0])
    yield model
    model.release()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(checkpoint folder, transformers model): a 2-layer Mistral with an 8-position sliding window and the Tekken
    tokenizer."""
    from generation_checkpoints import save_mistral

    folder = tmp_path_factory.mktemp("mistral")
    return folder, save_mistral(folder, seed=1)
