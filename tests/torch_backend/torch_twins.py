"""Helpers of the torch backend's tests (imported by name: tests/torch_backend is on sys.path)."""

from __future__ import annotations

import copy

import torch


def float64_twin(model):
    """A float64 copy of ``model``: tests/TOLERANCES.md compares with the reference computed in float64."""
    return copy.deepcopy(model).to(torch.float64).eval()


def compiled_programs(module, args, monkeypatch):
    """``torch.compile(module, backend="luminal")(*args)`` with fallbacks made errors, and the programs its
    translated graphs compile to as the cost model ranks candidates (timing on a loaded machine may pick another)."""
    import warnings

    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.runtimes.registry import get_runtime
    from luminal_recipes.torch_backend import compiled
    from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning

    graphs = []
    init = compiled.CompiledGraph.__init__

    def spy(self, translation, *a, **kw):
        graphs.append(translation.graph)
        init(self, translation, *a, **kw)

    monkeypatch.setattr(compiled.CompiledGraph, "__init__", spy)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = torch.compile(module, backend="luminal")(*args)
    options = SearchOptions(time_top=0, use_cache=False)
    programs = [compile_graph(g, get_runtime("numpy"), {}, options=options).program for g in graphs]
    return got, programs
