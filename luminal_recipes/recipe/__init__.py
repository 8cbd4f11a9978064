"""Recipes: the YAML language that describes a model or a pipeline, and the builder that makes graphs of it.

Entry points: ``load_recipe`` (parse and check a file), ``validate`` / ``inspect`` (what the CLI commands do),
``build`` (recipe + checkpoint -> ``BuiltModel`` with its Graph and lazily bound weights), ``json_schema``.
"""

from .builder import BuiltModel, WeightBinding, build, build_model
from .commands import ValidationReport, inspect, validate
from .loader import LoadedRecipe, load_recipe
from .schema import json_schema

__all__ = [
    "BuiltModel",
    "LoadedRecipe",
    "ValidationReport",
    "WeightBinding",
    "build",
    "build_model",
    "inspect",
    "json_schema",
    "load_recipe",
    "validate",
]
