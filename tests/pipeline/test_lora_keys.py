"""LoRA key formats and their mapping onto the FLUX.2 transformer recipe's weights, without running a model.

Files are written as the tools write them (diffusers' `Flux2Pipeline.save_lora_weights`, PEFT's `save_pretrained`)
or by the documented conventions (lora_files.py: fal/ai-toolkit's Black Forest Labs names, ComfyUI/kohya's), and
diffusers' own readers are the oracle: `Flux2Pipeline.lora_state_dict`, `_convert_non_diffusers_flux2_lora_to_
diffusers` and `_convert_kohya_flux2_lora_to_diffusers` give, per diffusers module, the down/up matrices (or the
scaled product) our mapping must give the recipe's weight of that name, rows of a fused QKV included; PEFT's own
LoRA layers give the scale. Bad files are refused with the file named (tests at the end).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.loaders.lora_conversion_utils import (
    _convert_kohya_flux2_lora_to_diffusers,
    _convert_non_diffusers_flux2_lora_to_diffusers,
)
from diffusers.models import Flux2Transformer2DModel
from lora_files import ALPHA, CHECKPOINT, TARGETS, make_lora, to_bfl  # tests/pipeline/lora_files.py
from safetensors.torch import save_file as save_torch
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import LoraError, LuminalError
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.recipe.builder import map_model_loras
from luminal_recipes.recipe.loader import load_recipe
from luminal_recipes.recipe.lora import LoraSpec, parse_lora_flag
from luminal_recipes.weights.lora import read_lora

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {name: load_recipe(ROOT / "recipes" / f"{name}.yaml")
           for name in ("flux2-transformer", "flux2-transformer-bfl")}
CONFIG = json.loads((CHECKPOINT / "transformer" / "config.json").read_text())
# PEFT's patterns: another rank for the output layer, another alpha for one MLP (scales 2, 3/4 and 8/2 = 4)
PATTERNS = {"rank_pattern": {"proj_out": 2}, "alpha_pattern": {r"transformer_blocks\.0\.ff\.linear_in": 3.0}}


@pytest.fixture(scope="module")
def lora():
    return make_lora(**PATTERNS)


def mapped(path: Path, recipe: str = "flux2-transformer", scale: float = 1.0) -> dict[str, list]:
    return map_model_loras(RECIPES[recipe], [LoraSpec(path, scale, f"--lora {path.name}")], config=CONFIG)


def module(weight: str) -> str:
    return weight.removesuffix(".weight")


def ours(updates: list) -> tuple[np.ndarray, np.ndarray, float]:
    """The one update of a weight: ``(down, up, scale)`` as applied (rows/columns of a fused tensor taken)."""
    (update,) = updates
    return update.down(), update.up(), update.scale


def save(state: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> Path:
    save_torch({k: v.contiguous() for k, v in state.items()}, path, metadata=metadata)
    return path


def linear_weights() -> set[str]:
    """Every linear weight of the tiny transformer: the layers PEFT's target regex adapts."""
    model = Flux2Transformer2DModel.from_pretrained(CHECKPOINT / "transformer")
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# ---- each format onto the recipe's names -------------------------------------------------------------------------
def test_diffusers_files_map_as_diffusers_reads_them(lora, tmp_path):
    state, config, scales = lora
    Flux2Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=state, transformer_lora_adapter_metadata=config)
    path = tmp_path / "pytorch_lora_weights.safetensors"
    assert read_lora(path, "test").format == "diffusers"
    want, _ = Flux2Pipeline.lora_state_dict(str(tmp_path), return_lora_metadata=True)
    updates = mapped(path, scale=0.5)
    assert set(updates) == linear_weights()  # every linear layer, once
    for weight, update in updates.items():
        down, up, scale = ours(update)
        assert np.array_equal(down, want[f"transformer.{module(weight)}.lora_A.weight"].numpy())
        assert np.array_equal(up, want[f"transformer.{module(weight)}.lora_B.weight"].numpy())
        assert scale == pytest.approx(0.5 * scales[module(weight)], rel=1e-7), weight  # PEFT's alpha / r
    assert {scales["proj_out"], scales["transformer_blocks.0.ff.linear_in"]} == {4.0, 0.75}  # the patterns


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_adapters_read_their_adapter_config(rslora, tmp_path):
    """PEFT's save_pretrained folder: alpha, rank patterns and rsLoRA from adapter_config.json, as PEFT applies
    them; without that file every scale is 1, as diffusers' load_lora_weights applies it."""
    from peft import LoraConfig, get_peft_model

    transformer = Flux2Transformer2DModel.from_pretrained(CHECKPOINT / "transformer")
    config = LoraConfig(r=4, lora_alpha=6, target_modules=TARGETS, init_lora_weights=False, use_rslora=rslora,
                        **PATTERNS)
    model = get_peft_model(transformer, config)
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    assert read_lora(path, "test").format == "PEFT"
    peft_scales = {name.removeprefix("base_model.model."): m.scaling["default"] for name, m in model.named_modules()
                   if hasattr(m, "scaling") and "default" in m.scaling}
    updates = mapped(path)
    assert set(updates) == linear_weights()
    for weight, update in updates.items():
        assert ours(update)[2] == pytest.approx(peft_scales[module(weight)], rel=1e-7), weight
    assert len(set(peft_scales.values())) == 3  # 6/4 (or 6/2), 3/4 (3/2), 6/2 (6/sqrt(2)): the patterns count
    (tmp_path / "adapter_config.json").unlink()
    assert {ours(update)[2] for update in mapped(path).values()} == {1.0}


