"""HLIR: the lazy tensor graph of primitive ops, its views, symbolic dims and dtypes."""

from .core import (
    BINARY_OPS,
    PRIMITIVE_OPS,
    REDUCE_OPS,
    UNARY_OPS,
    Graph,
    Node,
    Tensor,
    binary,
    cast,
    dequant,
    gather,
    reduce,
    scatter,
    unary,
)
from .dtypes import DType, to_dtype
from .reference import run_reference
from .serialize import dumps, format_graph, loads, structural_hash
from .symbolic import Dim, Expr, to_dim
from .view import View

__all__ = [
    "BINARY_OPS", "PRIMITIVE_OPS", "REDUCE_OPS", "UNARY_OPS", "DType", "Dim", "Expr", "Graph", "Node", "Tensor",
    "View", "binary", "cast", "dequant", "dumps", "format_graph", "gather", "loads", "reduce", "run_reference",
    "scatter",
    "structural_hash", "to_dim", "to_dtype", "unary",
]
