"""The language-model recipes against transformers, on tiny random checkpoints transformers saved itself.

Each case compiles the recipe (egglog search + numpy runtime) and compares the logits of every position of a full
forward (positions 0..n-1 over an empty KV cache of n rows, every position kept) with the reference class's; one
case per architecture also generates greedily with the compiled prefill and decode programs sharing the KV cache
and checks every generated id against ``model.generate(do_sample=False)``. The configs switch on what each
architecture can vary (sliding windows, biases, tied or untied heads, activations, layer-dependent scaling,
expert routing), so a recipe that ignored a field would fail here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_checkpoints import PROMPT, RECIPES, full_forward, save_tiny  # noqa: E402

from luminal_recipes import load_recipe  # noqa: E402
from luminal_recipes.recipe.builder import build  # noqa: E402

CASES = {
    "qwen3-sliding": ("qwen3.yaml", "Qwen3ForCausalLM", dict(
        use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3-tied-bias": ("qwen3.yaml", "Qwen3ForCausalLM", dict(
        tie_word_embeddings=True, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        use_sliding_window=True, sliding_window=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "qwen3-moe": ("qwen3-moe.yaml", "Qwen3MoeForCausalLM", {}),
    "qwen3-moe-normalised-sliding-step": ("qwen3-moe.yaml", "Qwen3MoeForCausalLM", dict(
        norm_topk_prob=True, num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[], use_sliding_window=True,
        sliding_window=4, tie_word_embeddings=True)),
    "gemma3": ("gemma3.yaml", "Gemma3ForCausalLM", {}),
    "gemma3-softcap-linear-rope-untied": ("gemma3.yaml", "Gemma3ForCausalLM", dict(
        final_logit_softcapping=2.0, tie_word_embeddings=False, hidden_activation="gelu", attention_bias=True,
        layer_types=None, sliding_window_pattern=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0}})),
    "gemma4-moe": ("gemma4-moe.yaml", "Gemma4ForCausalLM", {}),
    "gemma4-dense-untied": ("gemma4-moe.yaml", "Gemma4ForCausalLM", dict(
        enable_moe_block=False, attention_k_eq_v=False, tie_word_embeddings=False, final_logit_softcapping=None,
        hidden_activation="gelu", rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0,
                               "rope_theta": 1000.0}})),
    "gpt2": ("gpt2.yaml", "GPT2LMHeadModel", {}),
    "gpt2-untied-relu-layer-scaled": ("gpt2.yaml", "GPT2LMHeadModel", dict(
        activation_function="relu", scale_attn_by_inverse_layer_idx=True, tie_word_embeddings=False, n_inner=96)),
}


def logits_of(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_logits_match_transformers(tmp_path, case):
    recipe, cls, overrides = CASES[case]
    reference, vocab = save_tiny(tmp_path, cls, seed=len(case), **overrides)
    model = build(RECIPES / recipe, weights=tmp_path)
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 9), dtype=np.int32)
    ours, expected = full_forward(model, tokens), logits_of(reference, tokens)
    assert ours.shape == expected.shape == (2, 9, vocab)
    rel = np.abs(ours - expected).max() / np.abs(expected).max()
    assert rel <= 1e-4, f"{case}: relative error {rel:.2e}"


def test_the_sliding_window_changes_the_logits(tmp_path):
    """The windowed cases above exercise the window: without it, transformers' own logits differ."""
    _, cls, overrides = CASES["qwen3-sliding"]
    windowed, vocab = save_tiny(tmp_path / "a", cls, seed=1, **overrides)
    full, _ = save_tiny(tmp_path / "b", cls, seed=1, **{**overrides, "use_sliding_window": False})
    tokens = np.random.default_rng(0).integers(0, vocab, size=(1, 9), dtype=np.int32)
    a, b = logits_of(windowed, tokens), logits_of(full, tokens)
    assert np.allclose(a[:, :4], b[:, :4], atol=1e-6) and not np.allclose(a[:, 4:], b[:, 4:], atol=1e-3)


