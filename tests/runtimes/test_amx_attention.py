"""The Attention kernel with both products on AMX tiles (``runtimes/cpu/amx/attention.py``: p's bf16x3 parts written
by the softmax pass, k and v packed once per head, keys in blocks with an online softmax): as accurate as f32
attention against float64 (tests/TOLERANCES.md, f32: rtol 1e-5, atol 1e-5) on odd shapes and the fused [q|k|v]
projection's strided layout, in one key block and in several; and the numpy runtime's kernel falling back to its
BLAS path, with that path's values, for operands that are not finite. Skipped where the CPU (or the process)
cannot run AMX."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.graph import Graph, View, run_reference
from luminal_recipes.runtimes.cpu import amx
from luminal_recipes.runtimes.cpu import threads as cpu_threads

needs_amx = pytest.mark.skipif(not amx.available(), reason=f"no AMX here: {amx.reason_unavailable()}")


def _exact(q, k, v, scale):
    x = (q.astype(np.float64) @ k.T.astype(np.float64)) * scale
    p = np.exp(x - x.max(axis=1, keepdims=True))
    return (p @ v.astype(np.float64)) / p.sum(axis=1, keepdims=True)


@needs_amx
@pytest.mark.parametrize(("s", "t", "d", "dv", "rows"), [(256, 768, 64, 64, 256), (37, 70, 33, 20, 32),
                                                         (100, 300, 128, 96, 64), (5, 40, 16, 48, 32)])
@pytest.mark.parametrize("key_block", [None, 64])  # None: all keys in one block
def test_fused_attention_is_as_accurate_as_f32(s, t, d, dv, rows, key_block, monkeypatch):
    """q, k and v strided views of one fused projection (as the transformer's [q|k|v] linear gives them), query
    blocks and key counts that are not multiples of 32, head dims 16-128; keys in one block, or (``key_block``)
    in blocks of 64 with the online softmax: within the f32 tolerance of float64, and within a few times the
    error of numpy's f32 attention."""
    from luminal_recipes.runtimes.cpu.amx import attention as amx_attention

    monkeypatch.setattr(amx_attention, "KEY_BLOCK", key_block or 1024)
    rng = np.random.default_rng(s + t)
    qkv = rng.standard_normal((max(s, t), 2 * d + dv)).astype(np.float32) * 2
    q, k, v = qkv[:s, :d], qkv[:t, d:2 * d], qkv[:t, 2 * d:]
    scale = d**-0.5
    out = np.full((s, dv), np.nan, np.float32)
    assert amx_attention.run(q, k, v, scale, out, rows) == 0
    exact = _exact(q, k, v, scale)
    x = (q * np.float32(scale)) @ k.T
    p = np.exp(x - x.max(axis=1, keepdims=True))
    numpy_error = np.abs((p @ v) / p.sum(axis=1, keepdims=True) - exact).max()
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)
    assert np.abs(out - exact).max() <= 4 * numpy_error + 1e-6


@needs_amx
@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_fused_attention_leaves_nonfinite_operands_to_blas(bad, numpy_runtime, monkeypatch):
    """An inf in one head's q, k or v: the fused task reports it (in bf16 parts inf times a zero part would be
    NaN) and that head's tasks run on the BLAS path, with its values (NaN and inf where it has them, the rest
    within the tolerance); the other heads stay fused and match the reference."""
    from luminal_recipes.runtimes.cpu.amx import attention as amx_attention

    h, s, d = 3, 64, 32
    g = Graph()
    q, k, v = (g.input(name, (1, h, s, d)) for name in ("q", "k", "v"))
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, scale=0.3))
    f = Fused(g)
    y = f.add("Attention", [q, k, v], (1, h, s, d), scale=0.3)
    program = f.program(y=y)
    rng = np.random.default_rng(7)
    inputs = {name: rng.standard_normal((1, h, s, d)).astype(np.float32) for name in ("q", "k", "v")}
    inputs[bad][0, 1, 5, 3] = np.inf
    monkeypatch.setattr(amx, "MIN_MACS", 1)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    fused = []
    task = amx_attention.task
    monkeypatch.setattr(amx_attention, "task", lambda *args: fused.append(1) or task(*args))
    ours = numpy_runtime.run(program, inputs)["y"]
    assert fused, "the attention did not take the fused AMX path"
    monkeypatch.setattr(amx_attention, "ready", lambda: False)
    blas = numpy_runtime.run(program, inputs)["y"]
    finite = np.isfinite(blas)
    assert not finite[0, 1].all()
    np.testing.assert_array_equal(ours[~finite], blas[~finite])  # inf and NaN where the BLAS path has them
    np.testing.assert_allclose(ours[finite], blas[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours[0, ::2], run_reference(g, inputs)["y"][0, ::2], rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize(("op", "attrs"), [("Attention", {}), ("AttentionBlocked", {"block": 16})])
def test_fused_attention_in_key_blocks_through_the_runtime(op, attrs, numpy_runtime, monkeypatch):
    """The runtime's kernels (``AttentionBlocked`` too: the fused kernel takes keys in blocks of its own) on the
    fused path with keys in several blocks and query blocks taken in turn by 1, 2 and 3 parts, each part packing
    k and v of the heads it meets: the reference's values, the same bits on every part count (a task's result
    does not depend on the part that runs it)."""
    from luminal_recipes.runtimes.cpu.amx import attention as amx_attention
    from luminal_recipes.runtimes.cpu.kernels import attention as numpy_attention

    b, h, s, t, d = 1, 3, 90, 150, 32
    g = Graph()
    q, k, v = g.input("q", (b, h, s, d)), g.input("k", (b, h, t, d)), g.input("v", (b, h, t, d))
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, scale=0.2))
    f = Fused(g)
    y = f.add(op, [q, k, v], (b, h, s, d), scale=0.2, **attrs)
    program = f.program()
    program.outputs["y"] = (y, View.contiguous((b, h, s, d)))
    rng = np.random.default_rng(3)
    inputs = {name: rng.standard_normal(x.shape).astype(np.float32) * 2 for name, x in (("q", q), ("k", k), ("v", v))}
    monkeypatch.setattr(amx, "MIN_MACS", 1)
    monkeypatch.setattr(amx_attention, "KEY_BLOCK", 64)
    monkeypatch.setattr(numpy_attention, "FUSED_ROWS", 32)  # 3 query blocks per head
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    packs = []
    pack = amx_attention.pack_kv
    monkeypatch.setattr(amx_attention, "pack_kv", lambda *args: packs.append(1) or pack(*args))
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(program, inputs)["y"])
    assert packs, "the attention did not take the fused AMX path"
    np.testing.assert_allclose(results[0], run_reference(g, inputs)["y"], rtol=1e-5, atol=1e-5)
    for other in results[1:]:
        assert np.array_equal(other, results[0])
