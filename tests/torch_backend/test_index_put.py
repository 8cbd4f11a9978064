"""``aten.index_put`` (what AOTAutograd makes of ``x[..., idx, :] = v``, ``index_copy_``, ``index_put_``: a
static KV cache's update) against eager PyTorch: several index forms, exactly; negative indices wrapped and out of
range ones refused, as torch; repeated indices as torch documents them; an input updated in place in torch's
memory; the forms not translated fall back with the notice. And a ``SymInt`` operand of ``add`` (a cache length
plus the prompt's), fed with each call's value."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from luminal_recipes.errors import LuminalError  # noqa: E402
from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402


def _strict(fn, **kw):
    """``fn`` compiled; any fallback to eager fails the test."""
    compiled = torch.compile(fn, backend="luminal", **kw)

    def call(*args):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LuminalFallbackWarning)
            return compiled(*args)
    return call


def _put(x, where, v):
    y = x.clone()
    y[where] = v
    return y


def forms(x, c, pos, i, j, v4, v_rows, v_pairs, v_grid):
    """The index forms: the static cache's (the sequence axis of [B, H, C, D]), the leading axis, two adjacent
    index tensors broadcast together, a broadcast [3, 1] x [3] index after a leading axis, values broadcast along
    rows and a 0-dim value."""
    return (_put(c, (slice(None), slice(None), pos), v4),
            _put(x, (i,), v_rows),
            _put(x, (i, j), v_pairs),
            _put(x, (slice(None), i[:, None], j), v_grid),
            _put(x, (i,), v_rows[:1]),
            _put(x, (slice(None), j), torch.tensor(2.5)))


def _args(g, pos):
    x = torch.randn(4, 5, 6, generator=g)
    c = torch.randn(1, 2, 8, 3, generator=g)
    i, j = torch.tensor([0, -1, 2]), torch.tensor([1, 3, -2])
    return (x, c, pos, i, j, torch.randn(1, 2, len(pos), 3, generator=g), torch.randn(3, 5, 6, generator=g),
            torch.randn(3, 6, generator=g), torch.randn(4, 3, 3, generator=g))


def test_index_put_forms_write_the_same_values():
    g = torch.Generator().manual_seed(0)
    args = _args(g, torch.tensor([5, 6]))
    for got, want in zip(_strict(forms)(*args), forms(*args)):
        assert torch.equal(got, want)


def test_negative_indices_count_from_the_end_and_out_of_range_ones_raise():
    g = torch.Generator().manual_seed(1)
    args = _args(g, torch.tensor([-1, -8]))  # the cache's last and first rows
    compiled = _strict(forms)
    for got, want in zip(compiled(*args), forms(*args)):
        assert torch.equal(got, want)
    # one past the sequence axis: torch raises; flattened with the head axis it would be the next head's first
    # row, so it must raise here too, not write there
    bad = _args(g, torch.tensor([8, 0]))
    with pytest.raises(IndexError):
        forms(*bad)
    with pytest.raises((LuminalError, IndexError), match="out of range"):
        compiled(*bad)
    with pytest.raises((LuminalError, IndexError), match="out of range"):
        compiled(*_args(g, torch.tensor([-9, 0])))
    # two index tensors: (1, 5) in a [4, 5] block is flat row 10, i.e. (2, 0); it must raise, not write there
    pairs = _strict(lambda x, i, j, v: x.index_put((i, j), v))
    x, v = torch.randn(4, 5, 6, generator=g), torch.randn(2, 6, generator=g)
    i, j = torch.tensor([0, 1]), torch.tensor([1, 4])
    assert torch.equal(pairs(x, i, j, v), x.index_put((i, j), v))
    j = torch.tensor([1, 5])
    with pytest.raises(IndexError):
        x.index_put((i, j), v)
    with pytest.raises((LuminalError, IndexError), match="out of range"):
        pairs(x, i, j, v)


def test_index_copy_writes_the_same_rows_and_refuses_negative_indices_as_torch():
    """transformers' StaticCache update, ``keys.index_copy_(2, positions, k)``: torch's index_copy refuses a
    negative index (where ``index_put`` wraps it), so ours raises too."""
    def f(c, pos, v):
        return c.index_copy(2, pos, v), c.index_copy(-1, pos[:1].clamp(0, 2), c[..., :1] * 2)

    g = torch.Generator().manual_seed(5)
    c, v = torch.randn(1, 2, 8, 3, generator=g), torch.randn(1, 2, 2, 3, generator=g)
    compiled = _strict(f)
    for pos in (torch.tensor([5, 6]), torch.tensor([2, 0])):
        for got, want in zip(compiled(c, pos, v), f(c, pos, v)):
            assert torch.equal(got, want)
    for pos in (torch.tensor([-1, 0]), torch.tensor([1, 8])):
        with pytest.raises(IndexError):
            f(c, pos, v)
        with pytest.raises((LuminalError, IndexError), match="out of range"):
            compiled(c, pos, v)


def test_repeated_indices_write_one_of_their_values():
    """torch.Tensor.index_put_: with accumulate=False and repeated indices "the behavior is undefined"; each row
    written is one of the values given for it, every other row is x's."""
    def f(x, i, v):
        return x.index_put((i,), v)

    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(5, 4, generator=g), torch.randn(4, 4, generator=g)
    i = torch.tensor([1, 3, 1, -4])  # row 1 three times (-4 is 1)
    got = _strict(f)(x, i, v)
    assert torch.equal(got[[0, 2, 4]], x[[0, 2, 4]])
    assert torch.equal(got[3], v[1])
    assert any(torch.equal(got[1], v[k]) for k in (0, 2, 3))


