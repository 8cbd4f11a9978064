"""Op-library graphs run as naive primitive Programs (``Program.from_graph``) on the numpy runtime, against
the reference interpreter: every HLIR primitive with every kind of view (transposed, sliced, padded,
broadcast), symbolic dims bound to several values, and the dtypes the ops accept."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.graph import DType, Graph, cast
from luminal_recipes.runtimes.program import Program


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_mlp(compare, rng):
    g = Graph()
    x = g.input("x", ("s", 12))
    w1, b1, w2 = g.weight("w1", (20, 12)), g.weight("b1", (20,)), g.weight("w2", (6, 20))
    h = ops.gelu(ops.linear(x, w1, b1), approximate="tanh")
    g.mark_output("y", ops.linear(ops.silu(h) * ops.gelu(h), w2))
    weights = {"w1": randn(rng, 20, 12), "b1": randn(rng, 20), "w2": randn(rng, 6, 20)}
    for s in (1, 4, 9):
        compare(g, Program.from_graph(g), {"x": randn(rng, s, 12)}, weights, {"s": s})


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_attention_block_with_rope_masks_and_grouped_heads(dtype, compare, rng):
    npd = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype]
    b, h, hkv, d = 2, 4, 2, 8
    g = Graph()
    q = g.input("q", (b, h, "s", d), dtype)
    k = g.input("k", (b, hkv, "s", d), dtype)
    v = g.input("v", (b, hkv, "s", d), dtype)
    cos, sin = g.input("cos", ("s", d), dtype), g.input("sin", ("s", d), dtype)
    keep = g.input("keep", (b, "s"), "bool")
    q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin, style="pairs")
    y = ops.scaled_dot_product_attention(q, k, v, causal=True, window=3, key_mask=keep)
    g.mark_output("y", y)
    for s in (3, 6):
        c, sn = ops.rope_tables(np.arange(s), d)
        keep_mask = np.ones((b, s), bool)
        keep_mask[1, -1] = False
        inputs = {"q": randn(rng, b, h, s, d, dtype=npd), "k": randn(rng, b, hkv, s, d, dtype=npd),
                  "v": randn(rng, b, hkv, s, d, dtype=npd), "cos": c.astype(npd), "sin": sn.astype(npd),
                  "keep": keep_mask}
        compare(g, Program.from_graph(g), inputs, dims={"s": s}, dtype=dtype)


def test_conv_norms_upsample(compare, rng):
    g = Graph()
    x = g.input("x", (1, 4, 6, 5))
    w, bias = g.weight("w", (8, 4, 3, 3)), g.weight("b", (8,))
    gamma, beta = g.weight("gamma", (8,)), g.weight("beta", (8,))
    y = ops.conv2d(x, w, bias, stride=2, padding=1)
    y = ops.group_norm(y, 2, gamma, beta)
    g.mark_output("up", ops.upsample_nearest2x(y))
    seq = y.reshape(1, 8, 9).transpose(1, 2)  # [1, 9, 8] tokens, a strided view
    g.mark_output("ln", ops.layer_norm(seq, g.weight("lw", (8,)), g.weight("lb", (8,))))
    g.mark_output("rms", ops.rms_norm(seq, eps=1e-6))
    weights = {"w": randn(rng, 8, 4, 3, 3), "b": randn(rng, 8), "gamma": randn(rng, 8), "beta": randn(rng, 8),
               "lw": randn(rng, 8), "lb": randn(rng, 8)}
    compare(g, Program.from_graph(g), {"x": randn(rng, 1, 4, 6, 5)}, weights)


def test_index_ops(compare, rng):
    g = Graph()
    ids = g.input("ids", (2, 5), "i32")
    table = g.weight("table", (11, 6))
    emb = ops.embedding(ids, table)
    vals, idx = ops.topk(emb, 2)
    g.mark_output("argmax", ops.argmax(emb, -1))
    g.mark_output("topv", vals)
    g.mark_output("topi", idx)
    g.mark_output("where", ops.where(emb > 0.0, emb, -1.0))
    cache = g.input("cache", (7, 6))
    g.mark_output("cache", ops.write_rows(cache, g.input("pos", (2,), "i32"), emb.slice(0, 0, 1).squeeze(0)
                                          .slice(0, 1, 3)))
    inputs = {"ids": rng.integers(0, 11, (2, 5)).astype(np.int32), "cache": randn(rng, 7, 6),
              "pos": np.array([5, 2], np.int32)}
    got, want = compare(g, Program.from_graph(g), inputs, {"table": randn(rng, 11, 6)}, family="index",
                        names=["topv", "where", "cache"])
    for name in ("argmax", "topi"):
        assert got[name].dtype == np.int32 and np.array_equal(got[name], want[name])


@pytest.mark.parametrize("dst", ["f16", "bf16", "f8e4m3", "f8e5m2", "i32", "bool"])
def test_casts_are_bit_exact(dst, runtime, rng):
    from luminal_recipes.graph import run_reference

    g = Graph()
    x = g.input("x", (40,))
    g.mark_output("y", cast(x * 3.0, dst))
    g.mark_output("z", cast(cast(x, dst), "f32") + 1.0)
    inputs = {"x": randn(rng, 40)}
    want = run_reference(g, inputs)
    got = runtime.run(Program.from_graph(g), inputs)
    assert got["y"].dtype == DType(dst).np  # the declared dtype (the reference holds fp8 in f32)
    for name in ("y", "z"):
        assert np.array_equal(got[name].astype(np.float64), want[name].astype(np.float64), equal_nan=True)


@pytest.mark.parametrize("layout", ["modelopt", "comfy"])
def test_dequant_graphs(layout, compare, rng):
    n, k = 24, 32
    w_shape = (n, k // 2) if layout == "modelopt" else (32, k // 2)
    s_shape = (n, k // 16) if layout == "modelopt" else (128, 4)
    g = Graph()
    x = g.input("x", (3, k))
    fp8 = ops.dequant_fp8(g.weight("w8", (n, k), "f8e4m3"), g.weight("s8", (n,)))
    nvfp4 = ops.dequant_nvfp4(g.weight("w4", w_shape, "u8"), g.weight("s4", s_shape, "f8e4m3"),
                              g.weight("s4_2", ()), n, k, layout)
    g.mark_output("fp8", ops.linear(x, fp8))
    g.mark_output("nvfp4", ops.linear(x, nvfp4))
    weights = {"w8": randn(rng, n, k).astype(ml_dtypes.float8_e4m3fn), "s8": rng.random(n).astype(np.float32),
               "w4": rng.integers(0, 256, w_shape).astype(np.uint8),
               "s4": (rng.random(s_shape) + 0.5).astype(ml_dtypes.float8_e4m3fn),
               "s4_2": np.asarray(0.5, np.float32)}
    compare(g, Program.from_graph(g), {"x": randn(rng, 3, k)}, weights)
