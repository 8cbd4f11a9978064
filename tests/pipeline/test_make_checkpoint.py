"""The tiny checkpoint: reproducible from its script, small, and loadable by diffusers as it stands."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_files import files
from diffusers import Flux2Pipeline

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", ROOT / "recipes" / "flux2-tiny" / "make_checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_layout_and_size():
    index = json.loads((CHECKPOINT / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline"
    for component in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        assert (CHECKPOINT / component).is_dir() and component in index
    total = sum(len(data) for data in files(CHECKPOINT).values())
    assert total < 20e6, f"the tiny checkpoint grew to {total / 1e6:.1f} MB"


def test_committed_weights_are_what_the_script_writes(script, tmp_path):
    out = script.build(tmp_path / "a", "a", tokenizer_from=CHECKPOINT)
    assert files(out) == files(CHECKPOINT)


def test_variant_b_runs_in_diffusers(script, tmp_path):
    out = script.build(tmp_path / "b", "b", tokenizer_from=CHECKPOINT)
    variant = script.VARIANTS["b"]
    pipe = Flux2Pipeline.from_pretrained(out)
    assert pipe.text_encoder.config.text_config.hidden_size == variant.text_hidden
    assert pipe.transformer.config.joint_attention_dim == 3 * variant.text_hidden
    image = pipe(
        prompt="a cat",
        height=48,
        width=80,
        num_inference_steps=2,
        guidance_scale=4.0,
        output_type="np",
        text_encoder_out_layers=variant.text_encoder_out_layers,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 48, 80, 3)
    assert np.isfinite(image).all() and image.std() > 0.05
