"""The `config:` section of model recipes: every config.json field is read, required or ignored with a reason.

A checkpoint whose config.json asks for a value a recipe does not implement is refused at the recipe line that
lists the implemented values; fields the recipe does not know are listed by `validate --verbose`; parameters may
read only declared fields. The shipped recipes are held against the reference classes' own field lists (transformers
configs, diffusers __init__ arguments), so a field added upstream fails here until it is classified.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
from transformers import (
    BertConfig,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GPT2Config,
    LlamaConfig,
    Mistral3Config,
    MistralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import RecipeError
from luminal_recipes.recipe import load_recipe, validate
from luminal_recipes.recipe.builder import build_model
from luminal_recipes.recipe.config_fields import ABSENT, config_report, lookup, same_value

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TINY = RECIPES / "flux2-tiny" / "checkpoint"
TEXT_CONFIG = json.loads((TINY / "text_encoder" / "config.json").read_text())
TRANSFORMER_CONFIG = json.loads((TINY / "transformer" / "config.json").read_text())
VAE_CONFIG = json.loads((TINY / "vae" / "config.json").read_text())
KLEIN = RECIPES / "flux2-klein-tiny" / "checkpoint"
KLEIN_TEXT_CONFIG = json.loads((KLEIN / "text_encoder" / "config.json").read_text())
KLEIN_TRANSFORMER_CONFIG = json.loads((KLEIN / "transformer" / "config.json").read_text())
LLAMA_CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}
QWEN3_CONFIG = {**LLAMA_CONFIG, "model_type": "qwen3", "head_dim": 8}
QWEN3_MOE_CONFIG = {**QWEN3_CONFIG, "model_type": "qwen3_moe", "moe_intermediate_size": 16, "num_experts": 4,
                    "num_experts_per_tok": 2}
GEMMA3_CONFIG = {**{k: v for k, v in LLAMA_CONFIG.items() if k != "hidden_act"}, "model_type": "gemma3_text",
                 "head_dim": 8,
                 "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
GEMMA4_CONFIG = {**GEMMA3_CONFIG, "model_type": "gemma4_text", "hidden_size_per_layer_input": 0,
                 "layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2,
                 "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}}}
BERT_CONFIG = {"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 16, "hidden_act": "gelu"}
GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_positions": 16, "n_layer": 1, "n_head": 4,
               "activation_function": "gelu_new"}


def with_field(config: dict, path: str, value) -> dict:
    out = copy.deepcopy(config)
    node = out
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def line_of(recipe: str, key: str) -> int:
    """The line of `key:` inside the recipe's `config:` section."""
    lines = (RECIPES / recipe).read_text().splitlines()
    start = lines.index("config:")
    return next(i + 1 for i, text in enumerate(lines[start:], start) if text.strip().startswith(f"{key}:"))


