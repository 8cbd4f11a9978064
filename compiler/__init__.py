"""The search compiler (imported as ``luminal_recipes.compiler``): HLIR -> egglog -> candidate Programs.

``compile_graph(graph, runtime, dims, budget_bytes=None, inputs=None, weights=None, options=None)`` returns a
``CompiledPlan`` (``.program``, ``.report``). See ``search.py`` for the pipeline and ``rules/*.egg`` for the
rules.
"""

from .search import CompiledPlan, SearchOptions, compile_graph

__all__ = ["CompiledPlan", "SearchOptions", "compile_graph"]
