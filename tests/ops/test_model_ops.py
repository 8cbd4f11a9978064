"""Model-level helpers (timestep embedding, SwiGLU, adaLN modulation, head split/merge) against
diffusers/torch, and a coverage check that every op in the registry is exercised by this test suite."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_timestep_embedding

from luminal_recipes import ops


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).astype(np.float64))


@pytest.mark.parametrize("dim", [7, 8, 64])
@pytest.mark.parametrize(
    ("flip", "shift", "scale"), [(True, 0.0, 1.0), (False, 1.0, 1.0), (True, 0.0, 1000.0)]
)
def test_timestep_embedding_matches_diffusers(dim, flip, shift, scale, run_op, assert_close):
    """diffusers computes in f32 (timesteps are cast to float32), so that is the reference's precision too."""
    t = np.array([0.0, 0.5, 1.0, 250.5, 999.0], np.float32) / (1000.0 if scale != 1.0 else 1.0)
    got = run_op(
        lambda x: ops.timestep_embedding(
            x, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift, scale=scale
        ),
        t,
    )
    want = get_timestep_embedding(
        torch.from_numpy(t), dim, flip_sin_to_cos=flip, downscale_freq_shift=shift, scale=scale
    )
    assert_close("timestep", got, want)


@pytest.mark.parametrize("kind", ["contiguous", "sliced", "broadcast"])
def test_swiglu(kind, run_op, assert_close, rng, viewed):
    v = viewed(kind, (3, 5, 8), rng)
    a, b = _t(v.value).chunk(2, -1)
    assert_close("elementwise", run_op(ops.swiglu, v), F.silu(a) * b)


def test_modulate(run_op, assert_close, rng):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    scale, shift = (rng.standard_normal((2, 1, 8)).astype(np.float32) for _ in range(2))
    got = run_op(ops.modulate, x, scale, shift)
    assert_close("elementwise", got, _t(x) * (1 + _t(scale)) + _t(shift))


def test_split_and_merge_heads(run_op, assert_close, rng):
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    heads = run_op(lambda t: ops.split_heads(t, 3), x)
    assert_close("movement", heads, _t(x).reshape(2, 5, 3, 4).transpose(1, 2))
    assert_close("movement", run_op(lambda t: ops.merge_heads(ops.split_heads(t, 3)), x), _t(x))


# ---- coverage ----------------------------------------------------------------------------------------------
ALIASES = {"attention": "scaled_dot_product_attention"}


def test_every_registered_op_has_a_test():
    """An op added to the registry without a test against a reference fails here."""
    here = Path(__file__).parent
    sources = "\n".join(
        p.read_text() for p in sorted(here.glob("test_*.py")) + sorted(here.parent.glob("graph/test_*.py"))
    )
    missing = [
        name
        for name in sorted(ops.REGISTRY)
        if not re.search(rf"ops\.{re.escape(ALIASES.get(name, name))}\b", sources)
    ]
    assert not missing, f"ops without a test in tests/ops or tests/graph: {missing}"
