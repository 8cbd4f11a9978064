"""Rewrites that FLUX.2's graph needs in the form torch.compile hands it over (ATen ops on 2-D views of [1, M, K]
activations), each checked against eager PyTorch in float64 (tests/TOLERANCES.md) and for the kernels it makes:
the translated graph compiled as the cost model ranks its candidates (timing on a loaded machine may pick another
program)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_twins import compiled_programs  # noqa: E402  (tests/torch_backend/torch_twins.py)


class SingleBlockOut(torch.nn.Module):
    """FLUX.2's single-stream block ends: the attention output and the MLP's hidden state concatenated along the
    features, projected by one weight (a Linear over [1, M, K]: aten.mm on the concatenation's view(-1, K))."""

    def __init__(self, k1: int, k2: int, n: int):
        super().__init__()
        self.proj = torch.nn.Linear(k1 + k2, n, bias=False)

    def forward(self, attn, mlp):
        return self.proj(torch.cat([attn, mlp], dim=-1))


def test_a_product_over_a_concatenation_is_two_products(monkeypatch, assert_close):
    """matmul.egg, "matmul over a concatenation along K read without its unit axis": concat(a, b) @ W as a @ W[:k1]
    then b @ W[k1:] adding it, no Concat written and read back."""
    torch.manual_seed(0)
    module = SingleBlockOut(24, 40, 16).eval()
    args = (torch.randn(1, 37, 24), torch.randn(1, 37, 40))
    got, programs = compiled_programs(module, args, monkeypatch)
    with torch.no_grad():
        want = module.double()(*(a.double() for a in args))
    assert_close("matmul", got, want)
    (program,) = programs
    counts = program.kernel_counts()
    assert "Concat" not in counts and counts.get("MatMul") == 2, counts
    products = {n.id for n in program.nodes if n.op == "MatMul"}
    assert any(len(n.inputs) == 3 and n.inputs[2][0] in products for n in program.nodes if n.op == "MatMul")