def fal_state(state: dict[str, torch.Tensor], spelling: str) -> dict[str, torch.Tensor]:
    """The LoRA as an ai-toolkit/fal file holds it: Black Forest Labs' names (fused QKV) under `diffusion_model.`,
    as lora_A/lora_B or lora_down/lora_up; or diffusers' expanded block names there (`sformer_blocks.`: the
    legacy alias diffusers' converter reads as `transformer_blocks.`), BFL's for the rest."""
    if spelling == "expanded":
        out = {}
        for key, value in state.items():
            if key.startswith("transformer_blocks.0."):
                out[f"diffusion_model.sformer_blocks.0.{key.split('.', 2)[2]}"] = value
            elif key.startswith(("transformer_blocks.", "single_transformer_blocks.")):
                out[f"diffusion_model.{key}"] = value
        rest = {k: v for k, v in state.items() if not k.startswith(("transformer_blocks.", "single_transformer"))}
        for name, (down, up) in to_bfl(rest).items():
            out[f"diffusion_model.{name}.lora_A.weight"], out[f"diffusion_model.{name}.lora_B.weight"] = down, up
        return out
    a, b = ("A", "B") if spelling == "lora_A" else ("down", "up")
    return {f"diffusion_model.{name}.lora_{kind}.weight": tensor for name, (down, up) in to_bfl(state).items()
            for kind, tensor in ((a, down), (b, up))}


@pytest.mark.parametrize("spelling", ["lora_A", "lora_down", "expanded"])
@pytest.mark.parametrize("recipe", ["flux2-transformer", "flux2-transformer-bfl"])
def test_fal_files_map_as_diffusers_converts_them(lora, spelling, recipe, tmp_path):
    """Fused QKV: the down matrix shared, the up matrix's thirds, as diffusers' converter splits them; the same
    layers whether the model's own checkpoint is in diffusers' names or BFL's."""
    state, _, _ = lora
    if recipe == "flux2-transformer-bfl":  # it refuses norm_out.linear (test_a_weight_in_another_layout_...)
        state = {k: v for k, v in state.items() if not k.startswith("norm_out.linear.")}
    fal = fal_state(state, spelling)
    path = save(fal, tmp_path / "fal.safetensors")
    assert read_lora(path, "test").format == "fal/ai-toolkit"
    want = _convert_non_diffusers_flux2_lora_to_diffusers(dict(fal))
    updates = mapped(path, recipe)
    assert set(updates) == linear_weights() - ({"norm_out.linear.weight"} if recipe.endswith("bfl") else set())
    assert {f"transformer.{module(w)}.lora_{ab}.weight" for w in updates for ab in "AB"} == set(want)
    for weight, update in updates.items():
        down, up, scale = ours(update)
        assert np.array_equal(down, want[f"transformer.{module(weight)}.lora_A.weight"].numpy()), weight
        assert np.array_equal(up, want[f"transformer.{module(weight)}.lora_B.weight"].numpy()), weight
        assert scale == 1.0  # no alpha in the file: 1, as diffusers loads it
    inner = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    k = updates["transformer_blocks.0.attn.add_k_proj.weight"][0]
    if spelling == "expanded":
        assert k.layer.name == "transformer_blocks.0.attn.add_k_proj" and k.rows == slice(None)
    else:  # the K third of BFL's fused QKV
        assert k.layer.name == "double_blocks.0.txt_attn.qkv" and k.rows == slice(inner, 2 * inner)


