"""The Q8_0 integer products that take two blocks per 512-bit vector (``gguf_q8._q8_kernel``: codes flipped to
unsigned, 128 sum(x) taken off inside the int dot, x in pair order) against gguf-py's dequantized weight times the
rounded x: odd block counts (the 256-bit last block), every remainder of the 4-row tile of x, odd weight-row ranges
(the threads' parts), codes -128 and 127, edge f16 scales, and the runtime's call (``quant_product``) giving the same
codes and values as ``quantize`` + ``matmul_q8``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_data import packed  # noqa: E402

gguf = pytest.importorskip("gguf")
jit_module = pytest.importorskip("luminal_recipes.runtimes.cpu.jit")
if not jit_module.AVAILABLE:
    pytest.skip("numba is not installed", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_q8  # noqa: E402


def _want(raw: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float64)


@pytest.mark.parametrize("blocks", [1, 3, 16, 25])
def test_q8_0_pair_products_over_odd_blocks_rows_and_ranges(blocks):
    rng = np.random.default_rng(blocks)
    k, n = 32 * blocks, 11
    raw = packed(rng, "Q8_0", n, blocks, edge=blocks % 2 == 1).reshape(n, blocks, 34)
    raw[0, :, 2], raw[0, :, 3] = 0x80, 0x7F  # codes -128 and 127
    raw = raw.reshape(n, -1)
    w = _want(raw)
    f16 = gk.f16_table()
    x_all = (rng.standard_normal((9, k)) * 0.05).astype(np.float32)
    x_all[0, :32] = 0.0  # an all-zero block: step 0
    for rows in range(1, 10):
        x = x_all[:rows]
        xq = np.zeros((rows, 2 * k), np.int8)
        xd, xs = np.zeros((rows, blocks), np.float32), np.zeros((rows, blocks), np.float32)
        gguf_q8.quantize(x, xq, xd, xs)
        want = (gguf_q8.codes(xq) * np.repeat(xd, 32, axis=1)) @ w.T
        lo, hi = (0, n) if rows % 2 else (3, n - 1)
        out = np.zeros((rows, n), np.float32)
        gguf_q8.matmul_q8(raw, xq, xd, xs, out, lo, hi, gk.KINDS["Q8_0"], f16)
        assert not out[:, :lo].any() and not out[:, hi:].any()
        scale = max(np.abs(want[:, lo:hi]).max(), 1e-30)
        assert np.abs(out[:, lo:hi] - want[:, lo:hi]).max() <= 1e-6 * scale, (blocks, rows)
        # the runtime's call: x rounded into pair order by the part itself, the same steps and values
        pq, pd, ps = np.zeros_like(xq), np.zeros_like(xd), np.zeros_like(xs)
        run = np.zeros((rows, n), np.float32)
        gguf_q8.quant_product(x, pq, pd, ps, np.zeros((rows, k // 16), np.float32), raw, run, lo, hi,
                              gk.KINDS["Q8_0"], f16)
        assert np.array_equal(pd, xd)
        assert np.array_equal(ps.view(np.int32), -gguf_q8.codes(xq).reshape(rows, blocks, 32).sum(axis=2))
        assert np.array_equal(run, out), (blocks, rows)
