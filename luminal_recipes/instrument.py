"""Counters of the expensive events of a run: graph builds, compiler searches, plan-cache hits, executable
loads and CUDA module builds and compiles. Tests read them to prove that caching holds (a second prompt builds,
compiles and loads nothing) without relying on timings; nothing else depends on them, and counting costs a
dictionary update."""

from __future__ import annotations

from collections import Counter

#: event name -> how many times it happened in this process
counts: Counter[str] = Counter()

GRAPH_BUILD = "graph_build"  # a model's graph built from its recipe (recipe.builder.build_model)
SEARCH = "search"  # a compiler search run (a plan-cache miss, or no cache)
PLAN_CACHE_HIT = "plan_cache_hit"  # a compiled program read from the plan cache
LOAD = "load"  # a program bound to its weights and arena (pipeline.engine.ModelEngine)
CUDA_MODULE = "cuda_module"  # a CUDA backend needed a module it did not hold (compiled, or read from the disk cache)
CUDA_COMPILE = "cuda_compile"  # g++ (cuda-emu) or NVRTC (cuda) compiled a module: its disk cache missed


def count(event: str) -> None:
    counts[event] += 1


def snapshot() -> Counter[str]:
    """The counts now; subtract an earlier snapshot to get what happened since."""
    return Counter(counts)