def kohya_state(state: dict[str, torch.Tensor], prefix: str = "lora_unet_") -> dict[str, torch.Tensor]:
    """The LoRA as a ComfyUI/kohya file holds it: BFL names with `_` for `.`, lora_down/lora_up, and `.alpha`."""
    out = {}
    for name, (down, up) in to_bfl(state).items():
        key = prefix + name.replace(".", "_")
        out[f"{key}.lora_down.weight"], out[f"{key}.lora_up.weight"] = down, up
        out[f"{key}.alpha"] = torch.tensor(ALPHA)
    return out


# what diffusers' kohya converter drops (with a warning); ComfyUI applies them, and so do we
NOT_IN_DIFFUSERS_KOHYA = {
    "lora_unet_double_stream_modulation_img_lin": "double_stream_modulation_img.linear.weight",
    "lora_unet_double_stream_modulation_txt_lin": "double_stream_modulation_txt.linear.weight",
    "lora_unet_single_stream_modulation_lin": "single_stream_modulation.linear.weight",
    "lora_unet_guidance_in_in_layer": "time_guidance_embed.guidance_embedder.linear_1.weight",
    "lora_unet_guidance_in_out_layer": "time_guidance_embed.guidance_embedder.linear_2.weight",
    "lora_unet_final_layer_adaLN_modulation_1": "norm_out.linear.weight",
}


def test_kohya_files_map_as_diffusers_converts_them(lora, tmp_path):
    """The scaled product per layer (diffusers bakes alpha / rank into the matrices), fused QKV included; the
    layers diffusers' converter leaves out land on the weights ComfyUI's key map gives them."""
    state, _, _ = lora
    kohya = kohya_state(state)
    path = save(kohya, tmp_path / "kohya.safetensors")
    assert read_lora(path, "test").format == "ComfyUI/kohya"
    want = _convert_kohya_flux2_lora_to_diffusers(dict(kohya))
    updates = mapped(path)
    assert set(updates) == linear_weights()
    for weight, update in updates.items():
        down, up, scale = ours(update)
        key = f"transformer.{module(weight)}"
        if f"{key}.lora_A.weight" not in want:
            assert update[0].layer.key in NOT_IN_DIFFUSERS_KOHYA and NOT_IN_DIFFUSERS_KOHYA[update[0].layer.key] \
                == weight
            continue
        product = (want[f"{key}.lora_B.weight"] @ want[f"{key}.lora_A.weight"]).double().numpy()
        np.testing.assert_allclose(scale * (up.astype(np.float64) @ down), product, rtol=1e-5, atol=1e-7)  # f32
    assert len(updates) - len(NOT_IN_DIFFUSERS_KOHYA) == len(want) // 2


def test_kohya_files_in_diffusers_names_map_onto_the_same_weights(lora, tmp_path):
    """`lora_transformer_` + diffusers' names with `_` for `.` (ComfyUI's key for a diffusers-named layer)."""
    state, _, _ = lora
    kohya = {}
    for key, value in state.items():
        layer, kind = key.split(".lora_")
        kohya[f"lora_transformer_{layer.replace('.', '_')}.lora_{'down' if kind[0] == 'A' else 'up'}.weight"] = value
    updates = mapped(save(kohya, tmp_path / "kohya.safetensors"))
    assert set(updates) == linear_weights()
    for weight, update in updates.items():
        assert np.array_equal(ours(update)[1], state[f"{module(weight)}.lora_B.weight"].numpy())


def test_the_lora_flag_takes_an_optional_scale():
    assert parse_lora_flag("style.safetensors") == (Path("style.safetensors"), 1.0)
    assert parse_lora_flag("a/style.safetensors:0.6") == (Path("a/style.safetensors"), 0.6)
    assert parse_lora_flag("C:/loras/style.safetensors") == (Path("C:/loras/style.safetensors"), 1.0)


