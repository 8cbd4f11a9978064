"""Host sampling against transformers' own logits processors (same order, same float32 arithmetic), and seeded
draws that only ever pick tokens the processors kept."""

from __future__ import annotations

import numpy as np
import pytest

from luminal_recipes.errors import InputError
from luminal_recipes.tasks.generation.sampling import Sampler, SamplingSettings, process_logits, softmax

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")


def transformers_scores(logits, seen, s: SamplingSettings) -> np.ndarray:
    """transformers' _get_logits_processor order: repetition penalty, then (sampling) temperature, top-k, top-p."""
    processors = []
    if s.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(float(s.repetition_penalty)))
    if not s.greedy:
        if s.temperature != 1.0:
            processors.append(lp.TemperatureLogitsWarper(float(s.temperature)))
        if s.top_k:
            processors.append(lp.TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            processors.append(lp.TopPLogitsWarper(s.top_p))
    scores = torch.tensor(logits[None], dtype=torch.float32)
    ids = torch.tensor([seen], dtype=torch.long)
    for p in processors:
        scores = p(ids, scores)
    return scores[0].numpy()


SETTINGS = [
    SamplingSettings(),
    SamplingSettings(repetition_penalty=1.3),
    SamplingSettings(temperature=0.7),
    SamplingSettings(temperature=1.0, top_k=5),
    SamplingSettings(temperature=1.3, top_p=0.8),
    SamplingSettings(temperature=0.9, top_k=20, top_p=0.5, repetition_penalty=1.2),
    SamplingSettings(temperature=1.0, top_k=1),
    SamplingSettings(temperature=2.0, top_p=0.01),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_processed_scores_are_transformers(settings):
    rng = np.random.default_rng(0)
    for trial in range(20):
        logits = (rng.standard_normal(64) * 3).astype(np.float32)
        seen = rng.integers(0, 64, size=10).tolist()
        got = process_logits(logits, np.asarray(seen), settings)
        want = transformers_scores(logits, seen, settings)
        assert np.array_equal(np.isinf(got), np.isinf(want)), trial
        assert np.array_equal(got[np.isfinite(got)], want[np.isfinite(want)]), trial


def test_greedy_is_the_first_maximum_of_the_penalised_logits():
    logits = np.array([1.0, 3.0, 3.0, -2.0], np.float32)
    assert Sampler(SamplingSettings())(logits, np.array([], np.int64)) == 1
    # penalty 2: 3 -> 1.5 for token 1 (seen); token 2 wins
    assert Sampler(SamplingSettings(repetition_penalty=2.0))(logits, np.array([1])) == 2


def test_draws_are_seeded_and_follow_the_kept_distribution():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(16).astype(np.float32)
    settings = SamplingSettings(temperature=1.0, top_k=6, seed=7)
    draws = [Sampler(settings)(logits, np.array([])) for _ in range(3)]
    assert len(set(draws)) == 1  # one seed, one first draw
    sampler = Sampler(settings)
    counts = np.bincount([sampler(logits, np.array([])) for _ in range(4000)], minlength=16)
    probs = softmax(process_logits(logits, np.array([]), settings))
    assert set(np.nonzero(counts)[0]) <= set(np.nonzero(probs)[0])
    assert np.abs(counts / counts.sum() - probs).max() < 0.03


@pytest.mark.parametrize("kwargs, flag", [
    ({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p"), ({"temperature": -1.0}, "--temperature"),
    ({"top_k": -1}, "--top-k"), ({"repetition_penalty": 0.0}, "--repetition-penalty"), ({"seed": -3}, "--seed"),
    ({"temperature": float("nan")}, "--temperature"),
])
def test_bad_settings_name_their_flag(kwargs, flag):
    with pytest.raises(InputError, match=flag):
        SamplingSettings(**kwargs)