REFUSED = [
    ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.hidden_act", "gelu"),
    ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.rope_parameters.rope_type", "yarn"),
    ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.rope_scaling", {"type": "linear", "factor": 2.0}),
    ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.model_type", "ministral3"),
    ("mistral3-text-encoder.yaml", TEXT_CONFIG, "model_type", "llava"),
    ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.per_layer_config", {"3": {"hidden_act": "gelu"}}),
    ("flux2-transformer.yaml", TRANSFORMER_CONFIG, "patch_size", 2),
    ("flux2-transformer-bfl.yaml", TRANSFORMER_CONFIG, "patch_size", 2),
    ("flux2-vae-decoder.yaml", VAE_CONFIG, "act_fn", "relu"),
    ("flux2-vae-decoder.yaml", VAE_CONFIG, "patch_size", [1, 1]),
    ("flux2-vae-decoder.yaml", VAE_CONFIG, "up_block_types", ["AttnUpDecoderBlock2D"] * 4),
    ("flux2-vae-encoder.yaml", VAE_CONFIG, "act_fn", "relu"),
    ("flux2-vae-encoder.yaml", VAE_CONFIG, "down_block_types", ["AttnDownEncoderBlock2D"] * 4),
    ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "model_type", "qwen2"),  # Qwen2 has no q/k norms, has biases
    ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "hidden_act", "gelu"),
    ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "rope_parameters.rope_type", "yarn"),
    ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "rope_scaling", {"type": "linear", "factor": 2.0}),
    ("llama.yaml", LLAMA_CONFIG, "rope_parameters.rope_type", "yarn"),
    ("llama.yaml", LLAMA_CONFIG, "hidden_act", "gelu"),
    ("qwen3.yaml", QWEN3_CONFIG, "rope_parameters.rope_type", "yarn"),
    ("qwen3.yaml", QWEN3_CONFIG, "hidden_act", "gelu"),
    ("qwen3.yaml", QWEN3_CONFIG, "model_type", "qwen3_moe"),
    ("qwen3-moe.yaml", QWEN3_MOE_CONFIG, "hidden_act", "gelu"),
    ("qwen3-moe.yaml", QWEN3_MOE_CONFIG, "model_type", "qwen3"),
    ("qwen3-moe.yaml", QWEN3_MOE_CONFIG, "rope_parameters.rope_type", "yarn"),
    ("gemma3.yaml", GEMMA3_CONFIG, "rope_parameters.full_attention.rope_type", "yarn"),
    ("gemma3.yaml", GEMMA3_CONFIG, "rope_parameters.sliding_attention.rope_type", "linear"),
    ("gemma3.yaml", GEMMA3_CONFIG, "use_bidirectional_attention", True),
    ("gemma3.yaml", GEMMA3_CONFIG, "hidden_activation", "silu"),
    ("gpt2.yaml", GPT2_CONFIG, "activation_function", "gelu_10"),
    ("gemma4-moe.yaml", GEMMA4_CONFIG, "hidden_size_per_layer_input", 256),
    ("gemma4-moe.yaml", GEMMA4_CONFIG, "num_kv_shared_layers", 1),
    ("gemma4-moe.yaml", GEMMA4_CONFIG, "use_bidirectional_attention", "all"),
    ("gemma4-moe.yaml", GEMMA4_CONFIG, "rope_parameters.full_attention.rope_type", "yarn"),
    ("bert.yaml", BERT_CONFIG, "position_embedding_type", "relative_key"),
    ("bert.yaml", BERT_CONFIG, "is_decoder", True),
    ("bert.yaml", BERT_CONFIG, "hidden_act", "silu"),
    ("gpt2.yaml", GPT2_CONFIG, "add_cross_attention", True),
    ("llama.yaml", LLAMA_CONFIG, "rope_scaling.rope_type", "dynamic"),
    ("llama.yaml", LLAMA_CONFIG, "rope_scaling.type", "linear"),
    ("llama.yaml", LLAMA_CONFIG, "rope_parameters.partial_rotary_factor", 0.5),
]


@pytest.mark.parametrize(("recipe", "config", "path", "value"), REFUSED, ids=[f"{r[0]}:{r[2]}" for r in REFUSED])
def test_unimplemented_values_are_refused_at_the_recipe_line(recipe, config, path, value):
    with pytest.raises(RecipeError) as info:
        build_model(load_recipe(RECIPES / recipe), config=with_field(config, path, value))
    message = str(info.value)
    rule = path if path in load_recipe(RECIPES / recipe).config_fields else path.rsplit(".", 1)[0]
    defining = "flux2-transformer-modules.yaml" if recipe.startswith("flux2-transformer") else recipe
    assert f"{defining}:{line_of(defining, rule)}:" in message
    assert f"'{path}' is {json.dumps(value, sort_keys=True)}" in message
    assert "refused" in message and "implements" in message


def test_all_refused_fields_are_reported_at_once():
    config = with_field(with_field(TEXT_CONFIG, "text_config.hidden_act", "relu"), "model_type", "llava")
    with pytest.raises(RecipeError, match=r"\(2 fields\)") as info:
        build_model(load_recipe(RECIPES / "mistral3-text-encoder.yaml"), config=config)
    assert "'text_config.hidden_act' is \"relu\"" in str(info.value) and "'model_type' is \"llava\"" in str(info.value)


