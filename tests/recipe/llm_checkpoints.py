"""Tiny random checkpoints of the language-model architectures, saved by transformers itself (config.json and
model.safetensors in the real Hugging Face layout), for the recipes' parity tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
VOCAB = 256
PROMPT = "The quick brown fox jumps over the lazy dog. Ça marche très bien! 🦊"


# Small but not degenerate: grouped-query heads, more than one layer, every width distinct where the architecture
# allows, so a transposed or swapped weight fails the shape check or the parity.
BASE = {
    "Qwen3ForCausalLM": ("Qwen3Config", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, initializer_range=0.1)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, initializer_range=0.1, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1])),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, initializer_range=0.1, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "Gemma4ForCausalLM": ("Gemma4TextConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, vocab_size=VOCAB, initializer_range=0.1,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 10000.0}})),
    "GPT2LMHeadModel": ("GPT2Config", dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB, initializer_range=0.1,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)),
}


def tiny_config(model_class: str, **overrides):
    config_class, base = BASE[model_class]
    return getattr(transformers, config_class)(**{**base, **overrides})


def save_tiny(folder: Path, model_class: str, seed: int = 0, tokenizer: bool = False, **overrides):
    """(model, vocab): a seeded random ``model_class`` saved to ``folder``, in eval mode. ``tokenizer``: save a
    real tokenizer with it (a byte-level BPE trained by the ``tokenizers`` package, Llama 3's special tokens and
    chat template; tests/tasks/generation/generation_checkpoints.py) and size the vocabulary and BOS/EOS to it."""
    if tokenizer:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks" / "generation"))
        from generation_checkpoints import llama_tokenizer

        tok = llama_tokenizer(folder)
        overrides = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                     **overrides}
    torch.manual_seed(seed)
    config = tiny_config(model_class, **overrides)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # norms, scales and per-layer scalars start constant (ones, zeros): make them matter
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and tensor.numel() and bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(torch.randn_like(tensor) * 0.2)
    model.save_pretrained(folder)
    return model, config.vocab_size


# ---- running a language-model recipe the way generation does (LLM_CONTRACT: dims batch/seq/ctx/cache/keep) ------
def load_program(model, dims: dict, states_from=None):
    """The model compiled (egglog search ranked by the cost model: timing candidates would only change speed, and
    the plan cache) and loaded on the numpy runtime at ``dims``."""
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.runtimes.registry import get_runtime

    runtime = get_runtime("numpy")
    program = compile_graph(model.graph, runtime, dims, options=SearchOptions(time_top=0)).program
    return runtime.load(program, model.load_weight, dims, states_from=states_from)


def full_forward(model, tokens):
    """Logits at every position of ``tokens`` [batch, seq] (transformers' forward): the whole sequence as new
    tokens at positions 0..seq-1 over an empty KV cache of its length, every position's logits kept."""
    import numpy as np

    batch, seq = tokens.shape
    exe = load_program(model, {"batch": batch, "seq": seq, "ctx": seq, "cache": seq, "keep": seq})
    return exe.run({"tokens": tokens, "positions": np.arange(seq, dtype=np.int32)})["logits"]
