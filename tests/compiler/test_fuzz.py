"""Equivalence fuzz test: every program the search can select computes the same function (ARCHITECTURE.md,
invariant 3). For small models built with the op library, many candidates are drawn at random (seeded) from
the extracted choices of every segment and run on the numpy runtime; each must match the reference interpreter
within the dtype tolerance. A mismatch is a rule bug to fix, never a candidate to exclude."""

from __future__ import annotations

import math

import numpy as np
import pytest
from compiler_helpers import check_program, search

from luminal_recipes import ops
from luminal_recipes.graph import Graph

TRIALS = 10


def mlp() -> tuple[Graph, dict]:
    """An MLP with a dense, an FP8 and an NVFP4 layer."""
    g = Graph()
    x = g.input("x", (6, 16))
    h = ops.gelu(ops.linear(x, g.weight("fc1.weight", (32, 16)), g.weight("fc1.bias", (32,))))
    h = ops.layer_norm(h, g.weight("ln.weight", (32,)), g.weight("ln.bias", (32,)))
    w2 = ops.dequant_fp8(g.weight("fc2.weight", (32, 32), "f8e4m3"), g.weight("fc2.weight_scale", ()))
    h = ops.linear(ops.silu(h), w2, g.weight("fc2.bias", (32,))) * 0.1
    packed, scale = g.weight("fc3.weight", (8, 16), "u8"), g.weight("fc3.weight_scale", (8, 2), "f8e4m3")
    w3 = ops.dequant_nvfp4(packed, scale, g.weight("fc3.weight_scale_2", ()), 8, 32)
    g.mark_output("y", ops.softmax(ops.linear(h, w3) * 0.1, -1))
    return g, {}


def llama_blocks(layers: int = 2) -> tuple[Graph, dict]:
    """Llama-style decoder layers (RMSNorm, RoPE, grouped-query causal attention, SwiGLU), symbolic length."""
    d, heads, kv, hd, ff = 32, 4, 2, 8, 48
    g = Graph()
    x = g.input("x", (1, "s", d))
    cos = g.input("cos", ("s", hd))
    sin = g.input("sin", ("s", hd))
    for i in range(layers):
        p = f"layers.{i}"
        with g.block(p):
            h = ops.rms_norm(x, g.weight(f"{p}.input_norm", (d,)), 1e-6)
            q = ops.split_heads(ops.linear(h, g.weight(f"{p}.q", (heads * hd, d))), heads)
            k = ops.split_heads(ops.linear(h, g.weight(f"{p}.k", (kv * hd, d))), kv)
            v = ops.split_heads(ops.linear(h, g.weight(f"{p}.v", (kv * hd, d))), kv)
            q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
            o = ops.merge_heads(ops.scaled_dot_product_attention(q, k, v, causal=True))
            x = x + ops.linear(o, g.weight(f"{p}.o", (d, heads * hd)))
            h = ops.rms_norm(x, g.weight(f"{p}.post_norm", (d,)), 1e-6)
            gate = ops.silu(ops.linear(h, g.weight(f"{p}.gate", (ff, d))))
            up = ops.linear(h, g.weight(f"{p}.up", (ff, d)))
            x = x + ops.linear(gate * up, g.weight(f"{p}.down", (d, ff)))
    g.mark_output("y", x)
    return g, {"s": 5}