@pytest.mark.parametrize(
    ("recipe", "config", "path", "value"),
    [
        ("flux2-vae-decoder.yaml", VAE_CONFIG, "use_quant_conv", False),  # encoder only: irrelevant
        ("flux2-vae-decoder.yaml", VAE_CONFIG, "sample_size", 512),
        ("flux2-vae-encoder.yaml", VAE_CONFIG, "use_post_quant_conv", False),  # decoder only: irrelevant
        ("flux2-vae-encoder.yaml", VAE_CONFIG, "use_quant_conv", False),  # implemented
        ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.tie_last_hidden_states", False),  # implemented
        ("mistral3-text-encoder.yaml", TEXT_CONFIG, "text_config.sliding_window", 4096),  # implemented
        ("mistral3-text-encoder.yaml", TEXT_CONFIG, "vision_config.hidden_act", "relu"),  # vision tower never runs
        ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "tie_last_hidden_states", False),  # implemented
        ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "attention_bias", True),  # implemented (optional biases)
        ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "use_sliding_window", True),  # implemented (window_from)
        ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG, "tie_word_embeddings", False),  # the LM head never runs
        ("llama.yaml", LLAMA_CONFIG, "attention_bias", True),  # implemented (optional biases)
        ("qwen3.yaml", QWEN3_CONFIG, "use_sliding_window", True),  # implemented (windows per layer_types)
        ("gpt2.yaml", GPT2_CONFIG, "reorder_and_upcast_attn", True),  # f32 scores: what the recipe computes anyway
        ("gemma3.yaml", GEMMA3_CONFIG, "final_logit_softcapping", 30.0),  # implemented
        ("qwen3-moe.yaml", QWEN3_MOE_CONFIG, "norm_topk_prob", True),  # implemented
        ("gemma4-moe.yaml", GEMMA4_CONFIG, "attention_k_eq_v", True),  # implemented
        ("gemma4-moe.yaml", GEMMA4_CONFIG, "use_double_wide_mlp", True),  # no KV-shared layers to widen
        ("gemma3.yaml", GEMMA3_CONFIG, "attn_logit_softcapping", 50.0),  # transformers 5 never applies it
        ("llama.yaml", LLAMA_CONFIG, "rope_parameters.rope_type", "llama3"),  # implemented (Llama 3.1 scaling)
    ],
)
def test_irrelevant_or_implemented_values_are_accepted(recipe, config, path, value):
    build_model(load_recipe(RECIPES / recipe), config=with_field(config, path, value))


def test_unknown_fields_are_listed_by_validate_verbose(tmp_path):
    folder = tmp_path / "vae"
    shutil.copytree(TINY / "vae", folder)
    config = with_field(with_field(VAE_CONFIG, "mystery_scale", 0.5), "scaling_factor", 0.18)
    (folder / "config.json").write_text(json.dumps(config))
    report = validate(RECIPES / "flux2-vae-decoder.yaml", folder)
    quiet, verbose = report.render(), report.render(verbose=True)
    assert "mystery_scale" not in quiet
    assert "2 unknown" in verbose and "mystery_scale=0.5" in verbose and "scaling_factor=0.18" in verbose
    assert 'act_fn="silu"' in verbose  # required values met are listed too
    result = CliRunner().invoke(app, ["validate", str(RECIPES / "flux2-vae-decoder.yaml"), "--weights", str(folder),
                                      "--verbose"])
    assert result.exit_code == 0 and "mystery_scale=0.5" in result.output


def test_shipped_checkpoint_has_no_unknown_fields():
    for recipe, config in [("mistral3-text-encoder.yaml", TEXT_CONFIG), ("flux2-transformer.yaml", TRANSFORMER_CONFIG),
                           ("flux2-vae-decoder.yaml", VAE_CONFIG), ("flux2-vae-encoder.yaml", VAE_CONFIG),
                           ("qwen3-text-encoder.yaml", KLEIN_TEXT_CONFIG),
                           ("flux2-transformer.yaml", KLEIN_TRANSFORMER_CONFIG)]:
        report = config_report(load_recipe(RECIPES / recipe), config, "config.json")
        assert report.declared and report.unknown == [], (recipe, report.unknown)


