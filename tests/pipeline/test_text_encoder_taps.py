"""Text-encoder taps index transformers' output_hidden_states: 0 = embeddings, k = output of layer k, the last one
after the final norm, negative indices from the end; only the layers up to the deepest tap run; out-of-range taps
are refused where they were written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Mistral3ForConditionalGeneration
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import RecipeError
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.recipe.builder import build

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "mistral3-text-encoder.yaml"
PIPELINE = ROOT / "recipes" / "flux2-tiny.yaml"
TEXT_ENCODER = ROOT / "recipes" / "flux2-tiny" / "checkpoint" / "text_encoder"  # 31 layers


def recipe_line(text: str) -> int:
    return next(i + 1 for i, line in enumerate(RECIPE.read_text().splitlines()) if line.strip() == text)


@pytest.fixture(scope="module")
def hidden_states():
    model = Mistral3ForConditionalGeneration.from_pretrained(TEXT_ENCODER).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 131072, (1, 24)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 18:] = 0
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                    output_hidden_states=True, use_cache=False)
    return ids, mask, [h.numpy() for h in out.hidden_states]


def test_taps_are_transformers_hidden_states(hidden_states):
    ids, mask, states = hidden_states
    assert len(states) == 32  # 31 layers + the embeddings
    taps = [0, 31, -1, -32, 15]
    got = ModelEngine(build(RECIPE, TEXT_ENCODER, {"out_layers": taps}))({"tokens": ids, "attention_mask": mask})
    want = np.concatenate([states[k] for k in taps], -1)
    assert np.abs(got["prompt_embeds"] - want).max() <= 1e-5 * np.abs(want).max()


def test_only_the_layers_up_to_the_deepest_tap_run():
    shallow = build(RECIPE, TEXT_ENCODER, {"out_layers": [1, 3, -30]})  # -30 is 2
    used = set(shallow.weights)
    assert any(".layers.2." in name for name in used) and not any(".layers.3." in name for name in used)
    assert not any(name.endswith("model.norm.weight") for name in used)
    deepest = build(RECIPE, TEXT_ENCODER, {"out_layers": [-1]})
    assert any(".layers.30." in name for name in deepest.weights)
    assert any(name.endswith("model.norm.weight") for name in deepest.weights)


def test_out_of_range_taps_are_refused_at_the_set():
    result = CliRunner().invoke(app, ["validate", str(RECIPE), "--weights", str(TEXT_ENCODER), "--set",
                                      "out_layers=[1,32]"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        "--set out_layers=[1,32]: parameter 'out_layers' is out of range: item 32 of [1, 32] is above its maximum 31 "
        "(max: layers), declared at "
    ) in result.output
    assert f"mistral3-text-encoder.yaml:{recipe_line('max: layers')}:10." in result.output
    line = recipe_line("min: -(layers + 1)")
    with pytest.raises(RecipeError, match=rf"^--set out_layers=\[-33\]: .* below its minimum -32 .*yaml:{line}:"):
        build(RECIPE, TEXT_ENCODER, ["out_layers=[-33]"])


def test_pipeline_taps_out_of_range_name_the_pipeline_line_and_the_set(tmp_path):
    pipeline = Pipeline(PIPELINE, sets=["text_encoder_out_layers=[10,20,40]"])
    with pytest.raises(RecipeError) as info:
        pipeline.model("text_encoder")
    message = str(info.value)
    base = PIPELINE.parent / "flux2.yaml"  # flux2-tiny.yaml extends it: the error points where the value is written
    line = next(i + 1 for i, text in enumerate(base.read_text().splitlines()) if text.startswith("  text_encoder:"))
    assert f"recipes/flux2.yaml:{line}:" in message.split(" ")[0]
    assert "models.text_encoder.set.out_layers (from --set text_encoder_out_layers=[10,20,40])" in message
    assert "item 40 of [10, 20, 40] is above its maximum 31" in message
    out = tmp_path / "fox.png"
    result = CliRunner().invoke(app, ["run", str(PIPELINE), "--prompt", "a fox", "-o", str(out),
                                      "--set", "text_encoder_out_layers=[10,20,40]"])
    assert result.exit_code == 2 and "Traceback" not in result.output and not out.exists()
    assert "is above its maximum 31" in result.output.replace("\n", " ")
