"""concat/split/chunk/stack, embedding, argmax/top-k and KV-cache row writes against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ml_dtypes import bfloat16

from luminal_recipes import ops

NP = {"f32": np.float32, "f16": np.float16, "bf16": bfloat16}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).astype(np.float64))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_and_stack(axis, dtype, run_op, assert_close, rng):
    shapes = [(3, 1, 2), (3, 7, 2), (3, 17, 2)] if axis == 1 else [(3, 2, 4)] * 3
    if axis == 0:
        shapes = [(1, 2, 4), (3, 2, 4), (7, 2, 4)]
    xs = [rng.standard_normal(s).astype(NP[dtype]) for s in shapes]
    got = run_op(lambda *ts: ops.concat(list(ts), axis), *xs)
    assert_close("shape", got, torch.cat([_t(x) for x in xs], axis), dtype)
    same = [rng.standard_normal((3, 2, 4)).astype(NP[dtype]) for _ in range(3)]
    got = run_op(lambda *ts: ops.stack(list(ts), axis), *same)
    assert_close("shape", got, torch.stack([_t(x) for x in same], axis), dtype)


def test_concat_of_views(run_op, assert_close, rng, viewed):
    a, b = viewed("transposed", (3, 7), rng), viewed("padded", (3, 5), rng)
    got = run_op(lambda x, y: ops.concat([x, y], -1), a, b)
    assert_close("shape", got, torch.cat([_t(a.value), _t(b.value)], -1))


def test_concat_keeps_infinities_and_nan(run_op, assert_close):
    """concat pads pieces with zeros and adds them: inf + 0 and nan + 0 must come out unchanged.

    (The sign of a zero is not kept: -0.0 + 0.0 is +0.0. See tests/TOLERANCES.md.)
    """
    a = np.array([np.inf, -np.inf, -0.0], dtype=np.float32)
    b = np.array([1.0, np.nan], dtype=np.float32)
    got = run_op(lambda x, y: ops.concat([x, y]), a, b)
    assert_close("shape", got, torch.cat([torch.from_numpy(a), torch.from_numpy(b)]))


@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_concat(s, run_op, assert_close, rng, symbolic_input):
    x = rng.standard_normal((s, 4)).astype(np.float32)
    y = rng.standard_normal((3, 4)).astype(np.float32)
    got = run_op(lambda a, b: ops.concat([a, b, a], 0), symbolic_input(x, ("s", 4)), y, dims={"s": s})
    assert_close("shape", got, torch.cat([_t(x), _t(y), _t(x)], 0))


@pytest.mark.parametrize(("sizes", "axis"), [([1, 3, 3], 1), ([7], 1), ([2, 5], -1), ([1, 2], 0)])
def test_split(sizes, axis, run_op, assert_close, rng):
    x = rng.standard_normal((3, 7)).astype(np.float32)
    got = run_op(lambda t: ops.split(t, sizes, axis), x)
    for g, w in zip(got, torch.split(_t(x), sizes, axis), strict=True):
        assert_close("shape", g, w)


@pytest.mark.parametrize(("n", "axis"), [(1, 0), (3, 1), (2, 0), (6, -1)])
def test_chunk(n, axis, run_op, assert_close, rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    got = run_op(lambda t: ops.chunk(t, n, axis), x)
    for g, w in zip(got, torch.chunk(_t(x), n, axis), strict=True):
        assert_close("shape", g, w)


# ---- lookups -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("ids_shape", [(1,), (7,), (2, 3)])
def test_embedding(ids_shape, dtype, run_op, assert_close, rng):
    table = rng.standard_normal((17, 5)).astype(NP[dtype])
    ids = rng.integers(0, 17, ids_shape).astype(np.int32)
    got = run_op(ops.embedding, ids, table)
    assert_close("index", got, F.embedding(torch.from_numpy(ids).long(), _t(table)))


def test_embedding_rejects_out_of_range_ids(run_op):
    from luminal_recipes.errors import InputError

    with pytest.raises(InputError, match="out of range"):
        run_op(ops.embedding, np.array([0, 17], dtype=np.int32), np.zeros((17, 2), np.float32))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_argmax_takes_first_maximum(axis, run_op, assert_close, rng):
    x = rng.integers(-2, 3, (5, 7, 3)).astype(np.float32)  # many ties
    got = run_op(lambda t: ops.argmax(t, axis), x)
    assert got.dtype == np.int32
    assert_close("index", got, torch.argmax(torch.from_numpy(x), axis), "i32")


def test_argmax_of_symbolic_rows(run_op, assert_close, rng, symbolic_input):
    for s in (1, 3, 17):
        x = rng.standard_normal((2, s)).astype(np.float32)
        got = run_op(ops.argmax, symbolic_input(x, (2, "s")), dims={"s": s})
        assert_close("index", got, torch.argmax(torch.from_numpy(x), -1), "i32")


@pytest.mark.parametrize("k", [1, 3, 7])
def test_topk(k, run_op, assert_close, rng):
    x = (
        rng.permutation(3 * 7).reshape(3, 7).astype(np.float32) - 10.0
    )  # distinct values: the order is defined
    values, indices = run_op(lambda t: ops.topk(t, k), x)
    want = torch.topk(torch.from_numpy(x), k, -1)
    assert_close("index", values, want.values)
    assert_close("index", indices, want.indices, "i32")


def test_topk_on_a_view(run_op, assert_close, rng, viewed):
    v = viewed("sliced", (3, 7), rng)
    values, indices = run_op(lambda t: ops.topk(t, 2), v)
    want = torch.topk(torch.from_numpy(v.value.copy()), 2, -1)
    assert_close("index", values, want.values)
    assert_close("index", indices, want.indices, "i32")


@pytest.mark.parametrize("positions", [[0], [3, 4, 5], [6, 1]])
def test_write_rows_into_kv_cache(positions, run_op, assert_close, rng):
    cache = rng.standard_normal((7, 2, 3)).astype(np.float32)
    rows = rng.standard_normal((len(positions), 2, 3)).astype(np.float32)
    pos = np.array(positions, dtype=np.int32)
    got = run_op(ops.write_rows, cache, pos, rows)
    want = torch.from_numpy(cache).index_copy(0, torch.from_numpy(pos).long(), torch.from_numpy(rows))
    assert_close("index", got, want)


def test_write_rows_symbolic_step(run_op, assert_close, rng, symbolic_input):
    """Decode-style cache write: ``s`` new rows at positions p..p+s-1, with s bound at run time."""
    for s, start in ((1, 4), (3, 0)):
        cache = rng.standard_normal((8, 4)).astype(np.float32)
        rows = rng.standard_normal((s, 4)).astype(np.float32)
        pos = np.arange(start, start + s, dtype=np.int32)
        got = run_op(
            ops.write_rows, cache, symbolic_input(pos, ("s",)), symbolic_input(rows, ("s", 4)), dims={"s": s}
        )
        want = cache.copy()
        want[start : start + s] = rows
        assert_close("index", got, want)


@pytest.mark.parametrize("positions, length", [([3], 4), ([0, 1, 2], 5), ([5, 6], 8)])
def test_update_cache_writes_rows_and_returns_the_attended_prefix(positions, length, assert_close, rng):
    """update_cache(state [C, B, H, D], positions, x [B, H, S, D], length): the state's new value is the cache
    with rows ``positions`` replaced (torch index_copy), and the result its first ``length`` rows as [B, H, L, D]."""
    from luminal_recipes.graph import Graph, run_reference

    c, b, h, d = 8, 2, 3, 4
    cache = rng.standard_normal((c, b, h, d)).astype(np.float32)
    x = rng.standard_normal((b, h, len(positions), d)).astype(np.float32)
    g = Graph()
    state = g.state("cache", (c, b, h, d))
    out = ops.update_cache(state, g.input("pos", ("s",), "i32"), g.input("x", (b, h, "s", d)), "n")
    g.mark_output("keys", out)
    got = run_reference(g, {"cache": cache, "pos": np.array(positions, np.int32), "x": x},
                        dims={"s": len(positions), "n": length})
    want = torch.from_numpy(cache).index_copy(0, torch.tensor(positions), torch.from_numpy(x).permute(2, 0, 1, 3))
    assert_close("index", got["cache"], want)  # the state's new value (an output of the state's name)
    assert_close("index", got["keys"], want[:length].permute(1, 2, 0, 3))


def test_update_cache_needs_a_declared_state(rng):
    from luminal_recipes.errors import GraphError
    from luminal_recipes.graph import Graph

    g = Graph()
    plain = g.input("cache", (8, 1, 2, 4))
    with pytest.raises(GraphError, match="must be a state"):
        ops.update_cache(plain, g.input("pos", (1,), "i32"), g.input("x", (1, 2, 1, 4)), 8)
