"""Conditional stages (`when:`), the checkpoint's model_index.json in stage expressions, the generic guidance steps,
the tokenizer's conversation options, and model inputs a graph does not read. The FLUX.2 [klein] parity tests
(test_flux2_klein_parity.py) run all of them against diffusers; these pin their rules and errors, fast."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import LuminalError, PipelineError
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.tasks.common import classifier_free_guidance, concat

ROOT = Path(__file__).resolve().parents[2]
KLEIN_TINY = ROOT / "recipes" / "flux2-klein-tiny" / "checkpoint"

def write(tmp_path: Path, when: str, read: str = "a[0]", model_index: dict | None = None) -> Path:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir(exist_ok=True)
    if model_index is not None:
        (checkpoint / "model_index.json").write_text(json.dumps(model_index))
    path = tmp_path / "p.yaml"
    path.write_text("kind: pipeline\nname: when-demo\nparams: {scale: 2.0}\nmodels: {}\n"
                    "inputs: {prompt: {type: str}}\nweights: checkpoint\nstages:\n"
                    "  - {name: base, run: full, inputs: {value: 1.0}, outputs: {value: a}}\n"
                    f"  - name: guided\n    when: \"{when}\"\n    run: full\n    inputs: {{value: scale}}\n"
                    "    outputs: {value: b}\n"
                    f"  - {{name: last, run: full, inputs: {{value: '{read}'}}, outputs: {{value: c}}}}\n"
                    "outputs: {c: {value: c, type: array}}\n")
    return path


@pytest.mark.parametrize("distilled, ran", [(True, False), (False, True), (None, True)])
def test_when_reads_model_index_as_diffusers_reads_its_pipeline_config(tmp_path, distilled, ran):
    index = {"_class_name": "Flux2KleinPipeline"} | ({} if distilled is None else {"is_distilled": distilled})
    path = write(tmp_path, "scale > 1 and not model_index.get('is_distilled', False)", model_index=index)
    report = Pipeline(path).run({"prompt": "x"})
    assert ("guided" in report.stage_seconds) is ran
    assert ("b" in report.values) is ran


def test_a_checkpoint_without_model_index_reads_as_empty(tmp_path):
    path = write(tmp_path, "model_index.get('is_distilled', True)")
    assert "b" in Pipeline(path).run({"prompt": "x"}).values


def test_reading_a_value_only_a_skipped_stage_makes_is_an_error_naming_it(tmp_path):
    path = write(tmp_path, "scale > 5", read="b[0]")
    with pytest.raises(PipelineError, match="'b' has no value: stage 'guided', which makes it, did not run"):
        Pipeline(path).run({"prompt": "x"})


def test_when_must_be_a_boolean(tmp_path):
    path = write(tmp_path, "scale")
    with pytest.raises(PipelineError, match="not true or false"):
        Pipeline(path).run({"prompt": "x"})


@pytest.mark.parametrize("when, name", [("a[0] > 0", "a"), ("prompt == 'x'", "prompt")])
def test_when_cannot_read_stage_values_or_inputs_located(tmp_path, when, name):
    path = write(tmp_path, when)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{path}:10:" in result.stderr and f"'{name}' is not defined" in result.stderr
    assert "decided before the run" in result.stderr


def test_classifier_free_guidance_is_diffusers_formula():
    rng = np.random.default_rng(0)
    cond, uncond = rng.standard_normal((2, 1, 6, 4), dtype=np.float32)
    want = (torch.tensor(uncond) + 3.5 * (torch.tensor(cond) - torch.tensor(uncond))).numpy()
    np.testing.assert_array_equal(classifier_free_guidance(None, cond, 3.5, uncond)["value"], want)
    paired = concat(None, [cond, uncond])["value"]  # one call of batch 2: [cond; uncond]
    np.testing.assert_array_equal(classifier_free_guidance(None, paired, 3.5)["value"], want)
    with pytest.raises(PipelineError, match="even size"):
        classifier_free_guidance(None, cond[:, :1].repeat(3, 0), 2.0)
    with pytest.raises(PipelineError, match="cannot join"):
        concat(None, [cond, uncond[:, :3]], axis=0)


def test_system_message_needs_the_flux2_conversation(tmp_path):
    text = (ROOT / "recipes" / "flux2-klein.yaml").read_text().replace(
        "  conversation: user\n", "  conversation: user\n  system: be brief\n")
    for name in ("flux2-klein.yaml", "qwen3-text-encoder.yaml", "flux2-transformer.yaml",
                 "flux2-transformer-modules.yaml", "flux2-vae-decoder.yaml"):
        (tmp_path / name).write_text((ROOT / "recipes" / name).read_text())
    (tmp_path / "lib").mkdir()
    for lib in (ROOT / "recipes" / "lib").glob("*.yaml"):
        (tmp_path / "lib" / lib.name).write_text(lib.read_text())
    (tmp_path / "flux2-klein.yaml").write_text(text)
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "flux2-klein.yaml")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "has none (a single user message): remove `system`" in result.stderr


def test_klein_tokenizer_refuses_a_checkpoint_without_template(tmp_path):
    from luminal_recipes.tasks.flux2.tokenize import Flux2Tokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((KLEIN_TINY / "tokenizer" / name).read_text())
    with pytest.raises(LuminalError, match="no chat template"):
        Flux2Tokenizer.from_pretrained(folder, conversation="user", generation_prompt=True)
    Flux2Tokenizer.from_pretrained(KLEIN_TINY / "tokenizer", conversation="user")  # with its template: fine


def test_an_input_the_graph_does_not_read_need_not_be_given():
    """FLUX.2 [klein]'s transformer has no guidance embedding: `guidance` is declared, never read."""
    from luminal_recipes.pipeline.engine import ModelEngine, read_inputs
    from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids
    from luminal_recipes.tasks.flux2.steps import rope_tables

    model = Pipeline(ROOT / "recipes" / "flux2-klein-tiny.yaml").model("transformer")
    assert "guidance" in model.inputs and "guidance" not in read_inputs(model)
    rng = np.random.default_rng(0)
    ids = np.concatenate([text_ids(3), latent_ids(2, 2)]).astype(np.float64)
    rope = rope_tables(None, ids, [4, 4, 4, 4], 2000)
    inputs = {"hidden_states": rng.standard_normal((1, 4, 128), dtype=np.float32),
              "encoder_hidden_states": rng.standard_normal((1, 3, 48), dtype=np.float32),
              "timestep": np.float32([0.5]), "rope_cos": rope["cos"], "rope_sin": rope["sin"]}
    engine = ModelEngine(model, compile=False)
    without = engine(inputs)["velocity"]
    with_it = engine({**inputs, "guidance": np.float32([7.0])})["velocity"]  # given anyway: ignored
    np.testing.assert_array_equal(without, with_it)