def test_a_weight_in_another_layout_than_diffusers_refuses_its_update(lora, tmp_path):
    """flux2-transformer-bfl.yaml keeps norm_out.linear in BFL's (shift, scale) order; diffusers adds a LoRA's
    update to its (scale, shift) weight: the recipe's `lora_refused` says so, naming the layer."""
    state, config, _ = lora
    Flux2Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=state, transformer_lora_adapter_metadata=config)
    with pytest.raises(LoraError, match=r"1 of its \d+ layers .*\n(.*\n)*  - 'transformer.norm_out.linear' -> "
                       r"'norm_out.linear.weight': this recipe keeps it in Black Forest Labs' \(shift, scale\)"):
        mapped(tmp_path / "pytorch_lora_weights.safetensors", "flux2-transformer-bfl")


# ---- files that do not fit, or are not LoRAs ---------------------------------------------------------------------
def rank1(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(1, cols), torch.ones(rows, 1)


def kohya_pairs(layers: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (rows, cols) in layers.items():
        out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = rank1(rows, cols)
    return out


def test_a_lora_for_another_model_is_refused(tmp_path):
    sdxl = kohya_pairs({"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q": (640, 640),
                        "lora_unet_mid_block_attentions_0_proj_in": (1280, 1280)})
    with pytest.raises(LoraError, match=r"--lora sdxl.safetensors: none of its 2 layers \(ComfyUI/kohya format, "
                       r".*is it a LoRA for another model\?"):
        mapped(save(sdxl, tmp_path / "sdxl.safetensors"))
    # FLUX.1 [dev]: the same BFL names where the architectures share them, at FLUX.1's width (3072); its per-block
    # modulation layers have no FLUX.2 counterpart
    flux1 = kohya_pairs({"lora_unet_double_blocks_0_img_attn_qkv": (9216, 3072),
                         "lora_unet_double_blocks_0_img_mod_lin": (18432, 3072),
                         "lora_unet_single_blocks_0_linear2": (3072, 15360)})
    with pytest.raises(LoraError) as info:
        mapped(save(flux1, tmp_path / "flux1.safetensors"))
    text = str(info.value)
    assert "3 of its 3 layers (ComfyUI/kohya format) do not fit model 'flux2-transformer'" in text
    assert "none fits: is it a LoRA for another model" in text
    assert "1 name no linear weight of the model: 'lora_unet_double_blocks_0_img_mod_lin'" in text
    assert "'lora_unet_double_blocks_0_img_attn_qkv' -> 'transformer_blocks.0.attn.to_q.weight', 'transformer_" \
           "blocks.0.attn.to_k.weight', 'transformer_blocks.0.attn.to_v.weight' (one fused layer, split): the update " \
           "is [9216, 3072] (up [9216, 1], down [1, 3072]), the weights together [192, 64]" in text
    assert "the update is [3072, 15360] (up [3072, 1], down [1, 15360]), the weight [64, 256]" in text


def test_a_kohya_lora_that_also_adapts_a_text_encoder_lists_those_layers(lora, tmp_path):
    state, _, _ = lora
    kohya = {**kohya_state(state), **kohya_pairs({"lora_te1_text_model_encoder_layers_0_mlp_fc1": (64, 32)})}
    with pytest.raises(LoraError, match=r"1 of its \d+ layers \(ComfyUI/kohya format\) do not fit .*\n  - 1 name no "
                       r"linear weight of the model: 'lora_te1_text_model_encoder_layers_0_mlp_fc1'"):
        mapped(save(kohya, tmp_path / "kohya.safetensors"))


def test_a_lora_matching_only_some_layers_lists_the_others(lora, tmp_path):
    state, config, _ = lora
    extra = {"transformer_blocks.7.attn.to_q": rank1(32, 32), "norm_out.linear_x": rank1(4, 4)}
    more = {**state, **{f"{k}.lora_{ab}.weight": t for k, (a, b) in extra.items() for ab, t in (("A", a), ("B", b))}}
    Flux2Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=more)
    with pytest.raises(LoraError) as info:
        mapped(tmp_path / "pytorch_lora_weights.safetensors")
    text = str(info.value)
    assert f"2 of its {len(more) // 2} layers (diffusers format) do not fit model 'flux2-transformer'" in text
    assert "none is applied" in text and "none fits" not in text
    assert "2 name no linear weight of the model: 'transformer.norm_out.linear_x', 'transformer.transformer_" \
           "blocks.7.attn.to_q'" in text


@pytest.mark.parametrize(("keys", "metadata", "message"), [
    ({"transformer.x_embedder.lora_A.weight": (4, 8), "transformer.x_embedder.lora_B.weight": (8, 4),
      "transformer.x_embedder.lora_magnitude_vector": (8,)}, None, "DoRA"),
    ({"lora_unet_img_in.lora_down.weight": (4, 8), "lora_unet_img_in.lora_up.weight": (8, 4),
      "lora_unet_img_in.dora_scale": (1, 8)}, None, "DoRA"),
    ({"transformer.x_embedder.lora_A.weight": (4, 8), "transformer.x_embedder.lora_B.weight": (8, 4),
      "transformer.x_embedder.lora_B.bias": (8,)}, None, "LoRA biases are not supported"),
    ({"lycoris_img_in.lokr_w1": (4, 4), "lycoris_img_in.lokr_w2": (2, 2)}, None, "LoKr/LoHa"),
    ({"transformer.x_embedder.lora_A.weight": (4, 8)}, None, "incomplete LoRA layers"),
    ({"transformer.x_embedder.lora_A.weight": (4, 8), "transformer.x_embedder.lora_B.weight": (8, 4),
      "diffusion_model.img_in.lora_A.weight": (4, 8), "diffusion_model.img_in.lora_B.weight": (8, 4)}, None,
     "mix formats"),
    ({"transformer.x_embedder.lora_A.weight": (4, 8), "transformer.x_embedder.lora_B.weight": (8, 5)}, None,
     "not a rank-r pair"),
    ({"x_embedder.weight": (8, 8)}, None, "not LoRA weights"),
    ({"transformer.x_embedder.lora_A.weight": (4, 8), "transformer.x_embedder.lora_B.weight": (8, 4)},
     {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 4, "use_dora": True})}, "use_dora=True"),
    ({"transformer.x_embedder.lora_A.weight": (4, 8), "transformer.x_embedder.lora_B.weight": (8, 4)},
     {"lora_adapter_metadata": json.dumps({"r": 8, "lora_alpha": 4})}, "has rank 4, but its LoraConfig says r=8"),
], ids=["dora", "kohya-dora", "bias", "lokr", "half-pair", "mixed", "ranks", "a-checkpoint", "use-dora", "rank"])
def test_what_is_not_a_plain_lora_is_refused(keys, metadata, message, tmp_path):
    path = save({k: torch.zeros(shape) for k, shape in keys.items()}, tmp_path / "x.safetensors", metadata)
    with pytest.raises(LoraError, match=message) as info:
        read_lora(path, "--lora x.safetensors")
    assert str(info.value).startswith("--lora x.safetensors: ")


