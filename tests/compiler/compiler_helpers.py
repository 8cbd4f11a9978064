"""Helpers shared by the compiler tests: seeded values for a graph's inputs and weights, and candidate
extraction checked against the reference interpreter. (A uniquely named module: several conftest.py exist.)"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luminal_recipes.compiler.search import SearchOptions, search_segment
from luminal_recipes.compiler.segments import Segment, assemble, split
from luminal_recipes.graph import DType, Graph, run_reference
from luminal_recipes.graph.symbolic import evaluate
from luminal_recipes.runtimes.program import Program


def graph_values(graph: Graph, seed: int = 0, dims=None) -> tuple[dict, dict]:
    """Seeded inputs and weights for every declared Input (normals for floats, small ints for indices)."""
    rng = np.random.default_rng(seed)
    inputs, weights = {}, {}
    for node in graph.inputs():
        shape = tuple(evaluate(d, dims or {}) for d in node.shape)
        if node.dtype.is_float:
            # weights scaled by 1/sqrt(fan-in), so activations stay O(1) through a whole block
            scale = 1 / np.sqrt(shape[-1]) if node.attr("kind") == "weight" and len(shape) >= 2 else 1.0
            value = (rng.standard_normal(shape) * scale).astype(np.float32).astype(node.dtype.np)
        elif node.dtype == DType.U8:
            value = rng.integers(0, 256, shape).astype(np.uint8)
        elif node.dtype == DType.BOOL:
            value = rng.integers(0, 2, shape).astype(bool)
        else:
            value = rng.integers(0, 3, shape).astype(node.dtype.np)
        (weights if node.attr("kind") == "weight" else inputs)[node.name] = value
    return inputs, weights


@dataclass
class Searched:
    segments: list[Segment]
    programs: dict[str, list[Program]]  # segment key -> candidate template programs
    reports: dict[str, dict]

    def assemble(self, graph: Graph, pick) -> Program:
        """The whole-graph program taking ``pick(candidates)`` for every segment."""
        return assemble(graph, self.segments, [pick(self.programs[s.key]) for s in self.segments])

    def fired(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for report in self.reports.values():
            for rule, n in report["rules_fired"].items():
                out[rule] = out.get(rule, 0) + n
        return out


def search(graph: Graph, runtime, dims=None, **options) -> Searched:
    """Search every distinct segment of ``graph`` (as compile_graph does) and keep all candidates."""
    opts = SearchOptions(**options)
    segments = split(graph)
    programs, reports = {}, {}
    for seg in segments:
        if seg.key not in programs:
            programs[seg.key], reports[seg.key] = search_segment(seg, runtime.capabilities().__contains__,
                                                                 dims or {}, opts)
    return Searched(segments, programs, reports)


def cheapest(graph: Graph, runtime, dims=None, **options) -> Program:
    return search(graph, runtime, dims, **options).assemble(graph, lambda progs: progs[0])


def check_program(graph: Graph, program: Program, runtime, assert_close, dims=None, seed: int = 0,
                  family: str = "*") -> float:
    """Run ``program`` on the runtime and ``graph`` on the f64 reference interpreter; returns the error."""
    inputs, weights = graph_values(graph, seed, dims)
    want = run_reference(graph, inputs, weights, dims, mode="f64")
    got = runtime.run(program, inputs, weights, dims)
    worst = 0.0
    for name, value in want.items():
        dtype = str(graph.nodes[graph.outputs[name][0]].dtype)
        worst = max(worst, assert_close(family, got[name], value, dtype))
    return worst


def kernels(program: Program) -> set[str]:
    return {n.op for n in program.nodes}
