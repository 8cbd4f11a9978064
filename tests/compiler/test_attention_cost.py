"""The cost model ranks the ways of computing attention as the numpy runtime runs them, on the attention shapes the
shipped recipes produce: whole-row ``Attention`` cheapest, then ``AttentionBlocked`` (the same products plus a
rescale per key block and more calls), then MatMul -> scale (+ mask) -> Softmax -> MatMul (which writes every
score to memory and reads it back, three times). Measured on this project's 2-core machine with programs of these
shapes (bench/README.md, "Where the time goes"): where the scores are few (a decoding step, the tiny VAE's 60
tokens) the three take about the same time (tens of microseconds, mostly calls) and only ``Attention`` first is
pinned. This pins the ordering, not timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luminal_recipes.compiler.cost import program_cost
from luminal_recipes.graph import Graph, Node, View, to_dtype
from luminal_recipes.runtimes.cpu.backend import CPU
from luminal_recipes.runtimes.program import Program

F32 = to_dtype("f32")
TINY = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny" / "checkpoint"

# name: (kv heads, query heads per kv head, query tokens, keys, head_dim, causal/padding mask bias)
SHAPES = {
    # FLUX.2 text encoder (Mistral-3) at 512 tokens: the shipped tiny checkpoint, and bench/flux2_cpu.py's medium
    "tiny text encoder": (1, 2, 512, 512, 8, True),
    "medium text encoder": (2, 2, 512, 512, 8, True),
    # FLUX.2 transformer, joint attention over image + 512 text tokens: tiny 80x48 (15 image tokens), medium
    # 256x256 (256), FLUX.2-dev at 1024x1024 (4096; 4 of its 48 heads)
    "tiny transformer": (4, 1, 527, 527, 16, False),
    "medium transformer": (4, 1, 768, 768, 64, False),
    "FLUX.2-dev transformer": (4, 1, 4608, 4608, 128, False),
    # the VAE decoder's mid-block attention: one head over the latent pixels, channels as head_dim
    "tiny VAE mid": (1, 1, 60, 60, 32, False),
    "medium VAE mid": (1, 1, 1024, 1024, 128, False),
    # text generation (bench/llm_cpu.py's Qwen3 shape: 12 query / 4 kv heads of 64): prefill and decode steps
    "LLM prefill 128": (4, 3, 128, 128, 64, True),
    "LLM decode, context 128": (4, 3, 1, 128, 64, True),
    "LLM decode, context 1024": (4, 3, 1, 1024, 64, True),
}


def attention_program(kind: str, kv: int, rep: int, s: int, t: int, d: int, bias: bool) -> Program:
    """One way of computing attention of q [kv, rep, s, d] over k, v [kv, t, d] (shared by the ``rep`` query
    heads of a kv head, a stride-0 view, as grouped-query attention reads them) with a mask bias [s, t]."""
    g = Graph()
    q, k, v = g.input("q", (kv, rep, s, d), "f32"), g.input("k", (kv, t, d), "f32"), g.input("v", (kv, t, d), "f32")
    mask = g.input("bias", (s, t), "f32") if bias else None
    nodes = list(g.nodes)
    shared = View((kv, rep, t, d), (t * d, 0, d, 1))
    bias_view = View((kv, rep, s, t), (0, 0, t, 1))
    out_shape, scale = (kv, rep, s, d), d ** -0.5

    def add(op, inputs, shape, **attrs):
        nodes.append(Node(len(nodes), op, tuple(inputs), shape, F32, tuple(sorted(attrs.items()))))
        return nodes[-1]

    if kind != "unfused":
        ins = [(q.node, q.view), (k.node, shared), (v.node, shared)] + ([(mask.node, bias_view)] if bias else [])
        out = add(kind, ins, out_shape, scale=scale, **({"block": 128} if kind == "AttentionBlocked" else {}))
    else:
        scores = (kv, rep, s, t)
        dense = View.contiguous(scores)
        mm = add("MatMul", [(q.node, q.view), (k.node, View((kv, rep, d, t), (t * d, 0, 1, d)))], scores)
        if bias:
            scaled = add("Elementwise", [(mm.id, dense), (mask.node, bias_view)], scores,
                         expr=f"(Add (Mul in0 (Const {scale})) in1)")
        else:
            scaled = add("Elementwise", [(mm.id, dense)], scores, expr=f"(Mul in0 (Const {scale}))")
        p = add("Softmax", [(scaled.id, dense)], scores)
        out = add("MatMul", [(p.id, dense), (v.node, shared)], out_shape)
    return Program(nodes, {"y": (out.id, View.contiguous(out_shape))})


def test_the_tiny_shapes_are_the_shipped_checkpoints():
    """The table's tiny rows follow the shipped checkpoint's configs (so the test follows the recipes)."""
    text = json.loads((TINY / "text_encoder" / "config.json").read_text())
    text = text.get("text_config", text)
    kv, rep, _, _, d, _ = SHAPES["tiny text encoder"]
    assert (kv, kv * rep, d) == (text["num_key_value_heads"], text["num_attention_heads"], text["head_dim"])
    transformer = json.loads((TINY / "transformer" / "config.json").read_text())
    heads, _, s, _, d, _ = SHAPES["tiny transformer"]
    assert (heads, d) == (transformer["num_attention_heads"], transformer["attention_head_dim"])
    assert s == (80 // 16) * (48 // 16) + 512  # the README's 80x48 image: 8x VAE, 2x2 patches; 512 text tokens
    vae = json.loads((TINY / "vae" / "config.json").read_text())
    _, _, s, _, d, _ = SHAPES["tiny VAE mid"]
    assert vae["mid_block_add_attention"] and d == vae["block_out_channels"][-1] and s == (80 // 8) * (48 // 8)


FEW_SCORES = 1 << 14  # query tokens x keys below which the three measure alike


@pytest.mark.parametrize("shape", SHAPES)
def test_cost_model_ranks_fused_attention_first(shape):
    costs = {kind: program_cost(attention_program(kind, *SHAPES[shape]), {}, CPU)
             for kind in ("Attention", "AttentionBlocked", "unfused")}
    assert costs["Attention"] < min(costs["AttentionBlocked"], costs["unfused"]), costs
    _, _, s, t, _, _ = SHAPES[shape]
    if s * t >= FEW_SCORES:
        assert costs["AttentionBlocked"] < costs["unfused"], costs


def test_tiny_text_encoder_compiles_to_whole_row_attention():
    """The shipped tiny text encoder at FLUX.2's 512 tokens: the cost model's pick computes every layer's attention
    with ``Attention`` (the case where a timed search under load once picked ``AttentionBlocked``)."""
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.recipe.builder import build
    from luminal_recipes.runtimes.registry import get_runtime

    recipes = TINY.parents[1]
    model = build(recipes / "mistral3-text-encoder.yaml", weights=TINY / "text_encoder")
    plan = compile_graph(model.graph, get_runtime("numpy"), {"batch": 1, "seq": 512},
                         options=SearchOptions(use_cache=False, time_top=0))
    counts = plan.program.kernel_counts()
    assert counts.get("Attention") == 30 and "AttentionBlocked" not in counts and "Softmax" not in counts, counts
