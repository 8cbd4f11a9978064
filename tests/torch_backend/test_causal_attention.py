"""``F.scaled_dot_product_attention(..., is_causal=True)`` through ``torch.compile(backend="luminal")``: the
numpy attention kernel skips the keys the causal mask hides (``runtimes/cpu/kernels/attention.py``, blocks of
rows in pieces each with its own keys), and gives eager PyTorch's float64 values (tests/TOLERANCES.md) at
lengths that are not multiples of the pieces (64 rows here), with q_len != kv_len (torch's top-left causal mask) and
with grouped-query heads. A spy on ``_pieces`` shows the skipping ran."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

from luminal_recipes.runtimes.cpu.kernels import attention as numpy_attention  # noqa: E402
from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402


class CausalAttention(torch.nn.Module):
    """Queries from ``x``, keys and values from ``memory`` (a prompt chunk over a longer context when the two
    lengths differ), 4 query heads over 2 kv heads of 16, torch's causal mask."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(32, 64)
        self.kv = torch.nn.Linear(32, 64)

    def forward(self, x, memory):
        b, s, _ = x.shape
        t = memory.shape[1]
        q = self.q(x).view(b, s, 4, 16).transpose(1, 2)
        k, v = (y.view(b, t, 2, 16).transpose(1, 2) for y in self.kv(memory).split(32, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, 64)


@pytest.mark.parametrize(("s", "t"), [(150, 150), (100, 180), (181, 150)])
def test_causal_sdpa_skips_masked_keys_with_eager_values(s, t, assert_close, monkeypatch):
    monkeypatch.setattr(numpy_attention, "SKIP_ROWS", 64)  # pieces of 64 rows at these lengths
    skipped = []
    pieces = numpy_attention._pieces
    monkeypatch.setattr(numpy_attention, "_pieces", lambda *a, **kw: skipped.append(pieces(*a, **kw)) or
                        skipped[-1])
    torch.manual_seed(0)
    model = CausalAttention().eval()
    x, memory = torch.randn(1, s, 32), torch.randn(1, t, 32)
    compiled = torch.compile(model, backend="luminal")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = compiled(x, memory)
        want = float64_twin(model)(x.double(), memory.double())
    assert_close("model", got, want)
    used = [p for p in skipped if p is not None]
    assert used, "the causal mask's keys were not skipped"
    if s >= 128:
        assert any(len(p) > 1 for p in used)  # a block of rows cut into pieces, each with its own keys