def test_a_peft_adapter_config_that_changes_the_result_is_refused(tmp_path):
    path = save({"base_model.model.x_embedder.lora_A.weight": torch.zeros(4, 8),
                 "base_model.model.x_embedder.lora_B.weight": torch.zeros(8, 4)},
                tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "lora_bias": True}))
    with pytest.raises(LoraError, match="adapter_config.json sets lora_bias=True"):
        read_lora(path, "--lora adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LOHA", "r": 4}))
    with pytest.raises(LoraError, match="peft_type 'LOHA'"):
        read_lora(path, "--lora adapter_model.safetensors")


def test_files_that_are_missing_or_not_safetensors_are_refused(tmp_path):
    with pytest.raises(LoraError, match="--lora nowhere.safetensors: file not found"):
        read_lora(tmp_path / "nowhere.safetensors", "--lora nowhere.safetensors")
    (tmp_path / "style.ckpt").write_bytes(b"x")
    with pytest.raises(LoraError, match="a LoRA is a .safetensors file"):
        read_lora(tmp_path / "style.ckpt", "--lora style.ckpt")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoraError, match="--lora junk.safetensors: "):
        read_lora(tmp_path / "junk.safetensors", "--lora junk.safetensors")


# ---- `run --lora` and a pipeline's `loras:` ----------------------------------------------------------------------
def tiny_tree(tmp_path: Path) -> Path:
    """The tiny FLUX.2 recipes in a folder of their own (a recipe's files stay inside its folder tree)."""
    tree = tmp_path / "recipes"
    tree.mkdir()
    for name in ("flux2-tiny.yaml", "flux2.yaml", "mistral3-text-encoder.yaml", "flux2-transformer.yaml",
                 "flux2-transformer-bfl.yaml", "flux2-transformer-modules.yaml", "flux2-vae-decoder.yaml",
                 "flux2-vae-encoder.yaml"):
        (tree / name).write_text((ROOT / "recipes" / name).read_text())
    shutil.copytree(ROOT / "recipes" / "lib", tree / "lib")
    return tree