class Cache(torch.nn.Module):
    """A static cache updated in place at a position held in a 0-dim tensor, as transformers' StaticCache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(1, 2, 6, 4))
        self.register_buffer("length", torch.zeros((), dtype=torch.int64))

    def forward(self, k):
        pos = torch.arange(k.shape[2]) + self.length
        self.keys.index_copy_(2, pos, k)
        self.length.add_(k.shape[2])
        return self.keys.sum(2)


def test_an_input_updated_in_place_is_updated_in_torchs_memory():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, 2, n, 4, generator=g) for n in (2, 1, 1, 2)]
    eager, ours = Cache(), Cache()
    compiled = _strict(ours)
    for k in steps:
        want = eager(k)
        got = compiled(k)
        assert torch.equal(got, want)
        assert torch.equal(ours.keys, eager.keys) and int(ours.length) == int(eager.length)
    assert int(ours.length) == 6


def test_accumulate_and_boolean_masks_fall_back_with_a_notice():
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(5, 4, generator=g), torch.randn(3, 4, generator=g)
    i = torch.tensor([1, 3, 1])
    f = torch.compile(lambda x, i, v: x.index_put((i,), v, accumulate=True), backend="luminal")
    with torch.no_grad(), pytest.warns(LuminalFallbackWarning, match=r"index_put.*accumulate=True"):
        assert torch.equal(f(x, i, v), x.index_put((i,), v, accumulate=True))
    torch._dynamo.reset()
    f = torch.compile(lambda x: _put(x, x > 0, torch.tensor(0.0)), backend="luminal")
    with torch.no_grad(), pytest.warns(LuminalFallbackWarning, match=r"index_put.*boolean mask"):
        assert torch.equal(f(x), x.clamp(max=0))


def test_a_symbolic_size_as_an_operand_is_each_calls_value():
    """``positions + length``, ``arange(n) + n`` with the length a SymInt (dynamic=True): each call computes with
    its own length, not with the size bucket's the program was loaded for."""
    def f(x, start):
        n = x.shape[1]
        return x + n, torch.arange(n) + n, start + n * 2

    compiled = _strict(f, dynamic=True)
    for n in (3, 5, 6, 7):
        x, start = torch.randn(2, n), torch.tensor(4)
        for got, want in zip(compiled(x, start), f(x, start)):
            assert torch.equal(got, want)
