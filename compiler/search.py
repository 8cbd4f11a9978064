"""The search: graph -> segments -> e-graphs -> candidate programs -> memory check -> cost -> measurement.

``compile_graph`` is the compiler's entry point. For every distinct segment (repeated blocks once) it lowers
the segment into an e-graph, saturates it under bounds, and extracts several candidate programs: the cheapest
by the analytic cost model, the naive primitive program, and cost-aware random variants (seeded). Candidate
``i`` of the whole graph takes candidate ``i`` of every segment. When a run is small enough to measure, each
distinct segment's few cheapest candidates are timed on their own (a block repeated 30 times is timed once, on
the values it gets in the whole graph), and the program made of every segment's fastest is one more candidate;
a whole candidate's measured time is the sum of its segments' (graphs with states, e.g. a KV cache, time whole
candidates instead). Candidates whose planned peak memory exceeds the budget are dropped; among the rest the
fastest measured wins, else the cheapest by the cost model. The search has a time budget
(``Limits.time_budget_s``, checked between rewrite rounds): past it, segments not yet rewritten keep their
primitive programs, candidates are not timed, and the best program found so far is returned with a warning and
``report["time_limited"]``. The result is cached on disk, keyed on
the graph, the dims (a size bucket's), the runtime and device, the package versions, and the hashes of the rule
texts, the kernel registry and the kernel implementations (``fingerprint.py``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from luminal_recipes import instrument
from luminal_recipes.errors import BudgetError, UnboundDimError
from luminal_recipes.graph.core import Graph
from luminal_recipes.graph.dtypes import DType
from luminal_recipes.graph.view import View
from luminal_recipes.runtimes.kernels import REGISTRY
from luminal_recipes.runtimes.program import Program

from . import cache
from .cost import CPU, Machine, bind, numel, program_cost
from .fingerprint import plan_fingerprints
from .rules import FAMILIES
from .saturate import Limits
from .segments import ASSEMBLY, Segment, assemble, split


@dataclass(frozen=True)
class SearchOptions:
    seed: int = 0
    candidates: int = 6               # programs extracted per segment: cheapest, naive, then random variants
    noise: float = 1.5                # spread of the random variants' cost noise (log scale)
    time_top: int = 3                 # how many of the cheapest fitting candidates are timed
    time_within: float = 1.5          # ...among those the cost model puts within this factor of the cheapest
    time_min_share: float = 0.03      # ...in segments weighing at least this share of the program's estimate
    timing_repeats: int = 2           # timed runs (at least) per segment candidate, after one warm-up run;
                                      # the fastest counts (segments are small: up to 5 runs while under 10 ms)
    max_timing_bytes: int = 512 << 20  # time candidates only when a run touches less than this
    timing_budget_s: float = 2.0       # timing of one graph's candidates stays within this (the segments that
                                       # weigh most in the program are timed first; the rest: the cost model)
    time_margin: float = 0.05          # a timed candidate displaces the cost model's choice only when it is
                                       # this much faster (a shared machine's noise is not a reason to switch)
    limits: Limits = field(default_factory=Limits)
    families: tuple[str, ...] = FAMILIES
    machine: Machine | None = None     # cost-model constants; default: the runtime's own (``runtime.machine``)
    use_cache: bool = True


@dataclass
class CompiledPlan:
    program: Program
    report: dict


def compile_graph(graph: Graph, runtime=None, dims: Mapping[str, int] | None = None,
                  budget_bytes: int | None = None, inputs: Mapping[str, np.ndarray] | None = None,
                  weights=None, options: SearchOptions | None = None) -> CompiledPlan:
    """Compile ``graph`` for ``runtime`` (its kernels, its memory planner, its timer) within ``budget_bytes``.

    ``inputs``/``weights`` are used to time candidates; without them, seeded random values of the declared
    shapes stand in (values do not change the speed of these kernels).
    """
    options = options or SearchOptions()
    dims = dict(dims or {})
    missing = sorted(graph.symbols() - set(dims))
    if missing:
        wanted = ", ".join(f"{m!r}: ..." for m in missing)
        raise UnboundDimError(
            f"compile_graph: symbolic dimension(s) {', '.join(missing)} need representative values to plan "
            f"memory and rank candidates; pass dims={{{wanted}}} (e.g. the largest size of the bucket being "
            f"compiled)"
        )
    started = time.perf_counter()
    if options.machine is None:
        options = replace(options, machine=getattr(runtime, "machine", None) or CPU)
    runtime_name = getattr(runtime, "name", "none")
    device = getattr(runtime, "device", "none")
    kernels = set(runtime.capabilities()) if runtime is not None else set(REGISTRY)
    key = cache.plan_key(graph, runtime_name, device, dims, {
        "budget": budget_bytes, "kernels": sorted(kernels), "assembly": ASSEMBLY,
        "target": getattr(runtime, "target", None),  # a plan's memory figures depend on the kernels' path
        "options": {k: v for k, v in asdict(options).items() if k != "use_cache"},
        **plan_fingerprints(runtime, options.families),  # rule texts, kernel registry, kernel implementations
    })
    if options.use_cache:
        hit = cache.load(key, graph, dims, kernels)  # checked against this graph and bucket before use
        if hit is not None:
            instrument.count(instrument.PLAN_CACHE_HIT)
            program, report = hit
            report = dict(report, cache="hit", seconds=time.perf_counter() - started)
            program.meta.update(report.get("chosen", {}))
            return CompiledPlan(program, report)

    instrument.count(instrument.SEARCH)
    from .extract import signature  # (the search's modules load egglog: imported only when searching)

    segments = split(graph)
    searched: dict[str, tuple[list[Program], dict]] = {}
    deadline = started + options.limits.time_budget_s  # one time budget for the whole search
    for seg in segments:
        if seg.key not in searched:
            # past the deadline a segment is not rewritten at all: its candidates are its primitive programs
            left = replace(options.limits, time_budget_s=max(0.0, deadline - time.perf_counter()))
            searched[seg.key] = search_segment(seg, kernels.__contains__, dims, replace(options, limits=left))
    count = max(len(progs) for progs, _ in searched.values()) if searched else 1
    candidates: list[Program] = []
    seen = set()
    for i in range(count):
        picks = {key: min(i, len(progs) - 1) for key, (progs, _) in searched.items()}
        program = assemble(graph, segments, [searched[s.key][0][picks[s.key]] for s in segments])
        program.meta["templates"] = picks
        sig = signature(program)
        if sig in seen:
            continue
        seen.add(sig)
        program.meta["candidate"] = i
        candidates.append(program)

    costs: dict = {}  # kernel call -> estimated seconds, shared by the candidates
    # each distinct segment's best candidates are timed on their own (a repeated block once, not once per copy
    # in every whole-program candidate); the program of every segment's fastest is one more candidate
    # (a graph with states - a KV cache - has its whole candidates timed instead: a state carries values from
    # one run to the next, which a segment run on its own does not see)
    stateful = bool(graph.inputs("state"))
    busy: dict[str, str] = {}  # why timings were left out (``_busy``), where they were
    timing = {} if stateful or time.perf_counter() >= deadline else \
        _time_segments(runtime, graph, segments, searched, candidates[0], dims, inputs, weights, options, costs, busy)
    for seg_key, times in timing.items():  # what each segment's candidates measured, in the report
        names = searched[seg_key][1]["candidates"]
        searched[seg_key][1]["timed_ms"] = {names[i]: round(t * 1e3, 4) for i, t in times.items()}
    fastest = _fastest_segments(graph, segments, searched, timing, options.time_margin)
    if fastest is not None and signature(fastest) not in seen:
        fastest.meta["candidate"] = len(candidates)
        candidates.append(fastest)
    rows = [_assess(runtime, p, dims, options.machine, costs) for p in candidates]
    for program, row in zip(candidates, rows):
        measured = _measured(segments, searched, timing, program.meta.pop("templates", None))
        if measured is not None:
            row["measured_s"] = measured
    fitting = [(p, r) for p, r in zip(candidates, rows) if budget_bytes is None or r["peak"] is None
               or r["peak"] <= budget_bytes]
    if not fitting:
        smallest = min(r["peak"] for r in rows)
        raise BudgetError(
            f"no compiled program fits the memory budget of {_gib(budget_bytes)}: the smallest of the "
            f"{len(rows)} candidates needs {_gib(smallest)} (weights "
            f"{_gib(min(rows, key=lambda r: r['peak'])['weight_bytes'])}); raise the budget "
            f"(e.g. --max-memory) "
            f"to at least {_gib(smallest)}, or use a smaller model or input size"
        )
    fitting.sort(key=lambda pr: pr[1]["cost_s"])
    chosen, how = fitting[0], "cost model"
    timed = [(p, r) for p, r in fitting if "measured_s" in r]
    if stateful and time.perf_counter() < deadline:
        timed = _time_candidates(runtime, graph, fitting, dims, inputs, weights, options, busy)
    if len(timed) > 1:  # the cost model's choice stays unless a timed candidate is clearly faster
        measured = {id(p): r["measured_s"] for p, r in timed}
        pick = _clear_winner(measured, id(chosen[0]), options.time_margin)
        chosen, how = next(pr for pr in timed if id(pr[0]) == pick), "measured"
    program, row = chosen
    cut = [r["segment"] for _, r in searched.values() if r["saturation"]["stop_reason"] == "time_limit"]
    report = {
        "cache": "miss",
        "seconds": time.perf_counter() - started,
        "segments": len(segments),
        "distinct_segments": len(searched),
        "search": {k[:12]: r for k, (_, r) in searched.items()},
        "stop_reasons": sorted({r["saturation"]["stop_reason"] for _, r in searched.values()}),
        "candidates": rows,
        "chosen": dict(row, selected_by=how),
        "budget_bytes": budget_bytes,
        # the search ran past its time budget: the program is the best found by then, and the report says so
        "time_limited": bool(cut),
    }
    if busy:  # timings on a busy machine measure its other work: the cost model chose
        report["timing_skipped"] = busy["why"]
    program.meta.update(report["chosen"])
    if cut:
        warnings.warn(
            f"the compiler's search stopped at its time budget of {options.limits.time_budget_s:g} s "
            f"({len(cut)} of {len(searched)} distinct segments not fully rewritten, e.g. {cut[0]}); using the best "
            f"program found so far. It is cached like any plan; `luminal-recipe cache clear` "
            f"searches again.", stacklevel=2)
    if options.use_cache:
        cache.store(key, program, report)
    return CompiledPlan(program, report)


def search_segment(seg: Segment, allowed, dims: Mapping[str, int],
                   options: SearchOptions) -> tuple[list[Program], dict]:
    """Candidate programs for one standalone segment graph, and what the search did."""
    from .extract import PRIMITIVE_KERNELS, Snapshot, choose, local_costs, noisy, signature, to_program
    from .lower import lower
    from .saturate import saturate, scratch_egraph

    started = time.perf_counter()
    with scratch_egraph(options.families) as egraph:
        lower(seg.graph, egraph, uses=seg.uses)
        sat = saturate(egraph, options.limits)
        snap = Snapshot.of(egraph)
    machine = options.machine or CPU
    base = local_costs(snap, dims, machine, allowed)
    naive = local_costs(snap, dims, machine, lambda k: allowed(k) and k in PRIMITIVE_KERNELS)
    rng = np.random.default_rng([options.seed, int(seg.key[:8], 16)])
    strategies = [("cheapest", base), ("naive", naive)]
    strategies += [(f"random{i}", noisy(base, rng, options.noise)) for i in range(options.candidates - 2)]
    programs, names, seen = [], [], set()
    for name, costs in strategies:
        choice, _ = choose(snap, costs)
        program = to_program(snap, choice, seg.graph, seg.graph.outputs)
        sig = signature(program)
        if sig in seen:
            continue
        seen.add(sig)
        program.meta["strategy"] = name
        programs.append(program)
        names.append(name)
    report = {
        "segment": seg.name,
        "nodes": len(seg.graph.nodes),
        "saturation": asdict(sat),
        "eclasses": len(snap.sort),
        "enodes": len(snap.nodes),
        "candidates": names,
        "seconds": time.perf_counter() - started,
    }
    report["saturation"].pop("matches")
    report["rules_fired"] = {r: n for r, n in sorted(sat.matches.items()) if n}
    return programs, report


def _assess(runtime, program: Program, dims, machine: Machine, costs: dict | None = None) -> dict:
    row = {"candidate": program.meta.get("candidate"), "kernels": program.kernel_counts(),
           "cost_s": program_cost(program, dims, machine, costs), "peak": None, "weight_bytes": None,
           "activation_peak": None}
    plan = _plan_memory(runtime, program, dims)
    if plan is not None:
        row.update(peak=plan.peak, weight_bytes=plan.weight_bytes, activation_peak=plan.activation_peak)
    return row


def _plan_memory(runtime, program: Program, dims):
    if runtime is not None and hasattr(runtime, "plan"):
        return runtime.plan(program, dims)
    from luminal_recipes.runtimes.memory import plan_memory

    return plan_memory(program, dims)


def _run_bytes(program: Program, dims) -> int:
    return sum(numel(n.shape, dims) * n.dtype.bits // 8 for n in program.nodes)


def _time_segments(runtime, graph: Graph, segments: list[Segment], searched: dict, first: Program, dims,
                   inputs, weights, options: SearchOptions, costs: dict,
                   busy: dict | None = None) -> dict[str, dict[int, float]]:
    """Per distinct segment: seconds per run of its best candidates (index in its program list), each timed on
    its own standalone graph. Only the ``time_top`` cheapest by the cost model within ``time_within`` of the
    cheapest are timed, and only segments with two such candidates; a segment is timed once, however often it
    repeats. Its operands are the values it gets in the whole graph (its first occurrence), from one run of the
    whole program ``first`` on the graph's inputs and weights (seeded random stand-ins where not given): kernels
    may skip work by value (attention skips fully masked blocks), so a mask must be a mask."""
    # an emulator's or an offline planner's times say nothing of the device (``timed``): the cost model decides
    if runtime is None or not hasattr(runtime, "time") or not getattr(runtime, "timed", True) \
            or options.time_top <= 0 or _run_bytes(first, dims) > options.max_timing_bytes:
        return {}
    machine = options.machine or CPU
    tops = {}
    for key, (programs, _) in searched.items():
        ranked = sorted(range(len(programs)), key=lambda i: program_cost(programs[i], dims, machine, costs))
        best = program_cost(programs[ranked[0]], dims, machine, costs) if programs else 0.0
        top = [i for i in ranked[: options.time_top]
               if program_cost(programs[i], dims, machine, costs) <= best * options.time_within
               and _run_bytes(programs[i], dims) <= options.max_timing_bytes]
        if len(top) >= 2:
            tops[key] = top
    # the segments that weigh most in the whole program first (occurrences x estimated time), and only those
    # weighing at least ``time_min_share`` of it: what is left out is decided by the cost model
    occurrences = {}
    for seg in segments:
        occurrences[seg.key] = occurrences.get(seg.key, 0) + 1
    weight = {key: occurrences[key] * program_cost(searched[key][0][top[0]], dims, machine, costs)
              for key, top in tops.items()}
    total = program_cost(first, dims, machine, costs)
    tops = {key: tops[key] for key in sorted(tops, key=lambda k: -weight[k])
            if weight[key] >= options.time_min_share * total}
    if not tops or _busy(runtime, busy):
        return {}
    started = time.perf_counter()
    rng = np.random.default_rng(options.seed)
    if inputs is None:
        inputs = {n.name: _random_value(n, dims, rng) for n in graph.inputs("input")}
    if weights is None:
        weights = {n.name: _random_value(n, dims, rng) for n in graph.inputs("weight")}
    occurrence = {}
    for seg in segments:
        occurrence.setdefault(seg.key, seg)
    values = _boundary_values(runtime, graph, segments, searched, [occurrence[k] for k in tops], dims, inputs,
                              weights)
    timing: dict[str, dict[int, float]] = {}
    for key, top in tops.items():
        if time.perf_counter() - started > options.timing_budget_s:
            break  # the segments not timed keep the cost model's choice
        seg, programs = occurrence[key], searched[key][0]
        seg_inputs, seg_weights = {}, {}
        for node in seg.graph.inputs():
            name = node.attr("name")
            if node.attr("kind") == "arg":
                seg_inputs[name] = values[seg.args[int(name[3:])]]
            elif node.attr("kind") != "state":  # a state starts at zeros in the executable
                original = graph.nodes[seg.locals[name]]
                target = seg_weights if node.attr("kind") == "weight" else seg_inputs
                target[name] = _value_of(original, inputs, weights, dims)
        runs = []
        for i in top:
            program = programs[i]
            # a program reads only the inputs its outputs depend on
            read = {n.attr("name") for n in program.nodes if n.op == "Input"
                    and n.attr("kind") not in ("weight", "state")}
            runs.append((i, program, {k: v for k, v in seg_inputs.items() if k in read}))
        timing[key] = _best_times(runtime, runs, seg_weights, dims, options.timing_repeats)
    return {} if timing and _busy(runtime, busy) else timing  # (timed while other work ran: the same noise)


def _value_of(node, inputs, weights, dims) -> np.ndarray:
    """The value of a graph input for timing: its weight, its given input, or zeros (a state's first value)."""
    from luminal_recipes.runtimes.binding import fetch_weight

    kind = node.attr("kind")
    if kind == "weight":
        return fetch_weight(weights, node.name)
    if kind == "state" or node.name not in inputs:
        return np.zeros(tuple(bind(d, dims) for d in node.shape), node.dtype.np)
    return np.asarray(inputs[node.name])


def _boundary_values(runtime, graph: Graph, segments: list[Segment], searched: dict, wanted: list[Segment], dims,
                     inputs, weights) -> dict[int, np.ndarray]:
    """The value of every operand the ``wanted`` segments read from other segments (original node id -> array),
    from one run of the whole graph's cheapest program with those values as extra outputs."""
    needed = sorted({src for seg in wanted for src in seg.args})
    out = {src: _value_of(graph.nodes[src], inputs, weights, dims) for src in needed
           if graph.nodes[src].op == "Input"}
    computed = [src for src in needed if src not in out]
    if not computed:
        return out
    produced: dict[int, int] = {}
    program = assemble(graph, segments, [searched[s.key][0][0] for s in segments], produced)
    outputs = dict(program.outputs)
    for src in computed:
        outputs[f"segment operand {src}"] = (produced[src], View.contiguous(graph.nodes[src].shape))
    program = Program(program.nodes, outputs)
    read = {n.name for n in program.nodes if n.op == "Input" and n.attr("kind") not in ("weight", "state")}
    exe = runtime.load(program, weights, dims)
    try:
        got = exe.run({k: v for k, v in inputs.items() if k in read})
    finally:
        exe.close()
    out.update({src: got[f"segment operand {src}"] for src in computed})
    return out


def _best_times(runtime, runs: list[tuple[int, Program, dict]], weights, dims, repeats: int) -> dict[int, float]:
    """Seconds per run of each candidate ``(index, program, inputs)``: the fastest of at least ``repeats`` runs
    after a warm-up run, with more runs while they are short (up to 5 rounds or 10 ms per candidate). The
    candidates run in turns, one run each per round: on a shared machine the speed changes over seconds (a
    neighbour's load, a core at half speed), and timing one candidate after the other would hand whichever ran
    in a slow phase a loss it did not earn. A run is only ever slowed down by other work, so the minimum is the
    estimate. The warm-up runs each executable until it is ``settled`` (its steps recorded: the CPU backend's
    chains from the fifth run, a device graph from the second), so that the candidates are timed as they will
    run: unrecorded, a decode step's fused attention lost to its unfused chain of kernels (Qwen3-100M at 2
    threads: picked about one compile in two), which ran 17% slower once recorded (21.8 vs 18.7 ms)."""
    if not hasattr(runtime, "load"):
        return {i: runtime.time(program, inputs, weights, dims, repeats=repeats) for i, program, inputs in runs}
    exes = []
    try:
        for i, program, inputs in runs:
            exes.append((i, runtime.load(program, weights, dims), inputs))
            exe = exes[-1][1]
            for _ in range(WARM_RUNS):  # warm-up, past the recording
                exe.run(inputs, copy_outputs=False)
                if getattr(exe, "settled", True):
                    break
        best = {i: float("inf") for i, _, _ in exes}
        spent, rounds = 0.0, 0
        while rounds < max(1, repeats) or (rounds < 5 and spent < 0.01 * len(exes)):
            for i, exe, inputs in exes:
                t0 = time.perf_counter()
                exe.run(inputs, copy_outputs=False)
                took = time.perf_counter() - t0
                best[i], spent = min(best[i], took), spent + took
            rounds += 1
        return best
    finally:
        for _, exe, _ in exes:
            exe.close()


def _busy(runtime, notes: dict | None) -> bool:
    """Whether the runtime's timings cannot be trusted now (``contended``: other work competing for its cores;
    the reason in ``notes["why"]``). Checked before and after the candidates are timed; where busy, the cost
    model chooses: a choice timed on a busy machine is cached like any other, and plans that run on every core
    lose most beside a neighbour."""
    check = getattr(runtime, "contended", None)
    why = check() if callable(check) else None
    if why and notes is not None:
        notes["why"] = why
    return bool(why)


def _clear_winner(times: dict, default, margin: float):
    """The key of the fastest of ``times``, unless ``default`` (the cost model's choice) is within ``margin`` of
    it: then ``default``."""
    fastest = min(times, key=times.get)
    if default in times and times[default] <= times[fastest] * (1 + margin):
        return default
    return fastest


def _fastest_segments(graph: Graph, segments: list[Segment], searched: dict,
                      timing: dict[str, dict[int, float]], margin: float) -> Program | None:
    """The whole program made of every timed segment's fastest candidate, where it beats the cost model's
    cheapest (the first one timed) by more than ``margin`` (the other segments: their cheapest by the cost model,
    index 0), or None when nothing was timed."""
    if not timing:
        return None
    picks = {key: _clear_winner(timing[key], next(iter(timing[key])), margin) if key in timing else 0
             for key in searched}
    program = assemble(graph, segments, [searched[s.key][0][picks[s.key]] for s in segments])
    program.meta.update(templates=picks, strategy="fastest segments")
    return program


def _measured(segments: list[Segment], searched: dict, timing: dict[str, dict[int, float]],
              picks: dict[str, int] | None) -> float | None:
    """A whole candidate's measured seconds: the sum, over every segment occurrence, of its template's time, for
    a candidate whose templates were timed in every timed segment (None otherwise, and when nothing was timed).
    Segments not timed (one candidate, or one within reach of the cheapest) are the same in the candidates
    compared and are left out."""
    if not timing or picks is None or any(picks[key] not in times for key, times in timing.items()):
        return None
    return sum(timing[s.key][picks[s.key]] for s in segments if s.key in timing)


WHOLE_ROUNDS = 3  # rounds of whole-program candidates timed in turns (when the budget allows)
WARM_RUNS = 8  # warm-up runs of a timed executable at most, until its steps are recorded (``_best_times``)


def _time_candidates(runtime, graph: Graph, fitting, dims, inputs, weights, options: SearchOptions,
                     busy: dict | None = None):
    """Whole-program timing (graphs with states): the ``time_top`` cheapest fitting candidates within
    ``time_within`` of the cheapest, one timed run each after a warm-up run, within ``timing_budget_s``."""
    if runtime is None or not hasattr(runtime, "time") or not getattr(runtime, "timed", True) \
            or options.time_top <= 0:
        return []
    best = fitting[0][1].get("cost_s") if fitting else None
    # a candidate the cost model rates far worse is not worth whole-program runs (they dominate cold compiles)
    top = [(p, r) for p, r in fitting[: options.time_top] if _run_bytes(p, dims) <= options.max_timing_bytes
           and (best is None or r.get("cost_s") is None or r["cost_s"] <= best * options.time_within)]
    if len(top) < 2 or _busy(runtime, busy):
        return []
    rng = np.random.default_rng(options.seed)
    if inputs is None:
        inputs = {n.name: _random_value(n, dims, rng) for n in graph.inputs("input")}
    if weights is None:
        weights = {n.name: _random_value(n, dims, rng) for n in graph.inputs("weight")}
    # a first pass, one run each, finds how many fit the budget; those then run in turns (WHOLE_ROUNDS rounds,
    # the fastest run counts, as ``_best_times``): one run each on a shared machine decided by its noise (a
    # decoding step's 30 launches of a fused attention lost to its unfused chain of 150 on one run apiece)
    timed = []
    started = time.perf_counter()
    for program, row in top:
        spent = time.perf_counter() - started
        # the next candidate costs about what the first did (load, warm-up, timed run): one that would end past
        # the budget is not started, and a single measurement compares nothing (the cost model decides)
        if timed and spent + spent / len(timed) > options.timing_budget_s:
            break
        # a program reads only the inputs its outputs depend on
        read = {n.name for n in program.nodes if n.op == "Input"}
        row["measured_s"] = runtime.time(program, {k: v for k, v in inputs.items() if k in read}, weights, dims,
                                         repeats=1)
        timed.append((program, row))
    if len(timed) < 2:
        return []
    spent = time.perf_counter() - started
    if spent * WHOLE_ROUNDS <= options.timing_budget_s:
        runs = [(i, program, {k: v for k, v in inputs.items() if k in {n.name for n in program.nodes
                                                                         if n.op == "Input"}})
                for i, (program, _) in enumerate(timed)]
        best = _best_times(runtime, runs, weights, dims, WHOLE_ROUNDS)
        for i, (_, row) in enumerate(timed):  # recorded runs only: the first pass ran kernel by kernel
            row["measured_s"] = best[i]
    elif _records(runtime):
        # one unrecorded run each compares programs as they will never run (kernel by kernel, not replayed), on
        # one sample of a shared machine's noise: SmolLM2's decode program took its unfused attention (60 BLAS
        # products and 30 softmax passes between the chains) in one compile of two, 10-60% slower a token
        for _, row in timed:
            row["unrecorded_s"] = row.pop("measured_s")
        return []
    if _busy(runtime, busy):  # (timed while other work ran: kept in the report, not chosen by)
        for _, row in timed:
            row["busy_s"] = row.pop("measured_s")
        return []
    return timed


def _records(runtime) -> bool:
    """Whether the runtime's executables record their steps after a few runs (device graphs, the CPU backend's
    chains), so that a run before the recording is not how the program runs."""
    return bool(getattr(getattr(runtime, "backend", None), "graphs", False))


def _random_value(node, dims, rng: np.random.Generator) -> np.ndarray:
    """A stand-in value for timing: small normals for floats, zeros for indices (always in range)."""
    shape = tuple(bind(d, dims) for d in node.shape)
    if node.dtype.is_float:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(node.dtype.np)
    if node.dtype == DType.BOOL:
        return np.ones(shape, dtype=bool)
    return np.zeros(shape, dtype=node.dtype.np)


def _gib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / 2**30:.2f} GiB"
