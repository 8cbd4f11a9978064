"""Every op of the op library compiles and its compiled program matches the reference interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from compiler_helpers import check_program

from luminal_recipes import ops
from luminal_recipes.compiler import SearchOptions, compile_graph
from luminal_recipes.graph import Graph


def _unary(fn):
    def build(g):
        return fn(g.input("x", (3, 7)))
    return build


def _attention(**kw):
    def build(g):
        q, k, v = g.input("q", (2, 4, 5, 8)), g.input("k", (2, 2, 5, 8)), g.input("v", (2, 2, 5, 8))
        if "key_mask" in kw:
            kw["key_mask"] = g.input("km", (2, 5), "bool")
        if kw.get("mask") == "bool":
            kw["mask"] = g.input("m", (2, 1, 5, 5), "bool")
        elif kw.get("mask") == "float":
            kw["mask"] = g.input("m", (1, 4, 5, 5))
        return ops.scaled_dot_product_attention(q, k, v, **kw)
    return build


def _nvfp4(layout):
    def build(g):
        x = g.input("x", (3, 32))
        if layout == "modelopt":
            w, s = g.weight("w", (8, 16), "u8"), g.weight("s", (8, 2), "f8e4m3")
        else:
            w, s = g.weight("w", (16, 16), "u8"), g.weight("s", (128, 4), "f8e4m3")
        return ops.linear(x, ops.dequant_nvfp4(w, s, g.weight("s2", ()), 8, 32, layout))
    return build


def _rope(style):
    def build(g):
        x = g.input("x", (1, 2, 5, 8))
        cos, sin = ops.rope_tables(np.arange(5), 8, style=style)
        return ops.apply_rope(x, g.constant(cos), g.constant(sin), style)
    return build


CASES = {
    **{name: _unary(getattr(ops, name)) for name in (
        "abs", "cos", "erf", "exp", "exp2", "gelu", "log2", "recip", "relu", "sigmoid", "sign", "silu", "sin",
        "square", "tanh")},
    "log": lambda g: ops.log(ops.exp(g.input("x", (3, 7)))),
    "sqrt_rsqrt": lambda g: ops.rsqrt(ops.sqrt(ops.square(g.input("x", (3, 7))) + 1.0)),
    "pow": lambda g: ops.pow(ops.square(g.input("x", (3, 7))) + 0.5, 1.5),
    "gelu_tanh": lambda g: ops.gelu(g.input("x", (3, 7)), "tanh"),
    "clamp": lambda g: ops.clamp(g.input("x", (3, 7)), -0.5, 0.5),
    "min_max": lambda g: ops.maximum(g.input("x", (3, 7)), g.input("y", (3, 7))) - ops.minimum(
        g.tensor("x"), g.tensor("y")),
    "where": lambda g: ops.where(ops.greater(g.input("x", (3, 7)), 0.0), g.tensor("x"), -1.0),
    "compare": lambda g: ops.logical_or(ops.less_equal(g.input("x", (4, 5)), 0.1),
                                        ops.not_equal(g.input("y", (4, 5)), g.tensor("x"))),
    "reductions": lambda g: ops.sum(g.input("x", (3, 4, 5)), (0, 2)) + ops.mean(g.tensor("x"), (0, 2))
    + ops.var(g.tensor("x"), (0, 2)) + ops.max(g.tensor("x"), (0, 2)) + ops.min(g.tensor("x"), (0, 2)),
    "softmax": lambda g: ops.softmax(g.input("x", (3, 9)), -1),
    "log_softmax": lambda g: ops.log_softmax(g.input("x", (3, 9)), -1),
    "rms_norm": lambda g: ops.rms_norm(g.input("x", (2, 3, 8)), g.weight("w", (8,))),
    "layer_norm": lambda g: ops.layer_norm(g.input("x", (2, 3, 8)), g.weight("w", (8,)), g.weight("b", (8,))),
    "layer_norm_2axes": lambda g: ops.layer_norm(g.input("x", (2, 3, 8)), axes=2),
    "group_norm": lambda g: ops.group_norm(g.input("x", (2, 4, 3, 3)), 2, g.weight("w", (4,)),
                                           g.weight("b", (4,))),
    "bmm_transposed": lambda g: ops.bmm(g.input("a", (2, 5, 3)).transpose(1, 2), g.input("b", (2, 4, 5)).T),
    "matvec": lambda g: ops.matmul(g.input("a", (4, 6)), g.input("v", (6,))),
    "linear_bf16_weight": lambda g: ops.linear(g.input("x", (3, 6)), g.weight("w", (5, 6), "bf16"),
                                               g.weight("b", (5,), "bf16")),
    "embedding": lambda g: ops.embedding(g.input("ids", (2, 3), "i32"), g.weight("t", (7, 4))),
    "shape_ops": lambda g: ops.concat(ops.split(g.input("x", (2, 9)), [4, 5], 1)[::-1], 1)
    + ops.stack(ops.chunk(g.tensor("x"), 3, 1), 1).reshape(2, 9),
    "rope_half": _rope("half"),
    "rope_pairs": _rope("pairs"),
    "attention": _attention(),
    "attention_causal_window": _attention(causal=True, window=3),
    "attention_key_mask": _attention(key_mask=True),
    "attention_bool_mask": _attention(mask="bool"),
    "attention_float_mask": _attention(mask="float"),
    "conv2d": lambda g: ops.conv2d(g.input("x", (1, 3, 6, 7)), g.weight("w", (4, 3, 3, 3)),
                                   g.weight("b", (4,)), stride=1, padding=1),
    "upsample": lambda g: ops.upsample_nearest2x(g.input("x", (1, 2, 3, 3))),
    "argmax": lambda g: ops.argmax(g.input("x", (4, 6)), -1),
    "topk": lambda g: ops.topk(g.input("x", (3, 6)), 2)[0],
    "write_rows": lambda g: ops.write_rows(g.input("cache", (6, 3)), g.input("pos", (2,), "i32"),
                                           g.input("rows", (2, 3))),
    "casts": lambda g: g.input("x", (3, 5)).cast("bf16").cast("f16").cast("f32")
    + g.tensor("x").cast("i32").cast("f32"),
    "fp8": lambda g: ops.linear(g.input("x", (3, 16)), ops.dequant_fp8(g.weight("w", (4, 16), "f8e4m3"),
                                                                       g.weight("s", (4,)))),
    "nvfp4_modelopt": _nvfp4("modelopt"),
    "nvfp4_comfy": _nvfp4("comfy"),
    "timestep_embedding": lambda g: ops.timestep_embedding(g.input("t", (2,)), 16),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_compiles_and_matches_reference(name, runtime, assert_close):
    g = Graph()
    out = CASES[name](g)
    g.mark_output("out", out)
    plan = compile_graph(g, runtime, options=SearchOptions(use_cache=False, time_top=0))
    family = {"i32": "index", "bool": "compare"}.get(str(out.dtype), "*")
    check_program(g, plan.program, runtime, assert_close, family=family)