def rewrite_config(folder, drop=(), **values):
    path = folder / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **values}))


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_hub_style_configs_without_layer_types(tmp_path, case):
    """Configs written before transformers 5 have no layer_types (nor rope_parameters): the recipes derive them as
    the config classes do (Qwen3: sliding from max_window_layers on; Gemma 3: every sliding_window_pattern-th layer
    full, local and global RoPE bases, linear scaling of the global one)."""
    if case == "qwen3":
        save_tiny(tmp_path, "Qwen3ForCausalLM", seed=5)
        rewrite_config(tmp_path, drop=("layer_types", "rope_parameters"), use_sliding_window=True, sliding_window=3,
                       max_window_layers=1, rope_theta=300.0)
        reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
        assert reference.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    else:
        save_tiny(tmp_path, "Gemma3ForCausalLM", seed=5)
        rewrite_config(tmp_path, drop=("layer_types", "rope_parameters", "_sliding_window_pattern"),
                       sliding_window_pattern=2, rope_theta=20000.0, rope_local_base_freq=30.0,
                       rope_scaling={"rope_type": "linear", "factor": 8.0})
        reference = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path).eval()
        assert reference.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    model = build(RECIPES / f"{case}.yaml", weights=tmp_path)
    tokens = np.random.default_rng(1).integers(0, 256, size=(1, 10), dtype=np.int32)
    ours, expected = full_forward(model, tokens), logits_of(reference, tokens)
    assert np.abs(ours - expected).max() / np.abs(expected).max() <= 1e-4


def program_work(model, dims):
    """Matrix flops per kernel kind of the compiled program at ``dims``, and the bytes its gathers of whole
    matrices (rows of 3-D tables: expert weights) move."""
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.compiler.cost import kernel_work
    from luminal_recipes.runtimes.registry import get_runtime

    program = compile_graph(model.graph, get_runtime("numpy"), dims,
                            options=SearchOptions(use_cache=False, time_top=0)).program
    dtypes = {n.id: n.dtype for n in program.nodes}
    flops, gathered = {}, 0
    for n in program.nodes:
        work = kernel_work(n.op, n.shape, n.dtype, [(v, dtypes[s]) for s, v in n.inputs], dict(n.attrs), dims)
        flops[n.op] = flops.get(n.op, 0) + work.mm_flops
        if n.op == "Gather" and len(n.inputs[0][1].shape) == 3:
            gathered += work.bytes
    return flops, gathered


def test_moe_computes_only_the_chosen_experts(tmp_path):
    """Eight times more experts (same k): the compiled program's matrix work grows by the router's product alone,
    and the expert weights it gathers stay the same size - the unchosen experts are never read."""
    tokens, hidden = 4, 64
    work = {}
    for experts in (8, 64):
        save_tiny(tmp_path / str(experts), "Qwen3MoeForCausalLM", num_experts=experts, num_hidden_layers=1,
                  mlp_only_layers=[])
        work[experts] = program_work(build(RECIPES / "qwen3-moe.yaml", weights=tmp_path / str(experts)),
                                     {"batch": 1, "seq": tokens, "ctx": tokens, "cache": tokens, "keep": 1})
    (flops8, bytes8), (flops64, bytes64) = work[8], work[64]
    assert sum(flops64.values()) - sum(flops8.values()) == 2 * tokens * hidden * (64 - 8)  # the router only
    expert_bytes = 3 * tokens * 2 * 32 * hidden * 4  # gate/up/down rows of k=2 experts per token, f32
    assert bytes8 == bytes64 and 2 * expert_bytes <= bytes8 < 2.01 * expert_bytes  # read once, written once


# the cache path of each architecture, with its sliding windows, routing, soft-cap and untied heads
GENERATION = ["qwen3-sliding", "qwen3-moe-normalised-sliding-step", "gemma3-softcap-linear-rope-untied",
              "gemma4-moe", "gpt2-untied-relu-layer-scaled"]


def float64_twin(reference, folder):
    """The reference reloaded in float64, so the logits compared are the exact ones (tests/TOLERANCES.md: `want`
    is float64); transformers' f32 logits of these models are themselves ~7e-6 off. Experts run eagerly (the
    grouped-mm kernel takes no float64)."""
    twin = type(reference).from_pretrained(folder, dtype=torch.float64).eval()
    twin.config._experts_implementation = "eager"
    return twin


@pytest.mark.parametrize("case", GENERATION)
def test_greedy_generation_matches_transformers(tmp_path, case, assert_close):
    """32 new tokens after a prompt encoded by the checkpoint's real tokenizer, generated by the text-generation
    driver (compiled prefill and decode programs sharing the KV cache): every id equal to transformers' greedy
    generate, and the last prompt position's logits (against the float64 model) within the tolerance policy."""
    recipe, cls, overrides = CASES[case]
    reference, _ = save_tiny(tmp_path, cls, seed=len(case) + 1, tokenizer=True, **overrides)
    lm = load_recipe(RECIPES / recipe, weights=tmp_path)
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(PROMPT)["input_ids"]
    with torch.no_grad():
        prompt = torch.tensor([ids], dtype=torch.long)
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=32)[0, len(ids):].tolist()
        expected_last = float64_twin(reference, tmp_path)(prompt).logits[0, -1].numpy()
    reply = lm.generate(PROMPT, max_new_tokens=32, chat=False)
    assert reply.prompt_ids == ids
    assert reply.ids == expected
    assert_close("model", lm.logits(ids)[-1], expected_last)
