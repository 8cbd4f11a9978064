"""The regular expressions a recipe writes (``weights.rename``/``split``/``stack``/``transpose``/``ignore`` and a
LoRA convention's rules), run with a time budget.

A recipe may come from anyone, and a regex such as ``([\\w.]|[\\w.])*Z`` backtracks for hours on a long tensor
name. These rules need capture groups (``to: '\\1.weight'``), which a linear-time automaton does not give, so
they run on the ``regex`` engine (the same syntax and results as Python's ``re``), whose matching can be
stopped: each pattern may spend ``BUDGET_S`` seconds in all, across every name it is matched against in this
process (an ordinary pattern spends microseconds per name), and past that the run stops with an error naming
the pattern and the name it was working on.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

import regex

from ..errors import RecipeError

BUDGET_S = 5.0  # per pattern, per process: the whole of FLUX.2-dev's names through every rule takes milliseconds
Match = regex.Match
ERRORS = (re.error, regex.error, IndexError)  # a bad pattern or a replacement naming a group it lacks


@dataclass
class _Rule:
    compiled: regex.Pattern
    spent: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


_RULES: dict[str, _Rule] = {}


def compile_pattern(pattern: str) -> regex.Pattern:
    """``pattern`` compiled by the engine the rules run on; ``regex.error`` if it is not a regular expression."""
    rule = _RULES.get(pattern)
    if rule is None:
        rule = _RULES[pattern] = _Rule(regex.compile(pattern))
    return rule.compiled


def _run(pattern: str, text: str, call):
    compile_pattern(pattern)
    rule = _RULES[pattern]
    left = BUDGET_S - rule.spent
    start = time.perf_counter()
    try:
        if left <= 0:
            raise TimeoutError
        return call(rule.compiled, left)
    except TimeoutError:
        raise RecipeError(
            f"the recipe's regex '{pattern}' took more than {BUDGET_S:g} s matching tensor names (last "
            f"'{text[:120]}'): it backtracks without end, as a repetition inside a repetition does ('(a|aa)+', "
            f"'([\\w.]|[\\w.])*'). Write it with one repetition per part (e.g. '[\\w.]*').") from None
    finally:
        with rule.lock:
            rule.spent += time.perf_counter() - start


def fullmatch(pattern: str, text: str) -> regex.Match | None:
    return _run(pattern, text, lambda p, left: p.fullmatch(text, timeout=left))


def match(pattern: str, text: str) -> regex.Match | None:
    return _run(pattern, text, lambda p, left: p.match(text, timeout=left))


def sub(pattern: str, replacement: str, text: str) -> str:
    return _run(pattern, text, lambda p, left: p.sub(replacement, text, timeout=left))
