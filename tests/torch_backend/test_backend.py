"""The torch.compile backend's mechanics on small modules written here: registration, options, parity of the
translated ops against eager PyTorch in float64, graph breaks on an untranslated op (a notice naming it, the
right result), LUMINAL_TORCH_STRICT=1, and a new sequence length served by re-binding (no new search or load)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

import luminal_recipes  # noqa: E402
import luminal_recipes.torch_backend as luminal_torch  # noqa: E402
from luminal_recipes import instrument  # noqa: E402
from luminal_recipes.errors import InputError, LuminalError  # noqa: E402
from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402
from luminal_recipes.torch_backend.translate import UnsupportedTorchOp  # noqa: E402


class Block(torch.nn.Module):
    """A transformer-ish block using many translated ops: linear, layer norm, gelu, softmax, SDPA, cat, masks."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(32, 16))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(16, -1)
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, 16))
        h = x + self.mlp(x)
        gate = torch.sigmoid(h.mean(-1, keepdim=True)) * torch.softmax(h, -1).amax(-1, keepdim=True)
        return torch.cat([h * gate, torch.where(h > 0, h, 0.1 * h).abs().sqrt()], -1)


def test_registered_as_a_dynamo_backend():
    assert "luminal" in torch._dynamo.list_backends()


def test_block_matches_eager_in_float64(assert_close):
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 6, 16)
    compiled = torch.compile(model, backend="luminal")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)  # everything here is translated
        got = compiled(x)
        want = float64_twin(model)(x.double())
    assert_close("model", got, want)


def test_the_package_called_returns_a_backend_with_options(assert_close):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    backend = luminal_recipes.torch_backend(runtime="numpy", max_memory="1GiB")
    with torch.no_grad():
        assert_close("model", torch.compile(model, backend=backend)(x), float64_twin(model)(x.double()))
    with pytest.raises(InputError, match="compute_dtype"):
        luminal_torch(compute_dtype="f64")
    with pytest.raises(InputError, match="unknown runtime 'tpu'"):
        luminal_torch(runtime="tpu")


def test_bf16_compute_dtype_stays_within_bf16_tolerance(assert_close):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = torch.compile(model, backend=luminal_torch(compute_dtype="bf16"))(x)
        want = float64_twin(model)(x.double())
    assert got.dtype == torch.float32
    assert_close("model", got, want, dtype="bf16")


def test_a_bfloat16_model_binds_its_weights_and_returns_bfloat16(assert_close):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8)).eval()
    x = torch.randn(4, 16)
    want = float64_twin(model)(x.double())
    with torch.no_grad():
        got = torch.compile(model.to(torch.bfloat16), backend="luminal")(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert_close("model", got, want, dtype="bf16")


class WithSort(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.sort(torch.tanh(self.a(x)), dim=1).values)


def test_an_untranslated_op_falls_back_to_eager_with_a_notice(assert_close):
    torch.manual_seed(3)
    model = WithSort().eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), pytest.warns(LuminalFallbackWarning, match=r"aten\.sort\.default is not translated"):
        got = torch.compile(model, backend="luminal")(x)
    assert_close("model", got, float64_twin(model)(x.double()))


def test_strict_mode_makes_the_fallback_an_error(monkeypatch):
    monkeypatch.setenv("LUMINAL_TORCH_STRICT", "1")
    model = WithSort().eval()
    with torch.no_grad(), pytest.raises(UnsupportedTorchOp, match=r"aten\.sort\.default is not translated.*"
                                        r"LUMINAL_TORCH_STRICT=1 forbids"):
        torch.compile(model, backend="luminal")(torch.randn(2, 5, 8))
    assert issubclass(UnsupportedTorchOp, LuminalError)


def test_a_new_length_rebinds_within_its_bucket(assert_close):
    torch.manual_seed(4)
    model = Block().eval()
    compiled = torch.compile(model, backend="luminal")
    twin = float64_twin(model)
    with torch.no_grad():
        for s in (3, 5):  # the second length makes Dynamo trace the length as a symbol: one more compile
            compiled(torch.randn(1, s, 16))
        before = instrument.snapshot()
        for s in (6, 7):  # within the power-of-two bucket the symbolic program was loaded for (8)
            x = torch.randn(1, s, 16)
            assert_close("model", compiled(x), twin(x.double()))
        after = instrument.snapshot()
    assert after[instrument.SEARCH] == before[instrument.SEARCH]
    assert after[instrument.LOAD] == before[instrument.LOAD]


class Indexing(torch.nn.Module):
    def forward(self, x, i, j):
        return x[:, i[:, None], j], x[i, :, j], x[..., j], x[i], x.index_select(1, j.abs())


def test_advanced_indexing_selects_the_same_values(assert_close):
    x = torch.randn(4, 5, 6)
    i, j = torch.tensor([0, -1, 2]), torch.tensor([1, 3, -2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = torch.compile(Indexing(), backend="luminal")(x, i, j)
    for g, w in zip(got, Indexing()(x, i, j)):
        assert_close("index", g, w)


def test_int64_inputs_beyond_int32_are_refused_few_or_many():
    """int64 ids are computed in int32: a value outside its range is refused, whether the input holds a few values
    (checked in Python) or many (checked by torch), at the bound itself too; the range's ends pass."""
    from luminal_recipes.graph import DType
    from luminal_recipes.torch_backend.params import to_numpy

    top, bottom = 2**31 - 1, -(2**31)
    for size in (1, 3, 64, 65, 4096):
        ok = torch.full((size,), top, dtype=torch.int64)
        ok[0] = bottom
        assert to_numpy(ok, DType.I32, "input ids").tolist() == ok.tolist()
        for bad in (top + 1, bottom - 1):
            t = ok.clone()
            t[-1] = bad
            with pytest.raises(InputError, match="beyond the int32 range"):
                to_numpy(t, DType.I32, "input ids")
    assert to_numpy(torch.zeros((0,), dtype=torch.int64), DType.I32, "input ids").shape == (0,)


@pytest.mark.parametrize("shape", [(), (1, 1), (2, 3), (0, 3), (2, 0, 4), (3, 5, 4), (9, 9)])
def test_int64_inputs_as_int32_of_their_shape(shape):
    """A few int64 values (converted from Python ints) or many (numpy's cast): int32 of the tensor's shape and
    values, whatever its strides (a transposed view), as numpy converts them."""
    from luminal_recipes.graph import DType
    from luminal_recipes.torch_backend.params import to_numpy

    t = torch.arange(-20, -20 + math.prod(shape), dtype=torch.int64).reshape(shape) * 1000
    for given in (t, t.transpose(0, -1) if t.dim() > 1 else t):
        got = to_numpy(given, DType.I32, "input ids")
        assert got.dtype == np.int32 and got.shape == tuple(given.shape)
        assert np.array_equal(got, given.numpy().astype(np.int32))
