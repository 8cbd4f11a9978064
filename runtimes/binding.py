"""Binding a Program's inputs and weights: look-up, shape and dtype checks with messages that name the tensor.

Shared by every runtime. Weights come from a mapping ``name -> array``, a callable ``name -> array``, or any
object with ``.load(name)`` (e.g. ``weights.safetensors_io.Checkpoint``, whose arrays are memory-mapped,
zero-copy). Arrays are never converted: a dtype other than the one the program declares is an error, so
nothing is copied silently.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping

import numpy as np

from luminal_recipes.errors import InputError
from luminal_recipes.graph.core import Node
from luminal_recipes.graph.symbolic import evaluate, shape_str

WeightSource = Mapping[str, np.ndarray] | Callable[[str], np.ndarray] | object


def declared_shape(node: Node, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(d, dims) for d in node.shape)


def fetch_weight(source: WeightSource | None, name: str) -> np.ndarray:
    if source is None:
        raise InputError(f"weight '{name}' is needed but no weights were given; pass weights= (a mapping, a "
                         f"callable or a Checkpoint)")
    try:
        if hasattr(source, "load") and not isinstance(source, Mapping):
            arr = source.load(name)
        elif callable(source):
            arr = source(name)
        else:
            arr = source[name]
    except KeyError:
        arr = None
    if arr is None:
        raise InputError(f"weight '{name}' was not provided; the weights source has no tensor of that name")
    if hasattr(arr, "__cuda_array_interface__"):
        return arr  # already in device memory (a GPU backend binds it as it is)
    return np.asarray(arr)


def check_array(kind: str, node: Node, arr: np.ndarray, dims: Mapping[str, int]) -> None:
    """The array matches the program's declaration exactly (shape under ``dims``, dtype)."""
    want = declared_shape(node, dims)
    if tuple(arr.shape) != want:
        raise InputError(
            f"{kind} '{node.name}' has shape {tuple(arr.shape)}, the program declares "
            f"{shape_str(node.shape)} = {want} with dims {dict(dims) or '{}'}; pass an array of that shape "
            f"(or other dims)"
        )
    if arr.dtype != node.dtype.np:
        raise InputError(
            f"{kind} '{node.name}' has dtype {arr.dtype}, the program declares {node.dtype}; convert it "
            f"first, e.g. arr.astype({node.dtype.np.name!r}) (runtimes never convert silently)"
        )


def check_input_names(given: Mapping[str, np.ndarray], expected: list[str], known: set[str]) -> None:
    """Every expected activation input is present; no name is unknown (a typo would otherwise be ignored)."""
    missing = [n for n in expected if n not in given]
    if missing:
        raise InputError(f"input(s) {', '.join(repr(m) for m in missing)} were not provided; the program "
                         f"needs {', '.join(repr(e) for e in expected) or 'no inputs'}")
    unknown = [n for n in given if n not in known]
    if unknown:
        hints = []
        for u in unknown:
            close = difflib.get_close_matches(u, sorted(known), n=1)
            hints.append(f"'{u}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise InputError(f"unknown input(s) {', '.join(hints)}; the program's inputs are "
                         f"{', '.join(repr(k) for k in sorted(known)) or 'none'}")
