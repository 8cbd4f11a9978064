"""Which kernels the compiled tiny FLUX.2 transformer is made of: passes the op library and the rules must keep
out of every step (each one a whole read and write of an activation). Values are the parity tests' business
(test_flux2_parity.py); these pin the structure that makes a step fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from luminal_recipes.pipeline.driver import Pipeline

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"


@pytest.fixture(scope="module")
def program():
    """The tiny transformer's program for 6 x 8 latents and 16 text tokens, as the cost model ranks the rules'
    candidates (timing them, as a pipeline's search does, may pick another program on a loaded machine)."""
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.runtimes.registry import get_runtime

    model = Pipeline(RECIPE, weights=CHECKPOINT, sets=["max_sequence_length=16"]).model("transformer")
    dims = {"batch": 1, "img": 48, "txt": 16}
    return compile_graph(model.graph, get_runtime("numpy"), dims,
                         options=SearchOptions(time_top=0, use_cache=False)).program


def test_rope_reads_the_swapped_pairs_in_place(program):
    """RoPE's pair swap (x0, x1) -> (x1, x0) is a view (the pair axis reversed): no kernel copies the swapped q or
    k (before: one Concat over the pair axis per q and k)."""
    pair_copies = [n for n in program.nodes if n.op in ("Concat", "Copy") and n.shape and n.shape[-1] == 2]
    assert not pair_copies, [f"{n.op} {n.shape}" for n in pair_copies]


def test_each_qk_norm_and_its_rotation_are_one_pass(program):
    """Every q/k RMSNorm (with its weight) and the rotation after it are one RMSNormRoPE kernel reading the
    projection in place: no RMSNorm writes a normed q/k that an Elementwise rotation reads back (before: one
    RMSNorm and one Elementwise pass per q and k). The double blocks rotate text and image q/k separately (their
    own rows of the tables), so each of their four norms is fused too; 1 double + 2 single blocks: 4 + 4."""
    counts = program.kernel_counts()
    assert counts.get("RMSNormRoPE") == 4 * 1 + 2 * 2 and "RMSNorm" not in counts, counts
    reversed_reads = [n.op for n in program.nodes if n.op != "RMSNormRoPE"
                      and any(isinstance(s, int) and s < 0 for _, v in n.inputs for s in v.strides)]
    assert not reversed_reads, reversed_reads


def test_no_product_reads_a_concatenation(program):
    """The single blocks project [attention | MLP] with one weight: as two products, the second adding the
    first's result (matmul.egg, "matmul over a concatenation along K"), not a Concat written and read back."""
    concats = {n.id for n in program.nodes if n.op == "Concat"}
    fed = [n for n in program.nodes if n.op == "MatMul" and any(src in concats for src, _ in n.inputs)]
    assert not fed, [f"MatMul {n.shape}" for n in fed]
    assert any(n.op == "MatMul" and len(n.inputs) == 3 and n.inputs[2][0] in
               {m.id for m in program.nodes if m.op == "MatMul"} for n in program.nodes)
