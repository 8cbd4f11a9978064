"""Movement ops are zero-copy views: any chain of them equals the numpy equivalent when the reference
interpreter reads it, both as a graph output and as the operand of a primitive. Also symbolic views bound at
run time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luminal_recipes.graph import Graph, Tensor, run_reference

MAX_ELEMENTS = 4096


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorization(draw, n: int, rank: int) -> tuple[int, ...]:
    dims = []
    for _ in range(rank - 1):
        d = draw(st.sampled_from(_divisors(n))) if n else draw(st.sampled_from([0, 1, 2]))
        dims.append(d)
        n = n // d if d else n
    return (*dims, n)


def _padded_axis(t: Tensor, axis: int) -> bool:
    mask = t.view.mask
    return mask is not None and tuple(mask[axis]) != (0, t.shape[axis])


def _step(draw, t: Tensor, a: np.ndarray) -> tuple[Tensor, np.ndarray, str]:
    """Draw one applicable movement op; apply it to the tensor and to the numpy array."""
    n = a.ndim
    ones = [i for i, d in enumerate(a.shape) if d == 1]
    kinds = ["unsqueeze", "pad", "slice", "reshape"]
    kinds += ["permute", "transpose", "merge"] if n >= 2 else []
    kinds += ["split", "flip"] if n >= 1 else []
    kinds += ["squeeze", "broadcast"] if ones else []
    kinds += ["expand"] if a.size * 3 <= MAX_ELEMENTS else []
    kind = draw(st.sampled_from(kinds))
    if kind == "permute":
        perm = draw(st.permutations(list(range(n))))
        return t.permute(*perm), a.transpose(perm), f"permute{tuple(perm)}"
    if kind == "transpose":
        i, j = draw(st.integers(-n, n - 1)), draw(st.integers(-n, n - 1))
        return t.transpose(i, j), np.swapaxes(a, i, j), f"transpose({i}, {j})"
    if kind == "merge":
        i = draw(st.integers(0, n - 2))
        shape = a.shape[:i] + (a.shape[i] * a.shape[i + 1],) + a.shape[i + 2 :]
        return t.merge_dims(i, i + 1), a.reshape(shape), f"merge_dims({i})"
    if kind == "split":
        i = draw(st.integers(0, n - 1))
        d = draw(st.sampled_from(_divisors(a.shape[i]) or [1])) if a.shape[i] else 1
        sizes = (d, a.shape[i] // d) if a.shape[i] else (1, 0)
        return (
            t.split_dim(i, sizes),
            a.reshape(a.shape[:i] + sizes + a.shape[i + 1 :]),
            f"split_dim({i}, {sizes})",
        )
    if kind == "flip":
        i = draw(st.integers(-n, n - 1))
        return t.flip(i), np.flip(a, i), f"flip({i})"
    if kind == "reshape":
        shape = _factorization(draw, a.size, draw(st.integers(1, 4)))
        return t.reshape(shape), a.reshape(shape), f"reshape{shape}"
    if kind == "slice":
        i = draw(st.integers(0, n - 1)) if n else 0
        if n == 0:
            return t.unsqueeze(0), a[None], "unsqueeze(0)"
        size = a.shape[i]
        start = draw(st.integers(0, size))
        stop = draw(st.integers(start, size))
        step = (
            1 if _padded_axis(t, i) else draw(st.integers(1, 3))
        )  # a step on padding is documented unsupported
        index = [slice(None)] * n
        index[i] = slice(start, stop, step)
        return t.slice(i, start, stop, step), a[tuple(index)], f"slice({i}, {start}, {stop}, {step})"
    if kind == "pad":
        if n == 0:
            return t.unsqueeze(0), a[None], "unsqueeze(0)"
        i, before, after = draw(st.integers(0, n - 1)), draw(st.integers(0, 2)), draw(st.integers(0, 2))
        widths = [(0, 0)] * n
        widths[i] = (before, after)
        return t.pad(i, before, after), np.pad(a, widths), f"pad({i}, {before}, {after})"
    if kind == "expand":
        i, size = draw(st.integers(0, n)), draw(st.integers(1, 3))
        return (
            t.expand(i, size),
            np.broadcast_to(np.expand_dims(a, i), a.shape[:i] + (size,) + a.shape[i:]),
            f"expand({i}, {size})",
        )
    if kind == "broadcast":
        i, size = draw(st.sampled_from(ones)), draw(st.integers(1, 3))
        shape = a.shape[:i] + (size,) + a.shape[i + 1 :]
        return t.broadcast_to(shape), np.broadcast_to(a, shape), f"broadcast_to{shape}"
    if kind == "squeeze":
        i = draw(st.sampled_from(ones))
        return t.squeeze(i), np.squeeze(a, i), f"squeeze({i})"
    i = draw(st.integers(-n - 1, n))
    return t.unsqueeze(i), np.expand_dims(a, i), f"unsqueeze({i})"


# assert_close is a stateless function, so sharing it across generated inputs is safe
@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_movement_chain_equals_numpy(data, assert_close):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=4), label="shape"))
    base = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)  # distinct nonzero values
    g = Graph()
    t, a = g.input("x", shape), base
    steps = []
    for _ in range(data.draw(st.integers(1, 8), label="length")):
        t, a, what = _step(data.draw, t, a)
        steps.append(what)
        assert tuple(t.shape) == a.shape, f"shape after {steps}"
    g.mark_output("view", t)
    g.mark_output("operand", t * 1.0)  # read through the view by a primitive's input edge
    g.mark_output("twice", (t * 1.0).reshape(-1) if a.size else t * 1.0)
    out = run_reference(g, {"x": base})
    for name in ("view", "operand"):
        assert out[name].shape == a.shape, steps
        assert np.array_equal(out[name], a), f"{name} differs after {steps}"
    assert np.array_equal(out["twice"].reshape(a.shape), a), steps
    assert_close("movement", out["view"], a)


# ---- symbolic views ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("s", [1, 3, 17])
def test_symbolic_views_bind_at_run_time(s):
    g = Graph()
    x = g.input("x", ("s", 6))
    merged = x.merge_dims(0, 1)  # (6*s,)
    split = merged.split_dim(0, ("s", 3, 2)).permute(2, 0, 1)  # (2, s, 3)
    tail = x.slice(0, 1, None).pad(1, 1, "s")  # (s - 1, 7 + s)
    head = x.slice(0, 0, "s // 2 + 1", 1).T  # (6, s//2 + 1)
    bcast = x.slice(1, 2, 3).broadcast_to(("s", 4))  # (s, 4)
    for name, t in (("merged", merged), ("split", split), ("tail", tail), ("head", head), ("bcast", bcast)):
        g.mark_output(name, t * 1.0)
    base = np.arange(s * 6, dtype=np.float32).reshape(s, 6) + 1
    out = run_reference(g, {"x": base}, dims={"s": s})
    np.testing.assert_array_equal(out["merged"], base.reshape(-1))
    np.testing.assert_array_equal(out["split"], base.reshape(s, 3, 2).transpose(2, 0, 1))
    np.testing.assert_array_equal(out["tail"], np.pad(base[1:], ((0, 0), (1, s))))
    np.testing.assert_array_equal(out["head"], base[: s // 2 + 1].T)
    np.testing.assert_array_equal(out["bcast"], np.broadcast_to(base[:, 2:3], (s, 4)))


def test_views_do_not_copy():
    """Movement ops add no nodes; only materialising (contiguous / a reshape strides cannot express) does."""
    g = Graph()
    x = g.input("x", (4, 6))
    before = len(g)
    v = x.T.slice(0, 1, 5, 2).split_dim(1, (2, 2)).pad(2, 1, 1).unsqueeze(0).broadcast_to((3, 2, 2, 4))
    assert len(g) == before
    assert v.node == x.node
    x.T.reshape(24)  # a transposed buffer cannot be flattened by strides: one copy node
    assert len(g) > before
    before = len(g)
    x.pad(1, 1, 1).reshape(2, 16)  # nor can a padded axis be merged: a copy again
    assert len(g) > before


def _run_view(shape, chain) -> tuple[np.ndarray, np.ndarray]:
    g = Graph()
    base = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)
    t = chain(g.input("x", shape))
    g.mark_output("view", t)
    g.mark_output("operand", t * 1.0)
    out = run_reference(g, {"x": base})
    return out["view"], out["operand"]


@pytest.mark.parametrize(
    ("chain", "expected"),
    [
        # a slice that cuts into the padding, then padded again: the cut-off part must read as padding (0)
        (lambda t: t.pad(0, 0, 1).slice(0, 0, 0).pad(0, 0, 1), [0.0]),
        (lambda t: t.pad(0, 1, 0).slice(0, 2, 3).pad(0, 1, 0), [0.0, 2.0]),
        (lambda t: t.slice(0, 1, 3).pad(0, 1, 1), [0.0, 2.0, 3.0, 0.0]),
    ],
)
def test_slice_then_pad_keeps_padding(chain, expected):
    view, operand = _run_view((3,), chain)
    assert view.tolist() == expected
    assert operand.tolist() == expected


def test_reshape_of_an_empty_slice():
    view, operand = _run_view((1, 2), lambda t: t.slice(0, 0, 0).reshape(0))
    assert view.shape == operand.shape == (0,)