def flux2_double_block() -> tuple[Graph, dict]:
    """One FLUX.2 double-stream block (diffusers Flux2TransformerBlock) at hidden 32 = 2 heads x 16."""
    d, heads, mlp_hidden, eps = 32, 2, 48, 1e-6
    g = Graph()
    x = g.input("img", (1, 6, d))
    c = g.input("txt", (1, 3, d))
    mod_img = g.input("mod_img", (1, 1, 6 * d))
    mod_txt = g.input("mod_txt", (1, 1, 6 * d))
    cos = g.input("cos", (9, d // heads))
    sin = g.input("sin", (9, d // heads))

    def w(name, shape):
        return g.weight(name, shape)

    def ff(name, h):
        hidden = ops.swiglu(ops.linear(h, w(f"{name}.in", (2 * mlp_hidden, d))))
        return ops.linear(hidden, w(f"{name}.out", (d, mlp_hidden)))

    shift, scale, gate, shift2, scale2, gate2 = ops.chunk(mod_img, 6, 2)
    c_shift, c_scale, c_gate, c_shift2, c_scale2, c_gate2 = ops.chunk(mod_txt, 6, 2)
    nx = ops.modulate(ops.layer_norm(x, None, None, eps), scale, shift)
    nc = ops.modulate(ops.layer_norm(c, None, None, eps), c_scale, c_shift)
    def qk(h, proj, norm):
        heads_view = ops.split_heads(ops.linear(h, w(proj, (d, d))), heads)
        return ops.rms_norm(heads_view, w(norm, (d // heads,)), eps)

    q_x, k_x = qk(nx, "to_q", "norm_q"), qk(nx, "to_k", "norm_k")
    q_c, k_c = qk(nc, "add_q", "norm_aq"), qk(nc, "add_k", "norm_ak")
    v_x = ops.split_heads(ops.linear(nx, w("to_v", (d, d))), heads)
    v_c = ops.split_heads(ops.linear(nc, w("add_v", (d, d))), heads)
    q = ops.apply_rope(ops.concat([q_c, q_x], 2), cos, sin, "pairs")
    k = ops.apply_rope(ops.concat([k_c, k_x], 2), cos, sin, "pairs")
    o = ops.merge_heads(ops.scaled_dot_product_attention(q, k, ops.concat([v_c, v_x], 2)))
    attn_c = ops.linear(o.slice(1, 0, 3), w("to_add_out", (d, d)))
    attn_x = ops.linear(o.slice(1, 3, 9), w("to_out", (d, d)))
    x = x + gate.broadcast_to(x.shape) * attn_x
    x = x + gate2.broadcast_to(x.shape) * ff("ff", ops.modulate(ops.layer_norm(x, None, None, eps), scale2,
                                                                 shift2))
    c = c + c_gate.broadcast_to(c.shape) * attn_c
    c = c + c_gate2.broadcast_to(c.shape) * ff("ff_c", ops.modulate(ops.layer_norm(c, None, None, eps),
                                                                    c_scale2, c_shift2))
    g.mark_output("img_out", x)
    g.mark_output("txt_out", c)
    return g, {}


def vae_resnet_attention() -> tuple[Graph, dict]:
    """A VAE decoder mid-block piece: GroupNorm/SiLU/conv resnet block, then single-head spatial attention."""
    ch, groups, hw = 8, 2, 5
    g = Graph()
    x = g.input("x", (1, ch, hw, hw))

    def w(name, shape):
        return g.weight(name, shape)

    h = ops.silu(ops.group_norm(x, groups, w("norm1.weight", (ch,)), w("norm1.bias", (ch,)), 1e-6))
    h = ops.conv2d(h, w("conv1.weight", (ch, ch, 3, 3)), w("conv1.bias", (ch,)), padding=1)
    h = ops.silu(ops.group_norm(h, groups, w("norm2.weight", (ch,)), w("norm2.bias", (ch,)), 1e-6))
    h = ops.conv2d(h, w("conv2.weight", (ch, ch, 3, 3)), w("conv2.bias", (ch,)), padding=1)
    x = x + h
    n = ops.group_norm(x, groups, w("attn_norm.weight", (ch,)), w("attn_norm.bias", (ch,)), 1e-6)
    seq = n.reshape(1, ch, hw * hw).transpose(1, 2)                              # [1, HW, C]
    q = ops.linear(seq, w("to_q.weight", (ch, ch)), w("to_q.bias", (ch,))).unsqueeze(1)
    k = ops.linear(seq, w("to_k.weight", (ch, ch)), w("to_k.bias", (ch,))).unsqueeze(1)
    v = ops.linear(seq, w("to_v.weight", (ch, ch)), w("to_v.bias", (ch,))).unsqueeze(1)
    o = ops.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(ch)).squeeze(1)
    o = ops.linear(o, w("to_out.weight", (ch, ch)), w("to_out.bias", (ch,)))
    g.mark_output("y", x + o.transpose(1, 2).reshape(1, ch, hw, hw))
    return g, {}


MODELS = {"mlp": mlp, "llama": llama_blocks, "flux2_double_block": flux2_double_block,
          "vae_resnet_attention": vae_resnet_attention}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_random_candidates_match_reference(model, runtime, assert_close):
    graph, dims = MODELS[model]()
    searched = search(graph, runtime, dims, candidates=8, noise=3.0, seed=7)
    rng = np.random.default_rng(2024)
    seen, worst = set(), 0.0
    for trial in range(TRIALS):
        program = searched.assemble(graph, lambda progs: progs[int(rng.integers(len(progs)))])
        key = tuple((n.op, n.inputs, n.attrs) for n in program.nodes)
        if key in seen:
            continue
        seen.add(key)
        worst = max(worst, check_program(graph, program, runtime, assert_close, dims, seed=trial))
    # the draw is not degenerate: several distinct programs, and fused kernels among them
    assert len(seen) >= 3, f"{model}: only {len(seen)} distinct candidates were drawn"
    fused = {n.op for progs in searched.programs.values() for p in progs for n in p.nodes} - {
        "Input", "Constant", "Iota", "Add", "Mul", "Mod", "LessThan", "Exp2", "Log2", "Sin", "Sqrt", "Recip",
        "SumReduce", "MaxReduce", "Cast", "Gather", "Scatter"}
    assert fused, f"{model}: no fused kernel was ever extracted"


def test_naive_and_cheapest_programs_match_reference(runtime, assert_close):
    """The two ends of the search (primitive-only and cheapest) on every fuzz model."""
    for make in MODELS.values():
        graph, dims = make()
        searched = search(graph, runtime, dims, candidates=2)
        for pick in (0, 1):
            program = searched.assemble(graph, lambda progs, pick=pick: progs[min(pick, len(progs) - 1)])
            check_program(graph, program, runtime, assert_close, dims)
