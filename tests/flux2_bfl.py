"""diffusers FLUX.2 transformer state dicts in Black Forest Labs' names (the layout of BFL's own and city96's GGUF
files), for the tests and fixture scripts that write checkpoints in that layout."""

from __future__ import annotations

import re

import numpy as np

# diffusers name -> BFL name, the inverse of diffusers' convert_flux2_transformer_checkpoint_to_diffusers
TO_BFL = [
    (r"^x_embedder\.", "img_in."),
    (r"^context_embedder\.", "txt_in."),
    (r"^time_guidance_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"^time_guidance_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"^time_guidance_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"^time_guidance_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (
        r"^(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear\.",
        r"\1.lin.",
    ),
    (r"^proj_out\.", "final_layer.linear."),
    (r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
    (
        r"^transformer_blocks\.(\d+)\.attn\.norm_q\.weight$",
        r"double_blocks.\1.img_attn.norm.query_norm.scale",
    ),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_k\.weight$", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (
        r"^transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight$",
        r"double_blocks.\1.txt_attn.norm.query_norm.scale",
    ),
    (
        r"^transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight$",
        r"double_blocks.\1.txt_attn.norm.key_norm.scale",
    ),
    (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.ff\.linear_in\.", r"double_blocks.\1.img_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff\.linear_out\.", r"double_blocks.\1.img_mlp.2."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.linear_in\.", r"double_blocks.\1.txt_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.linear_out\.", r"double_blocks.\1.txt_mlp.2."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj\.", r"single_blocks.\1.linear1."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_out\.", r"single_blocks.\1.linear2."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_q\.weight$", r"single_blocks.\1.norm.query_norm.scale"),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_k\.weight$", r"single_blocks.\1.norm.key_norm.scale"),
]
QKV = {"img_attn": ("to_q", "to_k", "to_v"), "txt_attn": ("add_q_proj", "add_k_proj", "add_v_proj")}


def to_bfl(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A diffusers FLUX.2 transformer state dict in BFL's names: QKV packed, final norm as (shift, scale)."""
    state = dict(state)
    out: dict[str, np.ndarray] = {}
    blocks = sorted({int(m.group(1)) for k in state if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})
    for i in blocks:
        for stream, parts in QKV.items():
            names = [f"transformer_blocks.{i}.attn.{p}.weight" for p in parts]
            out[f"double_blocks.{i}.{stream}.qkv.weight"] = np.concatenate([state.pop(n) for n in names])
    scale, shift = np.split(state.pop("norm_out.linear.weight"), 2)
    out["final_layer.adaLN_modulation.1.weight"] = np.concatenate([shift, scale])
    for name, value in state.items():
        out[bfl_name(name)] = value
    return out


def bfl_name(name: str) -> str:
    """A diffusers parameter name (or, ending in ``.``, a module prefix) in BFL's names; QKV parts not handled."""
    bfl = name
    for pattern, repl in TO_BFL:
        bfl = re.sub(pattern, repl, bfl)
    assert bfl != name, f"no BFL name for {name}"
    return bfl
