"""Compile cost of the full-size FLUX.2-dev transformer graph (prints wall time and peak RSS).

The graph mirrors diffusers' ``Flux2Transformer2DModel`` (and recipes/flux2-transformer.yaml): timestep +
guidance embeddings, shared modulation, 8 double-stream blocks, 48 single-stream blocks, adaptive output norm;
hidden 6144 (48 heads x 128), MLP ratio 3, joint_attention_dim 15360, in_channels 128, 4096 image + 512 text
tokens. It is built from shapes only (bf16 weights, as the checkpoint stores them; no values anywhere), each
block inside ``graph.block(name)``, and compiled for the numpy runtime with the memory budget of an 80 GB GPU.

    python bench/compile_cost.py            # full size (targets: < 120 s, < 4 GB peak RSS on 2 cores)
    python bench/compile_cost.py --small    # a quick smoke run at hidden 256

"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from dataclasses import dataclass

from luminal_recipes import ops
from luminal_recipes.graph import Graph, Tensor


@dataclass(frozen=True)
class Flux2Config:
    in_channels: int = 128
    double_layers: int = 8
    single_layers: int = 48
    heads: int = 48
    head_dim: int = 128
    joint_dim: int = 15360
    time_channels: int = 256
    mlp_ratio: float = 3.0
    eps: float = 1e-6
    img_tokens: int = 4096
    txt_tokens: int = 512

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.inner * self.mlp_ratio)


SMALL = Flux2Config(in_channels=16, double_layers=2, single_layers=4, heads=4, head_dim=64, joint_dim=384,
                    img_tokens=256, txt_tokens=64)


class Builder:
    """Declares weights (bf16, as stored) and composes the ops; activations are ``dtype``."""

    def __init__(self, g: Graph, dtype: str):
        self.g, self.dtype = g, dtype

    def w(self, name: str, shape) -> Tensor:
        return self.g.weight(name, shape, "bf16")

    def linear(self, x: Tensor, name: str, out: int, inp: int) -> Tensor:
        return ops.linear(x, self.w(f"{name}.weight", (out, inp)))

    def rms(self, x: Tensor, name: str, cfg: Flux2Config) -> Tensor:
        return ops.rms_norm(x, self.w(name, (cfg.head_dim,)), cfg.eps)


def double_block(b: Builder, p: str, cfg: Flux2Config, x, c, mod_img, mod_txt, cos, sin):
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ops.chunk(mod_img, 6, 2)
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = ops.chunk(mod_txt, 6, 2)
    nx = ops.modulate(ops.layer_norm(x, None, None, cfg.eps), scale_msa, shift_msa)
    nc = ops.modulate(ops.layer_norm(c, None, None, cfg.eps), c_scale_msa, c_shift_msa)
    d, h = cfg.inner, cfg.heads
    a = f"{p}.attn"
    q_x = b.rms(ops.split_heads(b.linear(nx, f"{a}.to_q", d, d), h), f"{a}.norm_q.weight", cfg)
    k_x = b.rms(ops.split_heads(b.linear(nx, f"{a}.to_k", d, d), h), f"{a}.norm_k.weight", cfg)
    q_c = b.rms(ops.split_heads(b.linear(nc, f"{a}.add_q_proj", d, d), h), f"{a}.norm_added_q.weight", cfg)
    k_c = b.rms(ops.split_heads(b.linear(nc, f"{a}.add_k_proj", d, d), h), f"{a}.norm_added_k.weight", cfg)
    v_x = ops.split_heads(b.linear(nx, f"{a}.to_v", d, d), h)
    v_c = ops.split_heads(b.linear(nc, f"{a}.add_v_proj", d, d), h)
    q = ops.apply_rope(ops.concat([q_c, q_x], 2), cos, sin, "pairs")
    k = ops.apply_rope(ops.concat([k_c, k_x], 2), cos, sin, "pairs")
    o = ops.merge_heads(ops.scaled_dot_product_attention(q, k, ops.concat([v_c, v_x], 2)))
    t = c.shape[1]
    attn_c = b.linear(o.slice(1, 0, t), f"{a}.to_add_out", d, d)
    attn_x = b.linear(o.slice(1, t, o.shape[1]), f"{a}.to_out.0", d, d)
    x = x + gate_msa.broadcast_to(x.shape) * attn_x
    nx = ops.modulate(ops.layer_norm(x, None, None, cfg.eps), scale_mlp, shift_mlp)
    ff_x = feed_forward(b, f"{p}.ff", cfg, nx)
    x = x + gate_mlp.broadcast_to(x.shape) * ff_x
    c = c + c_gate_msa.broadcast_to(c.shape) * attn_c
    ff_c = feed_forward(b, f"{p}.ff_context", cfg,
                        ops.modulate(ops.layer_norm(c, None, None, cfg.eps), c_scale_mlp, c_shift_mlp))
    c = c + c_gate_mlp.broadcast_to(c.shape) * ff_c
    return c, x


def feed_forward(b: Builder, p: str, cfg: Flux2Config, x):
    hidden = ops.swiglu(b.linear(x, f"{p}.linear_in", 2 * cfg.mlp_hidden, cfg.inner))
    return b.linear(hidden, f"{p}.linear_out", cfg.inner, cfg.mlp_hidden)


def single_block(b: Builder, p: str, cfg: Flux2Config, hs, mod, cos, sin):
    shift, scale, gate = ops.chunk(mod, 3, 2)
    x = ops.modulate(ops.layer_norm(hs, None, None, cfg.eps), scale, shift)
    d, m, h = cfg.inner, cfg.mlp_hidden, cfg.heads
    a = f"{p}.attn"
    q, k, v, mlp = ops.split(b.linear(x, f"{a}.to_qkv_mlp_proj", 3 * d + 2 * m, d), [d, d, d, 2 * m], 2)
    q = ops.apply_rope(b.rms(ops.split_heads(q, h), f"{a}.norm_q.weight", cfg), cos, sin, "pairs")
    k = ops.apply_rope(b.rms(ops.split_heads(k, h), f"{a}.norm_k.weight", cfg), cos, sin, "pairs")
    o = ops.merge_heads(ops.scaled_dot_product_attention(q, k, ops.split_heads(v, h)))
    out = b.linear(ops.concat([o, ops.swiglu(mlp)], 2), f"{a}.to_out", d, d + m)
    return hs + gate.broadcast_to(hs.shape) * out


def timestep_mlp(b: Builder, p: str, cfg: Flux2Config, t):
    emb = ops.timestep_embedding(t, cfg.time_channels, True, 0.0)
    return b.linear(ops.silu(b.linear(emb, f"{p}.linear_1", cfg.inner, cfg.time_channels)), f"{p}.linear_2",
                    cfg.inner, cfg.inner)


def modulation(b: Builder, p: str, cfg: Flux2Config, temb, sets: int):
    return b.linear(ops.silu(temb), f"{p}.linear", 3 * sets * cfg.inner, cfg.inner).unsqueeze(1)


def build_flux2_transformer(cfg: Flux2Config, dtype: str = "bf16") -> Graph:
    g = Graph()
    b = Builder(g, dtype)
    batch, img, txt = 1, cfg.img_tokens, cfg.txt_tokens
    hs = g.input("hidden_states", (batch, img, cfg.in_channels), dtype)
    ehs = g.input("encoder_hidden_states", (batch, txt, cfg.joint_dim), dtype)
    timestep = g.input("timestep", (batch,), dtype)
    guidance = g.input("guidance", (batch,), dtype)
    cos = g.input("rope_cos", (txt + img, cfg.head_dim), dtype)
    sin = g.input("rope_sin", (txt + img, cfg.head_dim), dtype)

    temb = timestep_mlp(b, "time_guidance_embed.timestep_embedder", cfg, timestep * 1000.0)
    temb = temb + timestep_mlp(b, "time_guidance_embed.guidance_embedder", cfg, guidance * 1000.0)
    mod_img = modulation(b, "double_stream_modulation_img", cfg, temb, 2)
    mod_txt = modulation(b, "double_stream_modulation_txt", cfg, temb, 2)
    mod_single = modulation(b, "single_stream_modulation", cfg, temb, 1)
    x = b.linear(hs, "x_embedder", cfg.inner, cfg.in_channels)
    c = b.linear(ehs, "context_embedder", cfg.inner, cfg.joint_dim)
    for i in range(cfg.double_layers):
        with g.block(f"transformer_blocks.{i}"):
            c, x = double_block(b, f"transformer_blocks.{i}", cfg, x, c, mod_img, mod_txt, cos, sin)
    h = ops.concat([c, x], 1)
    for i in range(cfg.single_layers):
        with g.block(f"single_transformer_blocks.{i}"):
            h = single_block(b, f"single_transformer_blocks.{i}", cfg, h, mod_single, cos, sin)
    x = h.slice(1, txt, txt + img)
    norm_out = b.linear(ops.silu(temb), "norm_out.linear", 2 * cfg.inner, cfg.inner)
    scale, shift = ops.chunk(norm_out.unsqueeze(1), 2, 2)
    x = ops.modulate(ops.layer_norm(x, None, None, cfg.eps), scale, shift)
    g.mark_output("velocity", b.linear(x, "proj_out", cfg.in_channels, cfg.inner))
    return g


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="hidden 256, 2 + 4 blocks (smoke run)")
    parser.add_argument("--budget-gb", type=float, default=80.0, help="memory budget in GB (default 80)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.runtimes.cpu.backend import NumpyRuntime

    cfg = SMALL if args.small else Flux2Config()
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", tempfile.mkdtemp(prefix="luminal-bench-cache-"))
    t0 = time.perf_counter()
    graph = build_flux2_transformer(cfg)
    t_build = time.perf_counter() - t0
    plan = compile_graph(graph, NumpyRuntime(), {}, budget_bytes=int(args.budget_gb * 1e9),
                         options=SearchOptions(use_cache=False))
    wall = time.perf_counter() - t0
    chosen = plan.report["chosen"]
    figures = {
        "graph_nodes": len(graph.nodes),
        "blocks": len(graph.blocks),
        "distinct_segments": plan.report["distinct_segments"],
        "segments": plan.report["segments"],
        "stop_reasons": plan.report["stop_reasons"],
        "program_kernels": len(plan.program.nodes),
        "kernel_counts": chosen["kernels"],
        "planned_peak_gb": chosen["peak"] / 1e9,
        "weights_gb": chosen["weight_bytes"] / 1e9,
        "activation_peak_gb": chosen["activation_peak"] / 1e9,
        "build_s": round(t_build, 2),
        "wall_s": round(wall, 2),
        "peak_rss_gb": round(peak_rss_bytes() / 1e9, 3),
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    for k, v in figures.items():
        print(f"{k:>20}: {v}")
    if not args.small:
        ok = figures["wall_s"] < 120 and figures["peak_rss_gb"] < 4
        print(f"targets (< 120 s, < 4 GB): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
