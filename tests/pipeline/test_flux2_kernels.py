"""Which kernels the compiled tiny FLUX.2 transformer is made of: passes the op library and the rules must keep
out of every step (each one a whole read and write of an activation). Values are the parity tests' business
(test_flux2_parity.py); these pin the structure that makes a step fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"


@pytest.fixture(scope="module")
def program():
    """The tiny transformer's program as a denoising step compiles it (6 x 8 latents, 16 text tokens)."""
    from luminal_recipes.tasks.flux2.steps import rope_tables

    pipe = Pipeline(RECIPE, weights=CHECKPOINT, sets=["max_sequence_length=16"])
    model = pipe.model("transformer")
    cfg = json.loads((CHECKPOINT / "transformer" / "config.json").read_text())
    rng = np.random.default_rng(0)
    h, w, t = 6, 8, 16
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, list(cfg["axes_dims_rope"]), cfg["rope_theta"])
    engine = ModelEngine(model)
    engine({"hidden_states": rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, t, cfg["joint_attention_dim"])).astype(np.float32),
            "timestep": np.float32([0.5]), "guidance": np.float32([4.0]),
            "rope_cos": rope["cos"], "rope_sin": rope["sin"]})
    return engine.stats.plan.program


def test_rope_reads_the_swapped_pairs_in_place(program):
    """RoPE's pair swap (x0, x1) -> (x1, x0) is a view (the pair axis reversed), read by the rotation's own
    Elementwise pass: no kernel copies the swapped q or k (before: one Concat over the pair axis per q and k)."""
    pair_copies = [n for n in program.nodes if n.op in ("Concat", "Copy") and n.shape and n.shape[-1] == 2]
    assert not pair_copies, [f"{n.op} {n.shape}" for n in pair_copies]
    reversed_reads = [n for n in program.nodes if n.op == "Elementwise"
                      and any(isinstance(s, int) and s < 0 for _, v in n.inputs for s in v.strides)]
    assert reversed_reads, "no Elementwise reads a reversed view: the RoPE rotation is not built on the pairs"