def reference_fields() -> dict[str, dict]:
    """What each reference class's config holds with every field at its default."""

    def init_defaults(cls) -> dict:
        params = inspect.signature(cls.__init__).parameters.values()
        return {p.name: list(p.default) if isinstance(p.default, tuple) else p.default
                for p in params if p.name != "self"}

    return {
        "mistral3-text-encoder.yaml": Mistral3Config().to_dict(),
        "qwen3-text-encoder.yaml": Qwen3Config().to_dict(),
        "llama.yaml": LlamaConfig().to_dict(),
        "qwen3.yaml": Qwen3Config().to_dict(),
        "gpt2.yaml": GPT2Config().to_dict(),
        "gemma3.yaml": Gemma3TextConfig().to_dict(),
        "bert.yaml": BertConfig().to_dict(),
        # the class's defaults describe Gemma 4 E2B (per-layer input embeddings); the recipe is the MoE variant's
        "gemma4-moe.yaml": Gemma4TextConfig(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128,
                                            top_k_experts=8, moe_intermediate_size=704).to_dict(),
        "qwen3-moe.yaml": Qwen3MoeConfig().to_dict(),
        "mistral.yaml": MistralConfig().to_dict(),
        "flux2-transformer.yaml": init_defaults(Flux2Transformer2DModel),
        "flux2-transformer-bfl.yaml": init_defaults(Flux2Transformer2DModel),
        "flux2-vae-decoder.yaml": init_defaults(AutoencoderKLFlux2),
        "flux2-vae-encoder.yaml": init_defaults(AutoencoderKLFlux2),
    }


@pytest.mark.parametrize("recipe", sorted(reference_fields()))
def test_every_reference_field_is_classified_and_its_default_implemented(recipe):
    config = reference_fields()[recipe]
    report = config_report(load_recipe(RECIPES / recipe), config, "config.json")
    assert report.unknown == [], f"{recipe}: classify these fields under config.read/require/ignore"
    for rule in load_recipe(RECIPES / recipe).config_fields.values():
        default = lookup(config, rule.path)
        if rule.kind == "require" and default is not ABSENT:
            assert any(same_value(default, v) for v in rule.values), (rule.path, default)


def test_same_value_keeps_booleans_apart():
    assert same_value(1, 1.0) and same_value([2, 2], (2, 2)) and same_value(None, None)
    assert not same_value(True, 1) and not same_value(0, False) and not same_value("1", 1)


# ---- the section itself -------------------------------------------------------------------------------------
MODEL = """
kind: model
name: t
params:
  hidden: ${config.hidden_size}
  eps: ${config.get('norm.eps', 1e-6)}
config:
  read: [hidden_size, norm]
  require:
    act: [silu, gelu]
  ignore:
    dropout: training only
modules:
  m:
    inputs: [x]
    forward: return x
inputs:
  x: {shape: [hidden]}
"""


def test_parameters_may_read_only_declared_fields(write, position):
    path, text = write("ok.yaml", MODEL)
    build_model(load_recipe(path), config={"hidden_size": 4, "norm": {"eps": 1e-5}, "act": "gelu", "dropout": 0.1})
    bad = MODEL.replace("${config.hidden_size}", "${config.hidden_size * config.width}")
    path, text = write("bad.yaml", bad)
    with pytest.raises(RecipeError, match="reads config field 'width', which the recipe's `config:` section") as info:
        load_and_check(path)
    assert str(info.value).startswith(f"{path}:{position(text, 'config.width')}:")
    ignored = MODEL.replace("${config.hidden_size}", "${config.dropout}")
    path, _ = write("ignored.yaml", ignored)
    with pytest.raises(RecipeError, match="reads config field 'dropout', declared irrelevant .*training only"):
        load_and_check(path)


