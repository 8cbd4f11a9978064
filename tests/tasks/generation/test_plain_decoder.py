"""`recipes/lib/causal_lm.yaml` serves a plain Llama-style decoder with nothing but its sizes: every feature of the
other families it implements (Qwen3's q/k norms and layer windows, MoE, Llama 3's RoPE scaling, biases, tied
embeddings) has a plain decoder's default, which a recipe overrides only when its architecture differs."""

from __future__ import annotations

import shutil

import numpy as np
import torch
import yaml
from generation_checkpoints import RECIPES

from luminal_recipes.tasks.generation import LanguageModel

PLAIN = """\
kind: model
name: plain
include: [lib/causal_lm.yaml]
params:
  vocab: ${config.vocab_size}
  hidden: ${config.hidden_size}
  intermediate: ${config.intermediate_size}
  layers: ${config.num_hidden_layers}
  heads: ${config.num_attention_heads}
  kv_heads: ${config.num_key_value_heads}
  head_dim: ${hidden // heads}
  eps: ${config.rms_norm_eps}
  max_positions: ${config.max_position_embeddings}
  rope_theta: ${config.get('rope_parameters.rope_theta', config.get('rope_theta', 10000.0))}
dims: [batch, seq, ctx, cache, keep]
inputs:
  tokens: {shape: [batch, seq], dtype: i32}
  positions: {shape: [seq], dtype: i32}
outputs: [logits]
root: causal_lm
generation:
  context: max_positions
weights:
  dtype: {storage: keep, compute: f32}
"""
FEATURES = {"qk_norm", "layer_types", "window_from", "experts", "experts_per_token", "moe_intermediate",
            "norm_topk_prob", "dense_layers", "sparse_step", "sliding_window"}


def test_a_plain_decoder_defines_only_its_sizes(tmp_path, llama, llama_lm):
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")
    (tmp_path / "plain.yaml").write_text(PLAIN)
    lm = LanguageModel(tmp_path / "plain.yaml", weights=llama[0])
    try:
        ids = lm.encode("The capital of France is", chat=False)
        with torch.no_grad():
            expected = llama[1](torch.tensor([ids])).logits[0].numpy()
        got = lm.logits(ids)
        assert np.abs(got - expected).max() / np.abs(expected).max() <= 1e-4
        assert lm.generate(ids, max_new_tokens=8).ids == llama_lm.generate(ids, max_new_tokens=8).ids
    finally:
        lm.release()


def test_the_plain_shipped_decoders_no_longer_define_features_they_lack():
    for name in ("llama.yaml", "mistral.yaml"):
        params = yaml.safe_load((RECIPES / name).read_text())["params"]
        assert not (FEATURES - {"sliding_window"}) & set(params), (name, sorted(FEATURES & set(params)))
    assert "sliding_window" not in yaml.safe_load((RECIPES / "llama.yaml").read_text())["params"]
