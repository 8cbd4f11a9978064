"""LoRA files of the tiny FLUX.2 transformer in each key format, for the LoRA tests (test_lora_keys.py: the key
mappings; test_flux2_lora_parity.py: against diffusers' load_lora_weights).

One random LoRA is made with PEFT (`add_adapter`, then its weights drawn from a seeded generator; Q/K/V share their
down matrices so the fused BFL formats can hold it) and written as the tools write it: diffusers
(`Flux2Pipeline.save_lora_weights`, alpha/rank in the `lora_adapter_metadata` header), PEFT (`base_model.model.`
keys), fal/ai-toolkit (Black Forest Labs' names under `diffusion_model.`, fused QKV, in `lora_A/lora_B` and in
`lora_down/lora_up` spelling) and ComfyUI/kohya (`lora_unet_` + BFL names with `_` for `.`, `.alpha`), each the
inverse of diffusers' own converter (`_convert_non_diffusers_flux2_lora_to_diffusers`,
`_convert_kohya_flux2_lora_to_diffusers`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import Flux2Pipeline
from diffusers.models import Flux2Transformer2DModel
from flux2_bfl import bfl_name
from safetensors.torch import save_file as save_torch

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
RANK, ALPHA = 4, 8.0  # the diffusers file says so in its metadata (scale 2); kohya in its .alpha keys

# every linear layer of the transformer (diffusers' names), as a PEFT target regex
TARGETS = (r".*(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|to_qkv_mlp_proj)"
           r"|single_transformer_blocks\.\d+\.attn\.to_out|linear_in|linear_out|x_embedder|context_embedder"
           r"|proj_out|norm_out\.linear|modulation_img\.linear|modulation_txt\.linear|single_stream_modulation\.linear"
           r"|embedder\.linear_1|embedder\.linear_2)")


# ---- the LoRA, in diffusers' names, and its spellings ------------------------------------------------------------
def make_lora(**options) -> tuple[dict[str, torch.Tensor], dict, dict[str, float]]:
    """``(state, LoraConfig dict, scales)``: PEFT's own adapter on the tiny transformer (rank 4, alpha 8, every
    linear layer; ``options`` are more LoraConfig settings), weights seeded; ``scales``: module -> the scaling
    PEFT's LoRA layer applies (alpha / r, or alpha / sqrt(r) with rsLoRA, after the rank/alpha patterns)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = Flux2Transformer2DModel.from_pretrained(CHECKPOINT / "transformer")
    config = LoraConfig(**{"r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS, "init_lora_weights": False,
                           **options})
    transformer.add_adapter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(transformer.named_parameters()):
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
    for key in list(state):  # Q/K/V share one down matrix, as a fused QKV LoRA does
        for fused in ("to_k", "to_v"), ("add_k_proj", "add_v_proj"):
            for part in fused:
                if f".{part}.lora_A." in key:
                    first = "to_q" if part.startswith("to_") else "add_q_proj"
                    state[key] = state[key.replace(f".{part}.", f".{first}.")].clone()
    scales = {name: float(module.scaling["default"]) for name, module in transformer.named_modules()
              if hasattr(module, "scaling") and "default" in module.scaling}
    return state, config.to_dict(), scales


def to_bfl(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """BFL module name -> (down, up): fused QKV (shared down, ups stacked q;k;v), the rest renamed."""
    modules = {key.split(".lora_")[0] for key in state}
    out = {}
    for module in sorted(modules):
        down, up = state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        m = re.match(r"^transformer_blocks\.(\d+)\.attn\.(to_q|add_q_proj)$", module)
        if m:
            stream = "img" if m[2] == "to_q" else "txt"
            names = ["to_q", "to_k", "to_v"] if stream == "img" else ["add_q_proj", "add_k_proj", "add_v_proj"]
            ups = [state[f"transformer_blocks.{m[1]}.attn.{n}.lora_B.weight"] for n in names]
            out[f"double_blocks.{m[1]}.{stream}_attn.qkv"] = (down, torch.cat(ups))
            continue
        if re.match(r"^transformer_blocks\.\d+\.attn\.(to_k|to_v|add_k_proj|add_v_proj)$", module):
            continue
        out[bfl_name(f"{module}.")[:-1]] = (down, up)  # the checkpoint's renaming, on the module's prefix
    return out


def write_formats(state: dict[str, torch.Tensor], config: dict, folder: Path) -> dict[str, Path]:
    paths = {}
    folder.mkdir(parents=True, exist_ok=True)
    Flux2Pipeline.save_lora_weights(folder / "diffusers", transformer_lora_layers=state,
                                    transformer_lora_adapter_metadata=config)
    paths["diffusers"] = folder / "diffusers" / "pytorch_lora_weights.safetensors"
    # PEFT's save_pretrained spelling; no alpha in the file (PEFT keeps it in adapter_config.json, which diffusers
    # does not read): scale 1 for both. diffusers reads such keys as ai-toolkit ones, accepting diffusers' names
    # only for the blocks: the file holds the blocks' layers
    paths["peft"] = folder / "peft.safetensors"
    save_torch({f"base_model.model.{k}": v for k, v in state.items() if "transformer_blocks." in k}, paths["peft"])
    bfl = to_bfl(state)
    paths["fal"] = folder / "fal.safetensors"
    save_torch({f"diffusion_model.{name}.lora_{ab}.weight": t for name, (down, up) in bfl.items()
                for ab, t in (("A", down), ("B", up))}, paths["fal"])
    paths["fal-down-up"] = folder / "fal-down-up.safetensors"
    save_torch({f"diffusion_model.{name}.lora_{kind}.weight": t for name, (down, up) in bfl.items()
                for kind, t in (("down", down), ("up", up))}, paths["fal-down-up"])
    kohya = {}
    for name, (down, up) in bfl.items():
        if not KOHYA_NAMES.fullmatch(name):
            continue
        key = "lora_unet_" + name.replace(".", "_")
        kohya[f"{key}.lora_down.weight"], kohya[f"{key}.lora_up.weight"] = down, up
        kohya[f"{key}.alpha"] = torch.tensor(ALPHA)
    paths["kohya"] = folder / "kohya.safetensors"
    save_torch(kohya, paths["kohya"])
    return paths


# what diffusers' kohya converter maps (BFL names); it drops others (guidance_in, modulations, adaLN) with a warning
KOHYA_NAMES = re.compile(r"double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12]"
                         r"|img_in|txt_in|time_in\.(in|out)_layer|final_layer\.linear")
