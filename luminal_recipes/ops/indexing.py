"""Lookups and index arithmetic: embedding, argmax/top-k, KV-cache row writes."""

from __future__ import annotations

from ..errors import GraphError, ShapeError
from ..graph import DType, Tensor, cast, gather, reduce, scatter
from ..graph.symbolic import dims_equal, shape_str
from .elementwise import equal, where
from .shape import concat


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """Rows of ``table [V, D]`` for i32 ``ids``."""
    if ids.dtype != DType.I32:
        ids = cast(ids, DType.I32)
    return gather(table, ids)


def argmax(x: Tensor, axis: int = -1) -> Tensor:
    """Index (i32) of the first maximum along ``axis``, like torch.argmax."""
    axis = x._axis(axis, "argmax")
    if axis != x.ndim - 1:
        perm = [i for i in range(x.ndim) if i != axis] + [axis]
        x = x.permute(perm)
    n = x.shape[-1]
    top = reduce("MaxReduce", x, -1).unsqueeze(-1).broadcast_to(x.shape)
    hit = cast(equal(x, top), DType.I32)
    pos = x.graph.iota(n).broadcast_to(x.shape)
    # first hit = smallest candidate; non-hits get n (past every index)
    cand = pos * hit + (1 - hit) * (2**30)
    return -reduce("MaxReduce", -cand, -1)


def topk(x: Tensor, k: int, axis: int = -1) -> tuple[Tensor, Tensor]:
    """The ``k`` largest values along ``axis`` (descending) and their i32 indices, as torch.topk."""
    axis = x._axis(axis, "topk")
    if axis != x.ndim - 1:
        raise ShapeError("topk: only the last axis is supported; permute the tensor first")
    n = x.shape[-1]
    if isinstance(n, int) and not 0 < k <= n:
        raise ShapeError(f"topk: k={k} must be in 1..{n}")
    work = x
    values, indices = [], []
    pos = x.graph.iota(n).broadcast_to(x.shape)
    lowest = float("-inf") if x.dtype.is_float else -(2**31)
    for _ in range(k):
        idx = argmax(work, -1)
        values.append(reduce("MaxReduce", work, -1).unsqueeze(-1))
        indices.append(idx.unsqueeze(-1))
        chosen = equal(pos, idx.unsqueeze(-1).broadcast_to(x.shape))
        work = where(chosen, lowest, work)
    return concat(values, -1), concat(indices, -1)


def write_rows(cache: Tensor, positions: Tensor, rows: Tensor) -> Tensor:
    """KV-cache write: ``cache`` with rows ``positions`` replaced by ``rows`` (Scatter)."""
    if positions.dtype != DType.I32:
        positions = cast(positions, DType.I32)
    return scatter(cache, positions, rows)


def update_cache(cache: Tensor, positions: Tensor, x: Tensor, length) -> Tensor:
    """Write ``x`` ``[B, H, S, D]`` into the KV-cache state ``cache`` ``[C, B, H, D]`` at rows ``positions``
    (i32 ``[S]``, absolute), declare the result the state's new value, and return its first ``length`` rows as
    ``[B, H, length, D]`` (a view: the compiler writes the rows in the state's own buffer, nothing is copied)."""
    graph = cache.graph
    node = graph.nodes[cache.node]
    if node.op != "Input" or node.attr("kind") != "state" or not cache.view.is_contiguous() \
            or not all(dims_equal(a, b) for a, b in zip(cache.shape, node.shape)):
        raise GraphError("update_cache: the first argument must be a state as declared (self.k_cache under the "
                         "module's `states:`), not a value computed from one")
    if cache.ndim != 4 or x.ndim != 4:
        raise ShapeError(f"update_cache: expects the cache as [C, B, H, D] and x as [B, H, S, D]; got "
                         f"{shape_str(cache.shape)} and {shape_str(x.shape)}")
    rows = x.permute(2, 0, 1, 3)  # [S, B, H, D]: one cache row per new position
    if rows.dtype != cache.dtype:
        rows = cast(rows, cache.dtype)
    new = write_rows(cache, positions, rows)
    graph.update_state(node.name, new)
    return new.slice(0, 0, length).permute(1, 2, 0, 3)
