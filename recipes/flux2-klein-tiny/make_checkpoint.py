"""Build a tiny, randomly initialised FLUX.2 [klein] checkpoint in the exact diffusers layout.

The folder it writes (``model_index.json``, ``scheduler/``, ``text_encoder/``, ``tokenizer/``, ``transformer/``,
``vae/``) loads unchanged with ``diffusers.Flux2KleinPipeline.from_pretrained`` and runs offline. Every weight
comes from a seeded random initialisation done by diffusers/transformers themselves, then ``save_pretrained``:
the text encoder is a ``Qwen3ForCausalLM``, the transformer a ``Flux2Transformer2DModel`` without guidance
embedding, the VAE and scheduler are FLUX.2-dev's classes (recipes/flux2-tiny/make_checkpoint.py builds them).

The tokenizer is a ``Qwen2TokenizerFast`` saved by transformers: a byte-level BPE trained here by the ``tokenizers``
package with Qwen2's normaliser and pre-tokenizer, Qwen3's special tokens (``<|endoftext|>`` pads, ``<|im_start|>``
and ``<|im_end|>`` mark turns, ``<think>`` and ``</think>`` are added tokens) and a ChatML chat template with
Qwen3's thinking switch (``enable_thinking=False`` closes an empty think block after the generation prompt),
written here: the real Qwen3 vocabulary (151k tokens) would dominate the checkpoint. The weights are random:
images are noise-like patterns, useful only to prove that our pipeline computes what diffusers computes.

    python recipes/flux2-klein-tiny/make_checkpoint.py                           # distilled -> ./checkpoint
    python recipes/flux2-klein-tiny/make_checkpoint.py --variant base --out DIR  # a Base (CFG) one

``distilled`` (``is_distilled: true`` in model_index.json, as FLUX.2-klein-4B/9B) keeps the pipeline's default
text_encoder_out_layers (9, 18, 27): its text encoder has 28 layers, so no tap is the last. ``base``
(``is_distilled: false``, as FLUX.2-klein-base-4B/9B: diffusers runs classifier-free guidance) needs
``text_encoder_out_layers=VARIANTS["base"].text_encoder_out_layers`` (1, 3, 6): 6 layers, the last tap after the
final norm; its text encoder slides a 16-token window from layer 3 on and unties its embeddings.

Needs torch, diffusers, transformers and tokenizers (the test extra). Reruns give the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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
FLUX2_TINY = SCRIPT_DIR.parent / "flux2-tiny" / "make_checkpoint.py"

# Qwen3's turn markers and padding/end token; <think> and </think> are plain added tokens there (not special).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>"]

# ChatML turns with Qwen3's switch: after the generation prompt, enable_thinking=false writes an empty think block.
CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('this template renders system, user and assistant turns, not ' + message.role) }}
    {%- endif %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CORPUS = [
    "A red fox in the snow, a lighthouse on a cliff at dusk, an oil painting of a harbour at night.",
    "The quick brown fox jumps over the lazy dog. A cat holding a sign that says hello world.",
    "Une phrase en français: é è à ç ô. Emoji ✨ 🦊 and 日本語のテキスト, numbers 0123456789.",
    "user assistant system think <tag> </tag> ,.;:!?()[]{}'\"\n\n",
] * 8


@dataclasses.dataclass(frozen=True)
class Variant:
    seed: int
    is_distilled: bool
    # Qwen3ForCausalLM
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    text_encoder_out_layers: tuple[int, int, int]
    text_rope_theta: float = 1.0e6
    text_tie_embeddings: bool = True
    text_sliding_window: int | None = None  # written with use_sliding_window true when set
    text_max_window_layers: int = 28
    # Flux2Transformer2DModel and AutoencoderKLFlux2 (recipes/flux2-tiny/make_checkpoint.py's Variant fields)
    transformer: dict = dataclasses.field(default_factory=dict)
    vocab: int = 320


SMALL_TRANSFORMER = dict(
    num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 4, 4, 4),
    mlp_ratio=3.0, vae_block_out_channels=(8, 8, 16, 16), vae_decoder_block_out_channels=None,
    vae_layers_per_block=1, vae_norm_num_groups=4, guidance_embeds=False,
)

VARIANTS = {
    "distilled": Variant(
        seed=20260115, is_distilled=True, text_hidden=16, text_layers=28, text_heads=2, text_kv_heads=1,
        text_head_dim=8, text_intermediate=32, text_encoder_out_layers=(9, 18, 27), transformer=SMALL_TRANSFORMER,
    ),
    "base": Variant(
        seed=20260116, is_distilled=False, text_hidden=16, text_layers=6, text_heads=4, text_kv_heads=2,
        text_head_dim=8, text_intermediate=48, text_encoder_out_layers=(1, 3, 6), text_rope_theta=1.0e4,
        text_tie_embeddings=False, text_sliding_window=16, text_max_window_layers=3,
        transformer=dict(SMALL_TRANSFORMER, num_layers=2, rope_theta=1000, mlp_ratio=2.0),
    ),
}


def flux2_tiny():
    """recipes/flux2-tiny/make_checkpoint.py as a module (its VAE, scheduler and transformer makers)."""
    name = "flux2_tiny_make_checkpoint"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FLUX2_TINY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def save_tokenizer(folder: Path, vocab: int):
    """A byte-level BPE trained on CORPUS with Qwen2's pipeline, saved by transformers as Qwen2TokenizerFast."""
    import tokenizers
    from tokenizers import Regex, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2TokenizerFast(vocab=model["vocab"], merges=merges, unk_token=None,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_text_encoder(folder: Path, v: Variant, tokenizer) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=v.text_hidden, intermediate_size=v.text_intermediate,
        num_hidden_layers=v.text_layers, num_attention_heads=v.text_heads, num_key_value_heads=v.text_kv_heads,
        head_dim=v.text_head_dim, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": v.text_rope_theta},
        tie_word_embeddings=v.text_tie_embeddings, use_sliding_window=v.text_sliding_window is not None,
        sliding_window=v.text_sliding_window, max_window_layers=v.text_max_window_layers,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(v.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    flux2_tiny().perturb_norms(model, v.seed)
    model.save_pretrained(folder)


def flux2_variant(v: Variant):
    """The flux2-tiny Variant whose transformer and VAE this Klein variant uses (joint dim = 3 x text hidden)."""
    tiny = flux2_tiny()
    return tiny.Variant(seed=v.seed, text_hidden=v.text_hidden, text_layers=v.text_layers, text_heads=v.text_heads,
                        text_kv_heads=v.text_kv_heads, text_head_dim=v.text_head_dim,
                        text_intermediate=v.text_intermediate, text_encoder_out_layers=v.text_encoder_out_layers,
                        **v.transformer)


def save_model_index(folder: Path, v: Variant) -> None:
    import diffusers

    index = {
        "_class_name": "Flux2KleinPipeline",
        "_diffusers_version": diffusers.__version__,
        "is_distilled": v.is_distilled,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def build(out: Path, variant: str | Variant) -> Path:
    """Write the checkpoint for ``variant`` (a name of VARIANTS, or a Variant) to ``out`` (replacing it) and
    return ``out``."""
    v = VARIANTS[variant] if isinstance(variant, str) else variant
    tiny = flux2_tiny()
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tiny.save_scheduler(staging / "scheduler")
        tokenizer = save_tokenizer(staging / "tokenizer", v.vocab)
        save_text_encoder(staging / "text_encoder", v, tokenizer)
        flux = flux2_variant(v)
        tiny.save_transformer(staging / "transformer", flux)
        tiny.save_vae(staging / "vae", flux)
        save_model_index(staging, v)
        staging.chmod(0o755)  # mkdtemp and safetensors create owner-only entries; a checkpoint is meant to be shared
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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="distilled",
                        help="tiny configuration (default: distilled)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build(args.out, args.variant)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} (variant {args.variant}, {total / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s")
    print(f"text_encoder_out_layers={VARIANTS[args.variant].text_encoder_out_layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