def load_and_check(path):
    from luminal_recipes.recipe.check import check_recipe

    check_recipe(load_recipe(path))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("  read: [a]\n  ignore: {a: why}\n", "listed under both `read` and `ignore`"),
        ("  require: {a: []}\n", "needs at least one allowed value"),
        ("  read: ['a b']\n", "must be dotted keys"),
        ("  reed: [a]\n", "unknown key 'reed' \\(did you mean 'read'\\?\\)"),
    ],
)
def test_section_errors_are_located(write, section, message):
    text = MODEL.split("config:\n")[0] + "config:\n" + section + "modules:" + MODEL.split("modules:")[1]
    path, _ = write("s.yaml", text)
    with pytest.raises(RecipeError, match=message) as info:
        load_recipe(path)
    assert re.match(rf"{re.escape(str(path))}:\d+:\d+: ", str(info.value))


def test_a_field_declared_in_an_include_and_the_recipe_is_an_error(write):
    write("lib.yaml", "kind: modules\nconfig:\n  read: [hidden_size]\nmodules: {}\n")
    path, _ = write("m.yaml", MODEL.replace("name: t\n", "name: t\ninclude: [lib.yaml]\n"))
    with pytest.raises(RecipeError, match=r"lib.yaml:3:9: config field 'hidden_size' is already declared at .*m.yaml:"):
        load_recipe(path)


def test_recipes_without_a_section_are_unchecked(write):
    path, _ = write("plain.yaml", MODEL.split("config:")[0] + "modules:" + MODEL.split("modules:")[1])
    recipe = load_recipe(path)
    assert recipe.config_fields is None
    build_model(recipe, config={"hidden_size": 4, "act": "relu"})
    assert "no `config:` section" in config_report(recipe, {"hidden_size": 4}, "config.json").lines()[0]


def test_a_library_is_held_to_its_own_config_section(write):
    text = "kind: modules\nparams:\n  h: ${config.hidden_size}\nconfig:\n  read: [hidden]\nmodules: {}\n"
    path, _ = write("lib.yaml", text)
    with pytest.raises(RecipeError, match="parameter 'h' reads config field 'hidden_size'"):
        validate(path)
    path, _ = write("lib.yaml", text.replace("[hidden]", "[hidden_size]"))
    assert "valid module library" in str(validate(path))


@pytest.mark.parametrize("per_layer", [
    {"1": {"head_dim": 16, "intermediate_size": 64}},                    # a full layer's field not implemented
    {"0": {"head_dim": 8}, "1": {"head_dim": 16}},                       # any override of the sliding layers
])
def test_gemma4_refuses_per_layer_overrides_it_does_not_implement(per_layer):
    config = {**GEMMA4_CONFIG, "per_layer_config": per_layer}
    with pytest.raises(RecipeError, match="parameter 'unsupported_overrides' is 1, not one of its choices") as info:
        build_model(load_recipe(RECIPES / "gemma4-moe.yaml"), config=config)
    lines = (RECIPES / "gemma4-moe.yaml").read_text().splitlines()
    declared = next(i + 1 for i, text in enumerate(lines) if text.strip().startswith("unsupported_overrides:"))
    line = int(str(info.value).split(":")[1])
    assert str(info.value).split(":")[0].endswith("recipes/gemma4-moe.yaml") and declared < line < declared + 6


def test_config_mappings_read_like_dicts(write):
    """`list(config.x)` gives a mapping's keys, `len` its size, `in` tests a key (per-layer override tables)."""
    path, _ = write("m.yaml", MODEL.replace("${config.hidden_size}", "${len(list(config.norm)) + len(config.norm) "
                                            "+ (10 if 'eps' in config.norm else 0)}"))
    built = build_model(load_recipe(path), config={"hidden_size": 4, "norm": {"eps": 1e-5, "x": 1}, "act": "gelu"})
    assert built.params["hidden"] == 14
