"""Build a tiny, randomly initialised FLUX.2 checkpoint in the exact diffusers layout.

The folder it writes (``model_index.json``, ``scheduler/``, ``text_encoder/``, ``tokenizer/``,
``transformer/``, ``vae/``) loads unchanged with ``diffusers.Flux2Pipeline.from_pretrained`` and runs offline.
Every weight comes from a seeded random initialisation done by diffusers/transformers themselves, then
``save_pretrained``; the tokenizer is the real Mistral Tekken tokenizer shipped with mistral-common. The
weights are random: images are noise-like patterns, useful only to prove that our pipeline computes what
diffusers computes.

    python recipes/flux2-tiny/make_checkpoint.py                        # variant A -> ./checkpoint
    python recipes/flux2-tiny/make_checkpoint.py --variant b --out DIR  # a second, differently shaped one

Variant A keeps ``text_encoder_out_layers`` at the pipeline default (10, 20, 30): its text encoder has 31
layers, so, as in FLUX.2-dev, no tap is the last layer (whose hidden state transformers returns *after* the
final norm). Variant B needs ``text_encoder_out_layers=VARIANTS["b"].text_encoder_out_layers`` (2, 5, 8).

Needs torch, diffusers, transformers and mistral-common (the test extra). Reruns give the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = SCRIPT_DIR / "checkpoint"

# FLUX.2-dev's scheduler/scheduler_config.json (diffusers FlowMatchEulerDiscreteScheduler).
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


@dataclasses.dataclass(frozen=True)
class Variant:
    seed: int
    # Mistral-3 text branch. The vocabulary is Tekken's 131072 tokens, so the embedding dominates the size.
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    text_encoder_out_layers: tuple[int, int, int]
    # Flux2Transformer2DModel.
    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int, int]
    mlp_ratio: float
    # AutoencoderKLFlux2. Four blocks = 8x downsampling, so latents are (1, 128, H/16, W/16) as in FLUX.2-dev.
    vae_block_out_channels: tuple[int, int, int, int]
    vae_decoder_block_out_channels: tuple[int, int, int, int] | None
    vae_layers_per_block: int
    vae_norm_num_groups: int
    # Settings the two shipped variants leave at FLUX.2-dev's values; the parity tests vary them.
    text_rope_theta: float = 1.0e9
    text_sliding_window: int | None = None
    text_tie_last_hidden_states: bool | None = None  # None: not written (transformers' default, tied)
    rope_theta: int = 2000
    timestep_guidance_channels: int = 256
    guidance_embeds: bool = True
    vae_use_quant_conv: bool = True
    vae_use_post_quant_conv: bool = True
    vae_mid_block_add_attention: bool = True
    # "mistral-small": FLUX.2-dev's Mistral-Small-3.2 template; "tekken-default": the template
    # transformers' convert_tekken_tokenizer gives tekken_240911.json by itself; anything else: a Jinja template.
    chat_template: str = "mistral-small"


VARIANTS = {
    "a": Variant(
        seed=20250101,
        text_hidden=16,
        text_layers=31,
        text_heads=2,
        text_kv_heads=1,
        text_head_dim=8,
        text_intermediate=48,
        text_encoder_out_layers=(10, 20, 30),
        num_layers=1,
        num_single_layers=2,
        num_attention_heads=4,
        attention_head_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
        mlp_ratio=3.0,
        vae_block_out_channels=(16, 16, 32, 32),
        vae_decoder_block_out_channels=None,
        vae_layers_per_block=1,
        vae_norm_num_groups=8,
    ),
    "b": Variant(
        seed=7,
        text_hidden=32,
        text_layers=10,
        text_heads=4,
        text_kv_heads=2,
        text_head_dim=8,
        text_intermediate=64,
        text_encoder_out_layers=(2, 5, 8),
        num_layers=2,
        num_single_layers=3,
        num_attention_heads=2,
        attention_head_dim=32,
        axes_dims_rope=(8, 8, 8, 8),
        mlp_ratio=2.0,
        vae_block_out_channels=(8, 16, 16, 16),
        vae_decoder_block_out_channels=(16, 16, 32, 32),
        vae_layers_per_block=2,
        vae_norm_num_groups=4,
    ),
}


def tekken_file() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"


def mistral_small_chat_template() -> str:
    """The Mistral-Small-3.2 (tokenizer v11) chat template, as mistral-common generates it.

    tekken_240911.json itself is a v3 tokenizer whose template folds the system prompt into ``[INST]``;
    FLUX.2-dev's text encoder (Mistral-Small-3.2) uses ``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]``, which is what
    diffusers relies on.
    """
    from mistral_common.integrations.chat_templates.chat_templates import generate_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    return generate_chat_template(
        spm=False,
        tokenizer_version=TokenizerVersion.v11,
        image_support=True,
        audio_support=False,
        thinking_support=False,
        default_system_prompt=None,
        plain_thinking_support=False,
        use_special_token_variables=True,
        model_settings_fields=None,
        reasoning_effort_values=None,
        reasoning_effort_default=None,
    )


def save_tokenizer(folder: Path, chat_template: str = "mistral-small", tokenizer_from: Path | None = None) -> None:
    """The Tekken tokenizer with the chosen chat template, saved by transformers.

    ``tokenizer_from`` (a checkpoint this script wrote) is loaded instead of converting Tekken again, and given the
    template; "tekken-default" always converts, since the template is convert_tekken_tokenizer's own choice.
    """
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.mistral import convert_tekken_tokenizer

    if chat_template == "tekken-default":
        tokenizer = convert_tekken_tokenizer(str(tekken_file()))
    else:
        template = mistral_small_chat_template() if chat_template == "mistral-small" else chat_template
        if tokenizer_from is not None:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(Path(tokenizer_from) / "tokenizer")
            tokenizer.chat_template = template
        else:
            tokenizer = convert_tekken_tokenizer(str(tekken_file()), chat_template=template)
    tokenizer.save_pretrained(folder)
    # Same tokenizer, written without indentation: 7 MB instead of 17 MB.
    path = folder / "tokenizer.json"
    tokenizers.Tokenizer.from_file(str(path)).save(str(path), pretty=False)


def perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Move every norm's scale off 1 and shift off 0 (seeded).

    Fresh RMSNorm/GroupNorm layers are the identity map, which would let a parity test pass with a recipe that
    forgets a norm's weight or adds 1 to it.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name and param.ndim == 1:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)


def save_text_encoder(folder: Path, v: Variant) -> None:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text_config = {
        "model_type": "mistral",
        "vocab_size": 131072,
        "hidden_size": v.text_hidden,
        "intermediate_size": v.text_intermediate,
        "num_hidden_layers": v.text_layers,
        "num_attention_heads": v.text_heads,
        "num_key_value_heads": v.text_kv_heads,
        "head_dim": v.text_head_dim,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": v.text_rope_theta,
        "sliding_window": v.text_sliding_window,
        "tie_word_embeddings": True,
    }
    if v.text_tie_last_hidden_states is not None:
        text_config["tie_last_hidden_states"] = v.text_tie_last_hidden_states
    vision_config = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "image_size": 56,
        "patch_size": 14,
    }
    config = Mistral3Config(text_config=text_config, vision_config=vision_config, tie_word_embeddings=True)
    torch.manual_seed(v.seed)
    model = Mistral3ForConditionalGeneration(config).to(torch.float32).eval()
    perturb_norms(model, v.seed)
    model.save_pretrained(folder)


def save_transformer(folder: Path, v: Variant) -> None:
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(v.seed + 1)
    model = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=v.num_layers,
        num_single_layers=v.num_single_layers,
        attention_head_dim=v.attention_head_dim,
        num_attention_heads=v.num_attention_heads,
        joint_attention_dim=len(v.text_encoder_out_layers) * v.text_hidden,
        timestep_guidance_channels=v.timestep_guidance_channels,
        mlp_ratio=v.mlp_ratio,
        axes_dims_rope=v.axes_dims_rope,
        rope_theta=v.rope_theta,
        eps=1e-6,
        guidance_embeds=v.guidance_embeds,
    )
    perturb_norms(model, v.seed + 1)
    model.save_pretrained(folder)


def save_vae(folder: Path, v: Variant) -> None:
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(v.seed + 2)
    model = AutoencoderKLFlux2(
        block_out_channels=v.vae_block_out_channels,
        decoder_block_out_channels=v.vae_decoder_block_out_channels,
        layers_per_block=v.vae_layers_per_block,
        latent_channels=32,
        norm_num_groups=v.vae_norm_num_groups,
        sample_size=128,
        use_quant_conv=v.vae_use_quant_conv,
        use_post_quant_conv=v.vae_use_post_quant_conv,
        mid_block_add_attention=v.vae_mid_block_add_attention,
    )
    perturb_norms(model, v.seed + 2)
    # A fresh BatchNorm has mean 0 / var 1, which would hide mistakes in the pipeline's de-normalisation.
    with torch.no_grad():
        model.bn.running_mean.copy_(0.5 * torch.randn_like(model.bn.running_mean))
        model.bn.running_var.copy_(0.25 + 2.0 * torch.rand_like(model.bn.running_var))
    model.save_pretrained(folder)


def save_scheduler(folder: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG).save_pretrained(folder)


def save_model_index(folder: Path) -> None:
    import diffusers

    index = {
        "_class_name": "Flux2Pipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
        # FLUX.2-dev names PixtralProcessor here, which transformers 5 only builds with torchvision installed.
        # The pipeline uses nothing but apply_chat_template from it, which the tokenizer alone provides.
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def build(out: Path, variant: str | Variant, tokenizer_from: Path | None = None) -> Path:
    """Write the checkpoint for ``variant`` (a name of VARIANTS, or a Variant) to ``out`` (replacing it) and
    return ``out``.

    ``tokenizer_from`` reuses the ``tokenizer/`` folder of a checkpoint this script already wrote instead of
    converting Tekken again (the conversion is deterministic and takes most of the run time).
    """
    v = VARIANTS[variant] if isinstance(variant, str) else variant
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_scheduler(staging / "scheduler")
        if tokenizer_from is not None and v.chat_template == "mistral-small":
            shutil.copytree(Path(tokenizer_from) / "tokenizer", staging / "tokenizer")
        else:
            save_tokenizer(staging / "tokenizer", v.chat_template, tokenizer_from)
        save_text_encoder(staging / "text_encoder", v)
        save_transformer(staging / "transformer", v)
        save_vae(staging / "vae", v)
        save_model_index(staging)
        # mkdtemp and safetensors create owner-only entries; a checkpoint is meant to be shared.
        staging.chmod(0o755)
        for path in staging.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--variant", choices=sorted(VARIANTS), default="a", help="tiny configuration (default: a)"
    )
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="copy tokenizer/ from a checkpoint this script wrote instead of converting Tekken (faster)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build(args.out, args.variant, args.tokenizer_from)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        f"wrote {out} (variant {args.variant}, {total / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s"
    )
    print(f"text_encoder_out_layers={VARIANTS[args.variant].text_encoder_out_layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