def test_a_pipeline_s_loras_come_before_the_flags_and_errors_name_their_line(lora, tmp_path):
    state, config, _ = lora
    tree = tiny_tree(tmp_path)
    Flux2Pipeline.save_lora_weights(tree / "loras", transformer_lora_layers=state,
                                    transformer_lora_adapter_metadata=config)
    kohya = save(kohya_state(state), tmp_path / "kohya.safetensors")
    head = "kind: pipeline\nextends: flux2-tiny.yaml\nname: styled\nloras:\n"
    (tree / "styled.yaml").write_text(head + "  - {path: loras/pytorch_lora_weights.safetensors, scale: 0.5, "
                                      "mode: graph}\n")
    pipe = Pipeline(tree / "styled.yaml", weights=CHECKPOINT, loras=[(kohya, 0.25)])
    specs = pipe.loras["transformer"]
    assert [(spec.path.name, spec.scale, spec.mode) for spec in specs] == [
        ("pytorch_lora_weights.safetensors", 0.5, "graph"), ("kohya.safetensors", 0.25, "auto")]
    assert specs[0].where.startswith(f"{tree / 'styled.yaml'}:5:")
    weights = pipe.model("transformer").weights
    assert "transformer_blocks.0.attn.to_q.weight.lora0.down" in weights  # the recipe's, in the graph
    assert "transformer_blocks.0.attn.to_q.weight.lora1.down" not in weights  # the flag's, merged
    (tree / "bad.yaml").write_text(head + "  - {path: loras/missing.safetensors}\n")
    with pytest.raises(LoraError, match=r"bad.yaml:5:\d+: loras\[0\] \(loras/missing.safetensors\): file not found"):
        Pipeline(tree / "bad.yaml", weights=CHECKPOINT).model("transformer")
    (tree / "outside.yaml").write_text(head + "  - {path: ../kohya.safetensors}\n")
    with pytest.raises(LuminalError, match="outside.yaml:5:"):
        Pipeline(tree / "outside.yaml", weights=CHECKPOINT).model("transformer")


@pytest.mark.parametrize("case", ["another-model", "some-layers", "not-a-lora", "missing"])
def test_run_refuses_a_bad_lora_before_any_work(lora, case, tmp_path, monkeypatch):
    """Exit 2, the file and what is wrong named, no traceback, nothing written."""
    state, config, _ = lora
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "style.safetensors"
    if case == "another-model":
        save(kohya_pairs({"lora_unet_down_blocks_0_attentions_0_proj_in": (320, 320)}), path)
    elif case == "some-layers":
        save({**{f"transformer.{k}": v for k, v in state.items()},
              "transformer.transformer_blocks.5.attn.to_q.lora_A.weight": torch.zeros(4, 32),
              "transformer.transformer_blocks.5.attn.to_q.lora_B.weight": torch.zeros(32, 4)}, path)
    elif case == "not-a-lora":
        shutil.copy(CHECKPOINT / "vae" / "diffusion_pytorch_model.safetensors", path)
    message = {"another-model": "is it a LoRA for another model?", "some-layers": "transformer_blocks.5.attn.to_q",
               "not-a-lora": "are not LoRA weights", "missing": "file not found"}[case]
    result = CliRunner().invoke(app, ["run", str(ROOT / "recipes" / "flux2-tiny.yaml"), "--prompt", "a fox",
                                      "--steps", "1", "--lora", f"{path.name}:0.7", "--output", "fox.png"])
    assert result.exit_code == 2, result.output
    assert f"--lora {path.name}" in result.output and message in result.output, result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == (["style.safetensors"] if case != "missing" else [])
