"""Equality saturation under bounds (iterations, e-graph size, wall time), with the reason search stopped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .rules import program_text

if TYPE_CHECKING:
    import egglog.bindings as eb

# egglog (and what it imports) is loaded on first use: a run whose plans come from the plan cache never needs it
# one iteration: layout facts to a fixpoint, then one round of rewrites
_ITERATION = "(run-schedule (seq (saturate (run layout)) (run rewrite)))"


@dataclass(frozen=True)
class Limits:
    max_iterations: int = 32      # rewrite rounds per segment
    max_enodes: int = 400_000     # e-graph size per segment
    time_budget_s: float = 60.0   # the whole search's time (compile_graph shares it out); over it, the best so far


@dataclass
class SaturationReport:
    iterations: int = 0
    stop_reason: str = "not run"  # saturated | iteration_limit | node_limit | time_limit
    enodes: int = 0
    seconds: float = 0.0
    matches: dict[str, int] = field(default_factory=dict)


def _span():
    import egglog.bindings as eb

    return eb.RustSpan(__file__, 0, 0)


def new_egraph(families=None) -> eb.EGraph:
    import egglog.bindings as eb

    egraph = eb.EGraph()
    egraph.run_program(*egraph.parse_program(program_text(families)))
    return egraph


_BASES: dict[tuple, eb.EGraph] = {}


@contextmanager
def scratch_egraph(families=None) -> Iterator[eb.EGraph]:
    """An e-graph with the rules loaded. What is added inside the ``with`` is dropped afterwards (push/pop),
    so the rules are parsed once per process, not once per segment."""
    import egglog.bindings as eb

    from luminal_recipes import memory_limits

    key = program_text(families)  # an edited rule file is a new base
    egraph = _BASES.get(key)
    # egglog (Rust) aborts the process when an allocation fails: refuse first when the limits leave too little
    memory_limits.require_address_space(
        memory_limits.EGGLOG_SEARCH_RESERVE if egraph is not None else memory_limits.EGGLOG_BASE_RESERVE,
        "compiling (the egglog search)", "pass --no-compile to run the naive program, or use the plan cache of a "
        "run made without the limit")
    if egraph is None:
        egraph = _BASES[key] = new_egraph(families)
    egraph.run_program(eb.Push(1))
    try:
        yield egraph
    finally:
        egraph.run_program(eb.Pop(_span(), 1))


def release_egraphs() -> bool:
    """Drop the base e-graphs ``scratch_egraph`` keeps (the next search parses the rules again, ~2 s) and give the
    freed heap back (``heap.trim``): a base keeps the size of the largest search it held (its tables do not
    shrink at ``Pop``), ~140 MiB after SmolLM2-135M's two programs, plus ~200 MiB of freed search scratch malloc
    keeps. For a caller done compiling (a language model once its two programs exist); True when any was held."""
    from luminal_recipes import heap

    held = bool(_BASES)
    _BASES.clear()
    heap.trim()
    return held


def enode_count(egraph: eb.EGraph) -> int:
    import egglog.bindings as eb

    (sizes,) = egraph.run_program(eb.PrintSize(_span(), None))
    return sum(n for _, n in sizes.sizes)


def saturate(egraph: eb.EGraph, limits: Limits = Limits()) -> SaturationReport:
    report = SaturationReport()
    start = time.perf_counter()
    iteration = egraph.parse_program(_ITERATION)
    while True:
        if report.iterations >= limits.max_iterations:
            report.stop_reason = "iteration_limit"
            break
        if time.perf_counter() - start >= limits.time_budget_s:  # checked between rounds (a round is not cut)
            report.stop_reason = "time_limit"
            break
        (out,) = egraph.run_program(*iteration)
        report.iterations += 1
        for rule, n in out.report.num_matches_per_rule.items():
            report.matches[rule] = report.matches.get(rule, 0) + n
        report.enodes = enode_count(egraph)
        if not out.report.updated:
            report.stop_reason = "saturated"
            break
        if report.enodes > limits.max_enodes:
            report.stop_reason = "node_limit"
            break
    report.seconds = time.perf_counter() - start
    return report
