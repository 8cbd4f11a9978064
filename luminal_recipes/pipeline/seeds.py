"""Seeds as users expect them (diffusers draws a random generator, ComfyUI "randomizes"): an omitted seed is drawn
at random (and printed and recorded in the output, so the image can be made again), unless the environment
variable ``LUMINAL_RECIPES_SEED`` gives the default (an integer, e.g. ``0``: the default before seeds were drawn,
when an omitted ``--seed`` meant 0). ``--seed random`` draws one explicitly. A batch of N images
(``--num-images N``) takes the seeds ``seed, seed + 1, ...``, as ComfyUI numbers a batch, so image k of a batch
is made again alone with ``--seed seed+k``.

Text generation samples with the same rule (the seed matters only when sampling: ``--temperature`` above 0)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

from ..errors import InputError

SEED_ENV = "LUMINAL_RECIPES_SEED"
MAX_SEED = 2**64 - 1  # the largest seed numpy's PCG64 (and FLUX.2's noise) takes
RANDOM_BITS = 32  # a drawn seed: short enough to read and type


def draw_seed() -> int:
    """A fresh random seed in [0, 2**32)."""
    return secrets.randbits(RANDOM_BITS)


def parse_seed(value: int | str | None, flag: str = "--seed") -> int | None:
    """A seed as given: an integer (or its text), ``"random"`` (drawn now), or None (the default: the value of
    ``LUMINAL_RECIPES_SEED`` when set, else drawn). InputError naming ``flag`` for anything else."""
    if value is None:
        env = os.environ.get(SEED_ENV)
        if env is None or not env.strip():
            return draw_seed()
        return parse_seed(env.strip(), f"${SEED_ENV}")
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "random":
            return draw_seed()
        try:
            value = int(text, 10)
        except ValueError:
            raise InputError(f"{flag} {value!r}: expected a whole number from 0 to {MAX_SEED}, or `random`") \
                from None
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise InputError(f"{flag} {value!r}: expected a whole number from 0 to {MAX_SEED}, or `random`")
    value = int(value)
    if not 0 <= value <= MAX_SEED:
        raise InputError(f"{flag} {value}: expected a whole number from 0 to {MAX_SEED}, or `random`")
    return value


def batch_seeds(seed: int | str | Sequence[int | str] | None, count: int | None, flag: str = "--seed",
                count_flag: str = "--num-images") -> list[int]:
    """The seeds of a batch: ``count`` consecutive seeds from ``seed`` (parsed as ``parse_seed``), or the given
    list (``count`` must then be its length, or None)."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise InputError(f"{count_flag} {count!r}: expected a whole number >= 1")
    if isinstance(seed, (list, tuple)):
        if not seed:
            raise InputError(f"{flag}: an empty list of seeds; give one seed per image")
        if count is not None and count != len(seed):
            raise InputError(f"{flag}: {len(seed)} seeds for {count_flag} {count}; give one seed per image")
        return [parse_seed(s, f"{flag}[{k}]") for k, s in enumerate(seed)]
    first = parse_seed(seed, flag)
    n = count or 1
    if first + n - 1 > MAX_SEED:
        raise InputError(f"{flag} {first} with {count_flag} {n}: the batch's seeds {first}..{first + n - 1} pass "
                         f"{MAX_SEED}; give a smaller seed")
    return [first + k for k in range(n)]
