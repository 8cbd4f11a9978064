"""Fixtures for op tests: run an op on numpy inputs through a one-op graph and the reference interpreter.

Inputs may be plain arrays or ``Viewed`` arrays, which reach the op through movement ops (transposed, sliced,
padded, broadcast views) or with a symbolic declared shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from luminal_recipes.graph import Graph, Tensor, run_reference, to_dtype

NP_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}


@dataclass
class Viewed:
    """``base`` is what the graph input holds; ``to_view`` turns that input into the op's operand, whose value
    is ``value``. ``shape`` overrides the declared input shape (symbolic dims)."""

    base: np.ndarray
    to_view: Callable[[Tensor], Tensor]
    value: np.ndarray
    shape: tuple | None = None


def symbolic(arr: np.ndarray, shape: tuple) -> Viewed:
    """``arr`` fed to an input declared with (partly) symbolic ``shape``."""
    return Viewed(arr, lambda t: t, arr, shape)


def make_viewed(kind: str, shape: tuple, rng: np.random.Generator, dtype: str = "f32") -> Viewed:
    """A value of ``shape`` that reaches the op as a view of kind ``contiguous | transposed | sliced |
    padded | broadcast`` (the last axis must be >= 3 for ``padded``)."""
    npd = NP_DTYPES[dtype]

    def rand(s):
        return rng.standard_normal(s).astype(npd)

    if kind == "contiguous":
        a = rand(shape)
        return Viewed(a, lambda t: t, a)
    if kind == "transposed":
        base = rand(shape[:-2] + (shape[-1], shape[-2]))
        return Viewed(base, lambda t: t.transpose(-1, -2), np.swapaxes(base, -1, -2))
    if kind == "sliced":  # offset on axis 0, step 2 on the last axis
        n = shape[-1]
        base = rand((shape[0] + 2,) + shape[1:-1] + (2 * n + 1,))
        return Viewed(base, lambda t: t.slice(0, 2, None).slice(-1, 1, 2 * n + 1, 2), base[2:, ..., 1::2])
    if kind == "padded":  # one zero column on each side of the last axis
        base = rand(shape[:-1] + (shape[-1] - 2,))
        pad = [(0, 0)] * (len(shape) - 1) + [(1, 1)]
        return Viewed(base, lambda t: t.pad(-1, 1, 1), np.pad(base, pad))
    if kind == "broadcast":  # axis 0 stretched from 1
        base = rand((1,) + shape[1:])
        return Viewed(base, lambda t: t.broadcast_to(shape), np.broadcast_to(base, shape))
    raise ValueError(kind)


def run_graph_op(fn: Callable, *inputs, dims: dict | None = None, mode: str = "native"):
    """Build ``fn(*tensors)`` in a fresh graph (each input a graph input), run it, return numpy result(s)."""
    g = Graph()
    tensors, feed = [], {}
    for i, item in enumerate(inputs):
        v = item if isinstance(item, Viewed) else Viewed(np.asarray(item), lambda t: t, np.asarray(item))
        name = f"in{i}"
        t = g.input(name, v.shape if v.shape is not None else v.base.shape, to_dtype(v.base.dtype))
        tensors.append(v.to_view(t))
        feed[name] = v.base
    out = fn(*tensors)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for j, o in enumerate(outs):
        g.mark_output(f"out{j}", o)
    result = run_reference(g, feed, dims=dims, mode=mode)
    values = [result[f"out{j}"] for j in range(len(outs))]
    return values if isinstance(out, (tuple, list)) else values[0]


@pytest.fixture
def run_op():
    return run_graph_op


@pytest.fixture
def viewed():
    return make_viewed


@pytest.fixture
def symbolic_input():
    return symbolic


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
