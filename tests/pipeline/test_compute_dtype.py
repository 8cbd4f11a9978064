"""The compute dtype chosen per run (``--compute-dtype``, ``recipe.builder.with_compute_dtype``): the tiny FLUX.2
transformer, saved in bf16 by diffusers, computing in bf16 on the numpy runtime agrees with diffusers in float64 on
the same bf16 weights and inputs within tests/TOLERANCES.md's bf16 policy, and is at least as close to it as
diffusers' own bf16 run. The run and inspect commands take the flag; a dtype that is not a compute dtype is refused.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import Flux2Transformer2DModel
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.recipe.builder import build
from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids
from luminal_recipes.tasks.flux2.steps import rope_tables

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "flux2-tiny" / "checkpoint"


@pytest.fixture(scope="module")
def bf16_transformer(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("flux2-bf16") / "transformer"
    Flux2Transformer2DModel.from_pretrained(TINY / "transformer", torch_dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def test_bf16_compute_is_within_bf16_tolerance_of_diffusers(bf16_transformer, assert_close):
    model = build(ROOT / "recipes" / "flux2-transformer.yaml", weights=bf16_transformer, compute_dtype="bf16")
    assert {k: str(t.dtype) for k, t in model.inputs.items()} == {
        "hidden_states": "bf16", "encoder_hidden_states": "bf16", "timestep": "bf16", "guidance": "bf16",
        "rope_cos": "f32", "rope_sin": "f32"}  # the rotary tables are declared f32: they stay so
    cfg = Flux2Transformer2DModel.load_config(bf16_transformer)
    rng = np.random.default_rng(1)
    h, w, t = 3, 4, 9
    bf = ml_dtypes.bfloat16  # inputs rounded to the graph's dtype first (TOLERANCES.md)
    x = rng.standard_normal((1, h * w, cfg["in_channels"])).astype(bf).astype(np.float32)
    c = rng.standard_normal((1, t, cfg["joint_attention_dim"])).astype(bf).astype(np.float32)
    timestep, guidance = np.float32([0.73]).astype(bf).astype(np.float32), np.float32([4.0])
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, list(cfg["axes_dims_rope"]), cfg["rope_theta"])
    got = ModelEngine(model)({"hidden_states": x, "encoder_hidden_states": c, "timestep": timestep,
                              "guidance": guidance, "rope_cos": rope["cos"], "rope_sin": rope["sin"]})["velocity"]
    assert got.dtype == np.float32  # model outputs reach host steps as f32

    def diffusers(dtype):
        ref = Flux2Transformer2DModel.from_pretrained(bf16_transformer, torch_dtype=dtype)
        with torch.no_grad():
            return ref(hidden_states=torch.tensor(x, dtype=dtype), encoder_hidden_states=torch.tensor(c, dtype=dtype),
                       timestep=torch.tensor(timestep, dtype=dtype), guidance=torch.tensor(guidance, dtype=dtype),
                       img_ids=torch.tensor(latent_ids(h, w)).float(), txt_ids=torch.tensor(text_ids(t)).float(),
                       return_dict=False)[0].double().numpy()

    want = diffusers(torch.float64)
    assert_close("runtime", got, want, "bf16")
    ours, theirs = np.abs(got - want).max(), np.abs(diffusers(torch.bfloat16) - want).max()
    assert ours <= theirs, f"bf16 error {ours:.3g} vs diffusers' own bf16 error {theirs:.3g}"


def test_the_commands_take_the_compute_dtype(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(ROOT / "recipes" / "flux2-tiny.yaml"), "--compute-dtype", "f8e4m3",
                                 "-p", "x", "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "--compute-dtype f8e4m3" in result.stderr and "bf16" in result.stderr
    assert not (tmp_path / "x.png").exists()
    result = runner.invoke(app, ["run", str(ROOT / "recipes" / "flux2-tiny.yaml"), "--compute-dtype", "bf16",
                                 "--no-compile", "--steps", "1", "--width", "32", "--height", "32", "--set",
                                 "max_sequence_length=16", "-p", "a red fox", "--json", "-o", str(tmp_path / "y.png")])
    assert result.exit_code == 0, result.output
    import json

    summary = json.loads(result.stdout)
    assert summary["memory"]["compute_dtype"] == "bf16"
    f32 = runner.invoke(app, ["run", str(ROOT / "recipes" / "flux2-tiny.yaml"), "--no-compile", "--steps", "1",
                              "--width", "32", "--height", "32", "--set", "max_sequence_length=16", "-p", "a red fox",
                              "--json", "-o", str(tmp_path / "z.png")])
    plans = summary["memory"]["plans"]
    plans32 = json.loads(f32.stdout)["memory"]["plans"]
    for stage in ("transformer", "vae"):  # activations held in bf16: half the bytes of f32
        assert plans[stage]["activation_bytes"] < 0.6 * plans32[stage]["activation_bytes"], stage
