"""Choosing the next token on the host, exactly as transformers' ``generate`` processes logits.

The order is transformers' (``GenerationMixin._get_logits_processor``): the repetition penalty (on every token of
the prompt and of the reply so far, for greedy decoding too), then - when sampling - temperature, top-k, top-p;
then the argmax (temperature 0: greedy) or a draw from the softmax. Each processor is transformers' own
arithmetic in float32: ``RepetitionPenaltyLogitsProcessor`` (a logit < 0 is multiplied by the penalty, else
divided), ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (keeps every logit >= the k-th largest),
``TopPLogitsWarper`` (drops the ascending-sorted tokens whose cumulative probability is <= 1 - top_p, always
keeping the most likely). Draws come from a seeded numpy generator: the same seed gives the same reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import InputError


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(flag: str, value, rule: str) -> InputError:
            return InputError(f"{flag} {value}: {rule}")

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise bad("--temperature", self.temperature, "must be a finite number >= 0 (0 = greedy, the default)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("--top-k", self.top_k, "must be a whole number >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise bad("--top-p", self.top_p, "must be in (0, 1] (1 = off); 0 would keep no token")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise bad("--repetition-penalty", self.repetition_penalty, "must be a finite number > 0 (1 = off)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad("--seed", self.seed, "must be a whole number >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: np.ndarray, seen: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """The scores transformers' processors give for last-position ``logits`` [vocab] after the tokens ``seen``
    (prompt and reply so far), as float32; -inf marks a token filtered out."""
    scores = np.array(logits, dtype=np.float32, copy=True)
    penalty = np.float32(settings.repetition_penalty)
    if settings.repetition_penalty != 1.0 and len(seen):
        ids = np.unique(np.asarray(seen, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < scores.shape[-1])]  # a token the head cannot produce is not penalised
        picked = scores[ids]
        scores[ids] = np.where(picked < 0, picked * penalty, picked / penalty)
    if settings.greedy:
        return scores
    if settings.temperature != 1.0:
        scores = scores / np.float32(settings.temperature)
    if settings.top_k:
        k = min(settings.top_k, scores.shape[-1])
        kth = np.partition(scores, -k)[-k]
        scores = np.where(scores < kth, np.float32(-np.inf), scores)
    if settings.top_p < 1.0:
        order = np.argsort(scores, kind="stable")  # ascending
        cumulative = np.cumsum(softmax(scores[order]), dtype=np.float32)
        remove = cumulative <= np.float32(1 - settings.top_p)
        remove[-1] = False  # min_tokens_to_keep = 1
        scores = scores.copy()
        scores[order[remove]] = -np.inf
    return scores


def softmax(scores: np.ndarray) -> np.ndarray:
    """float32 softmax, -inf entries giving 0."""
    shifted = scores - np.max(scores)
    e = np.exp(shifted, dtype=np.float32)
    return e / np.sum(e, dtype=np.float32)


class Sampler:
    """Picks tokens one at a time for one reply; ``settings.seed`` seeds its draws."""

    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray, seen: np.ndarray) -> int:
        if self.settings.greedy and self.settings.repetition_penalty == 1.0 and logits.dtype == np.float32:
            return int(np.argmax(logits))  # what the processors' f32 copy would give, without the copy
        scores = process_logits(logits, seen, self.settings)
        if self.settings.greedy:
            return int(np.argmax(scores))  # the first maximum, as torch.argmax
        probs = softmax(scores).astype(np.float64)
        cumulative = np.cumsum(probs)
        draw = self.rng.random() * cumulative[-1]
        return int(min(np.searchsorted(cumulative, draw, side="right"), len(probs) - 1))
