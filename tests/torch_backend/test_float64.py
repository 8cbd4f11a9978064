"""float64 through the torch backend: on the numpy runtime the element-wise float64 ops PyTorch computes (RoPE
tables, as diffusers' FLUX.2 builds them) are translated and computed in f64, static or ``dynamic=True`` (where a
Python float becomes a 0-dim float64 input), giving eager PyTorch's values; an op that would compute float64 in f32
(a matmul) and a runtime without f64 kernels run in eager PyTorch, with a notice."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from luminal_recipes import instrument  # noqa: E402
from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402


class Rope(torch.nn.Module):
    """diffusers' get_1d_rotary_pos_embed in float64 (arange, pow, reciprocal, outer product, cos/sin, casts back
    to float32), at positions large enough that computing the angles in f32 is visibly off."""

    def forward(self, pos, scale: float):
        freqs = 1.0 / (2000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)) / scale
        angles = pos.to(torch.float64)[:, None] * freqs[None, :]
        cos = angles.cos().repeat_interleave(2, dim=1).float()
        sin = angles.sin().repeat_interleave(2, dim=1).float()
        return cos, sin, angles.exp2().rsqrt()  # the last stays float64


def _positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 977.0 + 3.0  # up to ~6e4


@pytest.mark.parametrize("dynamic", [False, True])
def test_float64_rope_tables_are_computed_in_float64(dynamic):
    pos = _positions(64)
    compiled = torch.compile(Rope(), backend="luminal", dynamic=dynamic)
    before = instrument.snapshot()[instrument.LOAD]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)  # translated, nothing in eager
        got = compiled(pos, 1.25)
        got_other = compiled(_positions(48), 1.25)  # another length: the same graph (dynamic) or a recompile
    assert instrument.snapshot()[instrument.LOAD] > before  # a luminal program computed it
    want = Rope()(pos, 1.25)
    assert got[2].dtype == torch.float64 and got[0].dtype == torch.float32
    for g, w in zip(got[:2], want[:2]):
        assert (g - w).abs().max().item() <= 2e-7  # float64 angles, then one rounding to float32
    assert torch.allclose(got[2], want[2], rtol=1e-13, atol=0)
    assert (got_other[0] - Rope()(_positions(48), 1.25)[0]).abs().max().item() <= 2e-7
    # the same tables from float32 angles are off by far more: the check above can tell the two apart
    f32 = (pos[:, None] * (1.0 / (2000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)) / 1.25)).cos()
    assert (f32.repeat_interleave(2, dim=1) - want[0]).abs().max().item() > 1e-3


def test_a_float64_matmul_runs_in_eager_with_a_notice():
    a = torch.randn(4, 5, dtype=torch.float64)
    b = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always", LuminalFallbackWarning)
        got = torch.compile(lambda x, y: (x * 2.0) @ y + 1.0, backend="luminal")(a, b)
    assert torch.equal(got, (a * 2.0) @ b + 1.0)  # PyTorch's own float64 product
    texts = [str(n.message) for n in notices if issubclass(n.category, LuminalFallbackWarning)]
    assert texts and all("float64" in t for t in texts), texts
    assert any("aten.mm" in t for t in texts), texts


def test_float64_falls_back_where_the_runtime_has_no_f64():
    pos = _positions(16)
    compiled = torch.compile(Rope(), backend="luminal", options={"runtime": "cuda-emu"})
    with torch.no_grad(), warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always", LuminalFallbackWarning)
        got = compiled(pos, 1.25)
    want = Rope()(pos, 1.25)
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # eager PyTorch's own values
    texts = [str(n.message) for n in notices if issubclass(n.category, LuminalFallbackWarning)]
    assert texts and all("no f64 kernels" in t for t in texts), texts
