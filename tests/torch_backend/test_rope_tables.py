"""diffusers' FLUX.2 RoPE tables through torch.compile: computed in float64 from the f32 positions, repeated
(repeat_interleave: a reshape strides cannot express, so a materialised copy) and cast back to float32. Each table
is one element-wise kernel reading the positions (the casts to float64 and back fused into it) and one f32 copy:
no Cast step, no float64 copy. Values against eager PyTorch (which computes them in float64, then rounds once)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from torch_twins import compiled_programs  # noqa: E402  (tests/torch_backend/torch_twins.py)

from luminal_recipes.graph import DType, Graph, cast, run_reference  # noqa: E402


def test_flux2_rope_tables_are_one_kernel_and_one_f32_copy_each(monkeypatch):
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    module = Flux2PosEmbed(theta=2000, axes_dim=[4, 4, 4, 4])
    side = 8
    grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), torch.zeros(1),
                          indexing="ij")
    ids = torch.stack(grid, -1).reshape(-1, 4) * 97.0 + 3.0  # positions up to ~700: f32 angles would be off
    got, programs = compiled_programs(module, (ids,), monkeypatch)
    want = module(ids)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert (g - w).abs().max().item() <= 2e-7  # float64 angles, one rounding to float32
    (program,) = programs
    counts = program.kernel_counts()
    assert "Cast" not in counts, counts
    by_id = {n.id: n for n in program.nodes}
    f64 = [n for n in program.nodes if n.dtype == DType.F64]
    # the only float64 buffer: the frequencies (shared by the four axes' tables of one length)
    assert len(f64) == 1 and f64[0].op == "Elementwise", [(n.op, n.dtype) for n in f64]
    tables = [n for n in program.nodes if n.op == "Elementwise" and n.dtype == DType.F32
              and any(by_id[i].op == "Input" for i, _ in n.inputs)]
    assert len(tables) == 8  # cos and sin of four axes, each reading the positions
    copies = [n for n in program.nodes if n.op == "Copy"]
    assert copies and all(n.dtype == DType.F32 for n in copies)


def test_a_narrowing_cast_of_a_materialised_view_casts_before_the_copy():
    """graph.cast: a cast of contiguous()'s buffer casts the viewed tensor in its own shape, then copies the
    narrower values (the same elements in the same order); a widening cast, or a plain tensor, is one Cast."""
    g = Graph()
    x = g.input("x", (3, 2), "f64")
    repeated = x.reshape(3, 2, 1).expand(2, 2).reshape(3, 4)  # a reshape strides cannot express: a copy
    narrow = cast(repeated, "f32")
    node = g.node(narrow.node)
    assert node.op == "Add" and node.dtype == DType.F32  # the copy, of f32 values
    (producer, _), _ = node.inputs
    assert g.node(producer).op == "Cast" and g.node(g.node(producer).inputs[0][0]).op == "Input"
    wide = cast(cast(repeated, "f32"), "f64")
    assert g.node(wide.node).op == "Cast"
    assert g.node(cast(x, "f32").node).op == "Cast"
    g.mark_output("narrow", narrow)
    values = np.array([[1.0 + 2.0**-40, -0.0], [3.5, 1e30], [-7.25, 2.0**-30]])
    want = np.repeat(values, 2, axis=1).astype(np.float32)
    got = run_reference(g, {"x": values})["narrow"]
    assert got.dtype == np.float32 and np.array_equal(got, want)
